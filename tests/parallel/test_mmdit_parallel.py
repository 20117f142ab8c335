"""The MMDiT family under torchrun (gloo, CPU, fp32) against one process, on the same batch: the
joint-attention sequence parallelism alone on random q/k/v (``parallel/joint_attention.py``), then
a tiny MMDiT through ``parallelize``: FSDP2 (ZeRO-3 and -2), TP=2 (Open-Sora's policy with the
single blocks' fused v_mlp/linear2) alone, under FSDP2 and with Ulysses SP, ring SP=2 and 3 (4 on
the attention alone: a slice of padding only), Ulysses SP=2, Ulysses x ring, PP=2 with the stage
boundary inside the double and inside the single stack, checkpointing by block kind with the
inputs offloaded (the CPU stand-in), and LoRA under FSDP2 + SP; TP's fused shards written as DCP
shards and read back. One launch per process count; every rank runs the unsharded reference.
Loss and every gradient within 1e-5 of the largest magnitude (observed ~1e-6; fp64 ~1e-15).

Also, without torchrun: the one-line SP size errors, the TP plan's fused parts, the per-kind
choice of checkpointed blocks and its errors.
"""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import torchrun
from videodit.config import MemoryConfig
from videodit.errors import UserError

WORKER = Path(__file__).parent / "workers" / "mmdit_worker.py"
TOLERANCE = {"float32": 1e-5, "float64": 1e-12}
# 512 image tokens and 300 caption tokens: every checkpointed block's inputs clear the offload floor (64 KiB).
BIG = {"grid": [8, 16, 16], "text": 300}
CHECKPOINT_KINDS = {"checkpointing": "selective", "checkpoint_blocks": {"double": 2, "single": 1}}
LAYOUTS = {
    2: [
        {"name": "attention_ring", "kind": "attention", "sp": 2, "ring": 2, "image": 9, "text": 5, "mask": True},
        {"name": "attention_ulysses", "kind": "attention", "sp": 2, "ring": 1, "image": 9, "text": 5, "mask": True},
        {"name": "attention_ring_fp64", "kind": "attention", "sp": 2, "ring": 2, "image": 9, "text": 5,
         "mask": True, "dtype": "float64"},
        {"name": "fsdp", "kind": "model", "parallel": {"dp_shard": 2}},
        {"name": "fsdp_zero2", "kind": "model", "parallel": {"dp_shard": 2, "reshard_after_forward": False}},
        {"name": "tp", "kind": "model", "parallel": {"tp": 2}},
        {"name": "ring", "kind": "model", "parallel": {"sp": 2, "sp_ring": 2}},
        {"name": "ring_unmasked", "kind": "model", "parallel": {"sp": 2, "sp_ring": 2}, "mask": False},
        {"name": "ulysses", "kind": "model", "parallel": {"sp": 2}},
        {"name": "pp_inside_double", "kind": "model", "parallel": {"pp": 2}, "blocks": [3, 1]},
        {"name": "pp_inside_single", "kind": "model", "parallel": {"pp": 2}, "blocks": [1, 3]},
        {"name": "checkpoint_kinds_offload", "kind": "model", "parallel": {"sp": 2, "sp_ring": 2}, "blocks": [3, 2],
         "memory": CHECKPOINT_KINDS, "offload": True, **BIG},
        {"name": "lora_fsdp_sp", "kind": "model", "parallel": {"sp": 2}, "lora": True},
    ],
    3: [
        {"name": "attention_ring3", "kind": "attention", "sp": 3, "ring": 3, "image": 10, "text": 5, "mask": True},
        {"name": "ring3", "kind": "model", "parallel": {"sp": 3, "sp_ring": 3}},
    ],
    4: [
        {"name": "attention_ring4", "kind": "attention", "sp": 4, "ring": 4, "image": 9, "text": 5, "mask": True},
        {"name": "attention_usp_fp64", "kind": "attention", "sp": 4, "ring": 2, "image": 10, "text": 5,
         "mask": True, "dtype": "float64"},
        {"name": "usp", "kind": "model", "parallel": {"sp": 4, "sp_ring": 2}},
        {"name": "tp_fsdp", "kind": "model", "parallel": {"tp": 2, "dp_shard": 2}},
        {"name": "tp_ulysses", "kind": "model", "parallel": {"tp": 2, "sp": 2}},
        {"name": "lora_fsdp_sp", "kind": "model", "parallel": {"sp": 2, "dp_shard": 2}, "lora": True},
    ],
}
# LoRA targets of the worker's model: 5 layers per double block, 3 per single one, 2 adapters each.
LORA_GRADIENTS = 2 * (5 * 2 + 3 * 2)


