"""Parallel sizes: resolution, Open-Sora aliases and the errors users see before anything is built."""

import pytest

from videodit.config import load_config
from videodit.errors import UserError
from videodit.models.families import get_spec
from videodit.parallel.dims import ParallelDims

STDIT = get_spec("stdit")


def dims(world, *overrides):
    return ParallelDims.from_config(load_config("tiny", list(overrides)).parallel, world)


def test_dp_shard_fills_the_rest_of_the_world():
    d = dims(8, "parallel.sp=2")
    assert (d.dp_replicate, d.dp_shard, d.sp, d.dp_size) == (1, 4, 2, 4)
    assert d.data_parallel == "fsdp"
    assert dims(4, "parallel.dp_replicate=2").data_parallel == "hsdp"
    assert dims(2, "parallel.dp_shard=1", "parallel.dp_replicate=2").data_parallel == "ddp"
    # dp_shard=-1 shards over the SP ranks even when they are all the ranks; 1 keeps DDP.
    assert dims(2, "parallel.sp=2").data_parallel == "fsdp"
    assert dims(2, "parallel.sp=2", "parallel.dp_shard=1").data_parallel == "ddp"   # SP ranks average gradients
    assert dims(1).data_parallel == "none"


def test_open_sora_aliases_map_onto_the_parallel_section():
    cfg = load_config("tiny", ["sp_size=2", "zero_stage=2"])
    assert cfg.parallel.sp == 2 and cfg.parallel.reshard_after_forward is False
    assert load_config("tiny", ["parallel.zero_stage=0"]).parallel.dp_shard == 1
    assert load_config("tiny", ["parallel.tp_size=2"]).parallel.tp == 2
    with pytest.raises(UserError, match="zero_stage=5 is not allowed"):
        load_config("tiny", ["zero_stage=5"])
    with pytest.raises(UserError, match="parallel.sp=4 conflicts"):
        load_config("tiny", ["sp_size=2", "parallel.sp=4"])


def test_sizes_that_do_not_multiply_to_the_world_are_refused():
    with pytest.raises(UserError, match=r"sizes sp=3 multiply to 3, which does not divide the world size 4.*divisors: 1, 2, 4"):
        dims(4, "parallel.sp=3")
    with pytest.raises(UserError, match=r"sizes dp_replicate=2 x dp_shard=4 multiply to 8 but the job has 4 process"):
        dims(4, "parallel.dp_replicate=2", "parallel.dp_shard=4")


def test_sizes_that_do_not_fit_the_model_name_the_valid_ones():
    d = dims(3, "parallel.sp=3")
    with pytest.raises(UserError, match=r"parallel.sp=3 does not divide model.num_heads=16; valid: 1, 2, 4, 8, 16"):
        d.check_model(num_heads=16, hidden_size=1152, depth=28, spec=STDIT)
    with pytest.raises(UserError, match=r"parallel.tp=5 does not divide .*valid: 1, 2, 3, 6"):
        dims(5, "parallel.tp=5").check_model(num_heads=6, hidden_size=384, depth=12, spec=STDIT)
    with pytest.raises(UserError, match="pp=64 exceeds the model's 56 blocks"):
        dims(64, "parallel.pp=64").check_model(num_heads=16, hidden_size=1152, depth=28, spec=STDIT)
    dims(4, "parallel.sp=4").check_model(num_heads=16, hidden_size=1152, depth=28, spec=STDIT)


def test_tensor_and_sequence_parallel_must_split_the_heads_together():
    dims(4, "parallel.tp=2", "parallel.sp=2").check_model(num_heads=4, hidden_size=128, depth=4, spec=STDIT)
    with pytest.raises(UserError, match=r"sp=2 x parallel.tp=2 does not divide model.num_heads=6.*valid sp: 1, 3"):
        dims(4, "parallel.tp=2", "parallel.sp=2").check_model(num_heads=6, hidden_size=384, depth=4, spec=STDIT)


def test_tensor_and_pipeline_parallel_replace_ddp_by_fsdp():
    assert dims(4, "parallel.tp=2", "parallel.dp_shard=1", "parallel.dp_replicate=2").data_parallel == "hsdp"
    assert dims(4, "parallel.pp=2", "parallel.sp=1", "parallel.dp_shard=2").data_parallel == "fsdp"
    assert dims(2, "parallel.tp=2").data_parallel == "none"


def pipeline(world, *overrides, depth=4):
    d = dims(world, *overrides)
    return d.check_pipeline(load_config("tiny", list(overrides)).parallel, blocks=2 * depth)


def test_pipeline_options_resolve_and_bad_ones_name_the_fix():
    assert pipeline(2, "parallel.pp=2") == (1, 2)
    assert pipeline(2, "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b") == (2, 4)
    assert pipeline(2, "parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.pp_microbatches=3") == (1, 3)
    with pytest.raises(UserError, match="pp_microbatches=3: 1f1b needs a multiple of parallel.pp=2; valid: 2, 4"):
        pipeline(2, "parallel.pp=2", "parallel.pp_microbatches=3")
    with pytest.raises(UserError, match="interleaved_1f1b needs parallel.pp_stages_per_rank >= 2"):
        pipeline(2, "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=1")
    with pytest.raises(UserError, match="pp_stages_per_rank=2 needs parallel.pp_schedule=interleaved_1f1b"):
        pipeline(2, "parallel.pp=2", "parallel.pp_stages_per_rank=2")
    with pytest.raises(UserError, match="= 16 stages but the model has 8 blocks"):
        pipeline(8, "parallel.pp=8", "parallel.pp_schedule=interleaved_1f1b")
    with pytest.raises(UserError, match="parallel.pp=2 with parallel.sp=2 is not supported"):
        pipeline(4, "parallel.pp=2", "parallel.sp=2")
