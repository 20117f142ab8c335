"""The planner and the FLOP model on Open-Sora 2.0's MMDiT: its two block kinds (checkpointed per
kind by ``memory.checkpoint_blocks``), the text stream each block takes in (kept by full
checkpointing, whole on every SP rank), its encoders' geometry and the opensora-v2 recipes.

Measurement as in ``test_planner.py``: one training step of the real Trainer under ``LiveMemory``,
fp32 on CPU, mmdit-tiny with a caption of 128 tokens (as long as the image's 128 tokens per
sample, so the text's share is visible as at 512 text / 2,304 image tokens).
"""

import dataclasses
import json
from pathlib import Path

import pytest

from conftest import tiny_overrides, torchrun
from videodit.cli import main
from videodit.config import MemoryConfig, load_config
from videodit.models.families import get_spec
from videodit.models.flops import forward_flops, train_step_flops
from videodit.parallel.dims import ParallelDims
from videodit.planner.measure import measure_trainer, synthetic_batch
from videodit.planner.plan import KNOWN_LATENTS, planner_from_config
from videodit.train.trainer import Trainer

GIB = 2**30
SHAPE = (2, 8, 16, 16)   # batch, frames, height, width: 2 x 8 x 8 x 8 = 1,024 image tokens
WORKER = Path(__file__).parents[1] / "parallel" / "workers" / "memory_worker.py"
# recipe: parameters (the high-compression model's patch-1 embedders and final layer are wider)
RECIPES = {"opensora-v2-stage1": 11_891_390_528, "opensora-v2-stage2": 11_891_390_528,
           "opensora-v2-i2v": 11_891_390_528, "opensora-v2-hc": 11_891_971_200}


def mmdit_overrides(toy_dir, **extra) -> list[str]:
    """mmdit-tiny (2 double + 2 single blocks, hidden 64) on the toy data, fp32, 128 caption tokens."""
    values = {"model.preset": "mmdit-tiny", "train.precision": "fp32", "text.dim": 32, "text.max_length": 128,
              **extra}
    return [o for o in tiny_overrides(toy_dir, **values)
            if not o.startswith(("model.depth", "model.hidden_size", "model.num_heads", "model.patch_size"))]


# name: (overrides, tolerance on activations)
MEASURED = {
    "plain": ({}, 0.03),
    "selective": ({"memory.checkpointing": "selective"}, 0.05),
    # each block keeps its image and its text input (the shared RoPE table, ~3% here, is not counted)
    "full": ({"memory.checkpointing": "full"}, 0.05),
    # Open-Sora 2.0's stage-1 setting at this depth: the first double block and every single block
    "per-kind-stage1": ({"memory.checkpointing": "full", "memory.checkpoint_blocks": "{double: 1, single: 100}"},
                        0.02),
    # the double blocks (which keep more than single ones) checkpointed, the single ones plain
    "per-kind-double": ({"memory.checkpointing": "full", "memory.checkpoint_blocks": "{double: 2}"}, 0.02),
}


@pytest.mark.parametrize("name", MEASURED)
def test_mmdit_planner_matches_measurement(name, toy_dir, tmp_path):
    extra, tolerance = MEASURED[name]
    cfg = load_config("tiny", mmdit_overrides(toy_dir, **extra))
    measured = measure_trainer(Trainer(cfg, tmp_path / "run"), synthetic_batch(*SHAPE)).as_dict()
    predicted = planner_from_config(cfg, gpu_bytes=1).estimate(*SHAPE).as_dict()
    for key, allowed in (("activations", tolerance), ("params", 0.0), ("grads", 0.0), ("optimizer", 0.0)):
        ratio = predicted[key] / measured[key]
        assert abs(ratio - 1) <= allowed, f"{name}: {key} predicted/measured = {ratio:.3f}"
    assert measured["peak"] <= predicted["peak"]


def test_mmdit_planner_with_sequence_parallel_keeps_the_text_whole(toy_dir):
    """sp=2 (replicated weights, so the activations are SP's alone): each rank keeps half the
    image tokens and all 128 caption tokens, in every block and as every checkpointed input."""
    overrides = mmdit_overrides(toy_dir, **{"parallel.sp": 2, "parallel.dp_shard": 1,
                                            "memory.checkpointing": "full",
                                            "memory.checkpoint_blocks": "{double: 1, single: 100}"})
    result = torchrun(2, str(WORKER), json.dumps({"overrides": overrides, "shape": list(SHAPE)}))
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 2
    for report in reports:
        ratio = report["predicted"]["activations"] / report["measured"]["activations"]
        assert abs(ratio - 1) <= 0.05, f"sp=2 rank {report['rank']}: activations predicted/measured = {ratio:.3f}"