def run_layouts(tmp_path, nproc: int, layouts: list[dict]) -> dict:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out": str(tmp_path / "results.json"), "layouts": layouts}))
    result = torchrun(nproc, str(WORKER), str(spec))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((tmp_path / "results.json").read_text())


@pytest.mark.parametrize("nproc", sorted(LAYOUTS))
def test_layouts_match_one_process(tmp_path, nproc):
    # With 2 processes also: TP's strided fused shards through DCP (what sharded checkpoints write).
    checkpoint = [{"name": "tp_checkpoint", "kind": "checkpoint", "folder": str(tmp_path / "ckpt")}] * (nproc == 2)
    results = run_layouts(tmp_path, nproc, LAYOUTS[nproc] + checkpoint)
    for layout in checkpoint:   # read whole by one process, loaded back under TP: exact
        assert results[layout["name"]] == {"read": 0.0, "reloaded": 0.0, "strided": 4}, results[layout["name"]]
    for layout in LAYOUTS[nproc]:
        got = results[layout["name"]]
        tolerance = TOLERANCE[layout.get("dtype", "float32")]
        assert got["out"] < tolerance and got["grad"] < tolerance, (layout["name"], got)
        if layout.get("lora"):
            assert got["gradients"] == LORA_GRADIENTS, (layout["name"], got)
        if layout.get("memory"):
            # The first 2 double and the first single block ran their attention again in backward, and
            # each sent its image and caption inputs to the host (one of them back unprefetched: the last).
            assert got["calls"] == [["double", 2.0], ["double", 2.0], ["double", 1.0], ["single", 2.0],
                                    ["single", 1.0]], got["calls"]
            assert got["offloaded"] == 2 * 3 and got["unprefetched"] == 2, got


def test_sequence_parallel_sizes_are_one_line_user_errors():
    from videodit.models.mmdit.parallel_plan import check_sequence_parallel
    check_sequence_parallel(24, tp=1, sp=3, ring=3)    # ring attention: any sp, the caption whole
    check_sequence_parallel(24, tp=2, sp=4, ring=1)    # 12 heads per TP rank over 4 Ulysses ranks
    with pytest.raises(UserError, match=r"^parallel.sp=8 with parallel.sp_ring=1 leaves 8 Ulysses ranks, which do "
                                        r"not divide the 12 attention heads per tensor-parallel rank; valid "
                                        r"parallel.sp_ring: 2, 4, 8 \(sp_ring=8: ring attention only, any sp\)$"):
        check_sequence_parallel(24, tp=2, sp=8, ring=1)
    with pytest.raises(UserError, match=r"^parallel.sp_ring=2 does not divide parallel.sp=3; valid: 1, 3$"):
        check_sequence_parallel(24, tp=1, sp=3, ring=2)


def test_tensor_parallel_plan_is_open_soras_policy():
    from videodit.models.mmdit.model import MMDiT, MMDiTGeometry
    from videodit.models.mmdit.parallel_plan import tensor_parallel_plan
    with torch.device("meta"):
        model = MMDiT(MMDiTGeometry(hidden_size=64, num_heads=4, depth=1, depth_single_blocks=1, latent_channels=4,
                                    vec_in_dim=8, context_in_dim=16, axes_dim=(4, 6, 6)))
    plan = tensor_parallel_plan()
    double, single = (plan.block(block) for block in model.blocks)
    assert double["img_attn.q_proj"] == double["txt_attn.v_proj"] == double["img_mlp.0"] == "colwise"
    assert double["txt_attn.proj"] == double["txt_mlp.2"] == "rowwise"
    assert single == {"q_proj": "colwise", "k_proj": "colwise", "v_mlp": ("fused_colwise", (64, 256)),
                      "linear2": ("fused_rowwise", (64, 256))}
    for name in (*double, *single):   # every planned layer exists
        assert isinstance((model.blocks[0] if name in double else model.blocks[1]).get_submodule(name), nn.Linear)
    assert plan.partial == ("query_norm", "key_norm") and plan.root == {}


