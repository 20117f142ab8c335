"""The LTX-2 family under torchrun (gloo, 2 CPU processes, fp32) against one process, on the same
batch, in one launch: a tiny LTX-2.3 (4 heads: TP and Ulysses leave 2 per rank; 27 video tokens:
sp=2 pads a slice) through ``parallelize`` and one forward and backward, under FSDP2 (with the
audio stream too), TP=2 (with the audio stream too, and LTX-2.0's caption projections at the
root), Ulysses SP=2 and ring SP=2 (each with the audio stream: whole on every rank, video -> audio
attention as a ring over the video keys), PP=2 (1F1B; GPipe on LTX-2.0; each with the audio stream
too: carried through the stages, its target cut per micro-batch), selective checkpointing under
SP, and LoRA under FSDP2 + SP. The trainer's path (``model_inputs``: a time per token, the first
sample's first frame given; ``forward_backward``); with audio both outputs' loss.

Tolerance: the loss and every gradient within 1e-5 of its largest magnitude (``tests/tolerance.py``'s
measure). Measured (x86, torch 2.14): FSDP2 and PP exact, with audio too (PP's reference runs the
same micro-batches), TP <= 3.7e-6, Ulysses <= 1.6e-6, ring <= 2.5e-6, LoRA 2.3e-6: fp32 reduction
order (TP's all-reduces, the ring's log-sum-exp merges), a factor 3 below the bound.

Also, without torchrun: LTX-2's one-line SP error, the TP plan, and one dynamic graph under
``train.compile`` serving three video grids (aot_eager: Dynamo and AOTAutograd as inductor).
"""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import torchrun
from tolerance import assert_close
from videodit.errors import UserError

WORKER = Path(__file__).parent / "workers" / "ltx2_worker.py"
TOLERANCE = 1e-5
LAYOUTS = [
    {"name": "fsdp", "parallel": {"dp_shard": 2}},
    {"name": "fsdp_audio", "parallel": {"dp_shard": 2}, "audio": True},
    {"name": "tp", "parallel": {"tp": 2}},
    {"name": "tp_audio", "parallel": {"tp": 2}, "audio": True},
    {"name": "tp_ltx2.0_audio", "parallel": {"tp": 2}, "version": "2.0", "audio": True},
    {"name": "ulysses", "parallel": {"sp": 2}},
    {"name": "ulysses_audio", "parallel": {"sp": 2}, "audio": True},
    {"name": "ring", "parallel": {"sp": 2, "sp_ring": 2}},
    {"name": "ring_audio", "parallel": {"sp": 2, "sp_ring": 2}, "audio": True},
    {"name": "pp", "parallel": {"pp": 2}},
    {"name": "pp_gpipe_ltx2.0", "parallel": {"pp": 2, "pp_schedule": "gpipe"}, "version": "2.0"},
    {"name": "pp_audio", "parallel": {"pp": 2}, "audio": True},
    {"name": "pp_gpipe_ltx2.0_audio", "parallel": {"pp": 2, "pp_schedule": "gpipe"}, "version": "2.0", "audio": True},
    {"name": "selective_ulysses_audio", "parallel": {"sp": 2}, "audio": True,
     "memory": {"checkpointing": "selective"}},
    {"name": "lora_fsdp_sp", "parallel": {"sp": 2}, "lora": True, "audio": True},
]
# video-only: the video stream's 77 parameters of LTX-2.3 (65 of LTX-2.0); with audio every one of
# the tiny model's; LoRA: 5 adapted layers x 2 blocks x 2 adapters
GRADIENTS = {"fsdp": 77, "fsdp_audio": 230, "tp": 77, "tp_audio": 230, "tp_ltx2.0_audio": 198, "ulysses": 77,
             "ulysses_audio": 230, "ring": 77, "ring_audio": 230, "pp": 77, "pp_gpipe_ltx2.0": 65, "pp_audio": 230,
             "pp_gpipe_ltx2.0_audio": 198, "selective_ulysses_audio": 230, "lora_fsdp_sp": 20}


def test_layouts_match_one_process(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out": str(tmp_path / "results.json"), "layouts": LAYOUTS}))
    result = torchrun(2, str(WORKER), str(spec))
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for layout in LAYOUTS:
        got = results[layout["name"]]
        assert got["out"] <= TOLERANCE and got["grad"] <= TOLERANCE, (layout["name"], got)
        assert got["gradients"] == GRADIENTS[layout["name"]], (layout["name"], got)


def test_sequence_parallel_sizes_are_one_line_user_errors():
    from videodit.models.ltx2.parallel_plan import check_sequence_parallel
    check_sequence_parallel(32, tp=1, sp=3, ring=3)   # ring: any sp
    check_sequence_parallel(32, tp=2, sp=4, ring=1)   # 16 heads per TP rank over 4 Ulysses ranks
    with pytest.raises(UserError, match=r"^LTX-2 shards its video tokens over parallel.sp \(text and audio whole on "
                                        r"every rank\): parallel.sp=3 with parallel.sp_ring=1 leaves 3 Ulysses ranks, "
                                        r"which do not divide the 32 attention heads per tensor-parallel rank; valid "
                                        r"parallel.sp_ring: 3 \(sp_ring=3: ring attention only, any sp\)$"):
        check_sequence_parallel(32, tp=1, sp=3, ring=1)


def test_tensor_parallel_plan_covers_every_attention_and_ffn():
    from videodit.models.families import get_spec
    from videodit.models.ltx2.spec import TINY
    from videodit.models.ltx2.model import LTX2Model
    with torch.device("meta"):
        model = LTX2Model(TINY)
    plan = get_spec("ltx2").tensor_parallel_plan()
    block = model.blocks[0]
    styles = plan.block(block)
    linears = {name for name, module in block.named_modules() if isinstance(module, nn.Linear)}
    assert linears == {name for name, style in styles.items() if isinstance(style, str)}   # every block linear
    assert styles["video_to_audio_attn.to_gate_logits"] == "colwise"
    assert styles["audio_to_video_attn"] == ("head_tables", ("rope", "k_rope"))
    assert plan.sharded_norms == ("q_norm", "k_norm") and plan.partial == ()


def test_compiled_blocks_serve_every_grid_with_one_dynamic_graph():
    import sys
    sys.path.insert(0, str(WORKER.parent))
    from ltx2_worker import batch, mse, tiny_model
    from videodit.parallel.compile import CompileOptions, apply_compile
    eager, compiled = tiny_model("2.3", False), tiny_model("2.3", False)
    stats = apply_compile(compiled, CompileOptions("aot_eager", "dynamic"), shapes=3)
    for grid in [(3, 3, 3), (2, 4, 3), (3, 5, 2)]:
        inputs, target, _, _ = batch(eager, grid=grid)
        want, got = (mse(model(*inputs), None, None, target) for model in (eager, compiled))
        assert_close(got.detach(), want.detach(), 1e-5, f"compiled loss at {grid}")
    assert (stats.compiles, stats.recompiles) == (1, 0), stats.by_kind()