def test_checkpoint_blocks_count_per_kind_in_the_planner_and_the_flops(toy_dir):
    cfg = load_config("tiny", mmdit_overrides(toy_dir, **{"memory.checkpointing": "full",
                                                         "memory.checkpoint_blocks": "{double: 1, single: 100}"}))
    planner = planner_from_config(cfg, gpu_bytes=1)
    assert planner.counts.kinds == ("double", "double", "single", "single")
    assert planner.estimate(*SHAPE).detail["checkpointed_blocks"] == 3
    # FLOPs: the recompute is the forward of blocks 0, 2 and 3 (the double blocks cost more).
    g, frames, height, width, length = planner.geometry, 2, 8, 8, 128
    count = forward_flops(g, frames, height, width, length)
    plain = train_step_flops(g, 1, frames, height, width, length, dataclasses.replace(cfg.memory, checkpointing="none"))
    chosen = train_step_flops(g, 1, frames, height, width, length, cfg.memory)
    assert chosen.model == plain.model
    assert chosen.hardware - plain.hardware == pytest.approx(count.blocks[0] + count.blocks[2] + count.blocks[3])
    assert count.blocks[0] > count.blocks[2]


def test_gathered_weights_without_resharding_are_every_block_of_the_rank():
    """parallel.reshard_after_forward=false (Open-Sora's zero2): every block's bf16 weights stay
    gathered from its forward to its backward, not just the two in flight."""
    cfg = load_config("opensora-v2-stage1")
    rows = {}
    for reshard in (True, False):
        run = load_config("opensora-v2-stage1", [f"parallel.reshard_after_forward={str(reshard).lower()}"])
        rows[reshard] = planner_from_config(run, 141 * GIB, world_size=8).estimate(1, 1, 256, 256)
    counts = planner_from_config(cfg, 141 * GIB, world_size=8).counts
    block_bf16 = counts.block_params / counts.depth_blocks * 2
    assert rows[False].temporaries - rows[True].temporaries == pytest.approx((57 - 2) * block_bf16, rel=1e-6)
    assert rows[False].activations == rows[True].activations


def test_opensora2_latents_are_known():
    hunyuan, dc_ae = KNOWN_LATENTS["hunyuan"](), KNOWN_LATENTS["opensora-dc-ae"]()
    assert (hunyuan.channels, hunyuan.temporal, hunyuan.spatial) == (16, 4, 8)
    assert [hunyuan.frames(n) for n in (1, 5, 33, 129)] == [1, 2, 9, 33]        # 4k + 1 -> k + 1
    assert (dc_ae.channels, dc_ae.temporal, dc_ae.spatial) == (128, 4, 32)
    assert [dc_ae.frames(n) for n in (1, 16, 32, 128)] == [1, 4, 8, 32]          # T / 4


def test_pipeline_stages_count_the_single_blocks():
    """spec.blocks_of: 19 double + 38 single blocks; parallel.pp is checked against all 57."""
    model = load_config("opensora-v2-stage1").model
    spec = get_spec("mmdit")
    assert spec.blocks_of(model) == 57
    dims = ParallelDims.from_config(load_config("tiny", ["parallel.pp=24", "parallel.dp_shard=1"]).parallel, 24)
    dims.check_model(num_heads=24, hidden_size=3072, depth=model.depth, spec=spec, blocks=spec.blocks_of(model))
    assert dims.check_pipeline(load_config("tiny", ["parallel.pp=24"]).parallel, blocks=57) == (1, 24)


@pytest.mark.parametrize("recipe", RECIPES)
def test_opensora2_recipes_plan_without_latent_or_caption(recipe, capsys):
    assert main(["plan", recipe, "--gpu-mem", "141GiB", "--world-size", "8", "--encoder-mem", "9.6GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["num_params"] == RECIPES[recipe]
    assert plan["buckets"] and all(b["max_batch_size"] > 0 for b in plan["buckets"])
    cfg = load_config(recipe)
    buckets = {(b["resolution"], b["num_frames"]) for b in plan["buckets"]}
    assert buckets == {(r, int(n)) for r, frames in cfg.data.bucket_config.items() for n in frames}


def test_cheapest_fix_checkpoints_every_block_past_checkpoint_blocks():
    """With (8, 100) nothing fits; checkpointing every block (checkpoint_blocks dropped) is the fix."""
    cfg = load_config("opensora-v2-stage1")
    planner = planner_from_config(cfg, 70 * GIB, world_size=8, encoder_bytes=0)
    assert planner.max_batch(129, 256, 256) == 0
    assert planner.cheapest_fix(129, 256, 256) == "memory.checkpointing=full (all blocks)"
    every = planner.estimate(1, 129, 256, 256, memory={"checkpoint_blocks": None})
    assert every.detail["checkpointed_blocks"] == 57
    assert MemoryConfig(checkpointing="full", checkpoint_blocks={"double": 8, "single": 100}) \
        .checkpointed_blocks(57, list(planner.counts.kinds)) == list(range(8)) + list(range(19, 57))