def test_fused_sharding_needs_whole_mlp_chunks():
    from videodit.parallel.tensor import _style
    assert _style(("fused_colwise", (64, 256))).chunks == 5
    with pytest.raises(UserError, match=r"parts \[64, 160\] only when every part is a multiple of the first \(64\); "
                                        r"use an integer model.mlp_ratio or parallel.tp=1$"):
        _style(("fused_rowwise", (64, 160)))


KINDS = ["double"] * 3 + ["single"] * 4


@pytest.mark.parametrize("counts, expected", [
    ({"double": 2, "single": 100}, [0, 1, 3, 4, 5, 6]),   # Open-Sora 2.0 stage 1's (8, 100), scaled down
    ({"single": 1}, [3]),                                  # a kind left out: none of it
    ({"double": 0, "single": 0}, []),
])
def test_checkpoint_blocks_by_kind(counts, expected):
    memory = MemoryConfig(checkpointing="full", checkpoint_blocks=counts)
    assert memory.checkpointed_blocks(len(KINDS), KINDS) == expected
    assert MemoryConfig(checkpoint_blocks=counts).checkpointed_blocks(len(KINDS), KINDS) == []


@pytest.mark.parametrize("memory, message", [
    (MemoryConfig(checkpointing="full", checkpoint_blocks={"dual": 8}),
     r"^memory.checkpoint_blocks has dual: 8; give a count >= 0 per block kind of this model: "
     r"\{double: n, single: n\}$"),
    (MemoryConfig(checkpointing="full", checkpoint_blocks={"double": -1, "single": "all"}),
     r"^memory.checkpoint_blocks has double: -1, single: 'all'; give a count >= 0 per block kind"),
    (MemoryConfig(checkpoint_blocks={"double": 8}),
     r"^memory.checkpoint_blocks chooses which blocks to checkpoint, but memory.checkpointing=none; set "
     r"memory.checkpointing=full \(or selective\)$"),
])
def test_checkpoint_blocks_errors_are_one_line(memory, message):
    from videodit.models.mmdit.model import MMDiT, MMDiTGeometry
    from videodit.parallel.activation_checkpoint import apply_activation_checkpointing
    with torch.device("meta"):
        model = MMDiT(MMDiTGeometry(hidden_size=64, num_heads=4, depth=1, depth_single_blocks=1, latent_channels=4,
                                    vec_in_dim=8, context_in_dim=16, axes_dim=(4, 6, 6)))
    with pytest.raises(UserError, match=message):
        apply_activation_checkpointing(model, memory)


@pytest.mark.parametrize("stage_blocks, expected", [
    ([0, 1, 2, 3], [0, 2]),    # the whole model: the first double and the first single block
    ([1, 2, 3], [1]),          # a stage from double block 1: only single block 0 (its second block)
    ([0, 1], [0]),             # a stage of the double stack alone
])
def test_checkpoint_blocks_count_the_whole_models_blocks_in_a_pipeline_stage(stage_blocks, expected):
    """{double: 1, single: 1} means the model's first double and first single block, whichever
    stage holds them: a stage of later blocks checkpoints none of its own double blocks."""
    from videodit.models.families import get_spec
    from videodit.models.mmdit.model import MMDiT, MMDiTGeometry
    from videodit.parallel.activation_checkpoint import chosen_blocks
    with torch.device("meta"):
        model = MMDiT(MMDiTGeometry(hidden_size=64, num_heads=4, depth=2, depth_single_blocks=2, latent_channels=4,
                                    vec_in_dim=8, context_in_dim=16, axes_dim=(4, 6, 6)))
    spec = get_spec("mmdit")
    part = model if stage_blocks == [0, 1, 2, 3] else spec.pipeline_stage(
        model, stage_blocks, first=stage_blocks[0] == 0, last=stage_blocks[-1] == 3)
    memory = MemoryConfig(checkpointing="full", checkpoint_blocks={"double": 1, "single": 1})
    assert chosen_blocks(part, memory) == expected
