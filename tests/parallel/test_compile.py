"""train.compile: regional torch.compile of every block (``videodit/parallel/compile.py``).

Compiled training must follow eager training (the loss curve within rel 1e-3 over 8 steps) on
bucketed data, whose batch shapes change between steps, without recompiling per batch: at most
one graph per bucket shape, counted and logged as ``recompiles``. Inductor runs once (single
process, two video bucket shapes: compiling C++ kernels is what costs time on CPU); the other
tests use the ``aot_eager`` backend, which traces exactly as inductor does (Dynamo graphs,
guards and recompiles, AOTAutograd's forward/backward split, collectives in the graph) but runs
the traced graph without generating code. One torchrun launch checks FSDP and SP.
"""

import json
import os

import pytest
import torch

from conftest import tiny_overrides
from test_distributed import run_layouts, single_process
from videodit.config import MemoryConfig, ParallelConfig, load_config
from videodit.errors import UserError
from videodit.models.stdit.model import DiTGeometry, STDiT
from videodit.parallel.compile import CompileOptions
from videodit.parallel.dims import ParallelDims
from videodit.parallel.distributed import DistContext
from videodit.parallel.parallelize import parallelize
from videodit.train.trainer import Trainer

VIDEO_BUCKETS = "{'24px': {4: [1.0, 2]}, '16px': {4: [1.0, 2]}}"
ONE_BUCKET = "{'16px': {4: [1.0, 2]}}"
MIXED_BUCKETS = "{'24px': {1: [1.0, 2], 4: [1.0, 2]}, '16px': {1: [1.0, 2], 4: [1.0, 2]}}"
# The torchrun test's backend: aot_eager traces as inductor does (Dynamo graphs, AOTAutograd,
# collectives in the graph) without generating code, which costs minutes per process on CPU.
TORCHRUN_BACKEND = os.environ.get("VIDEODIT_TEST_COMPILE_BACKEND", "aot_eager")
TORCHRUN_STEPS = 8


def overrides(toy_dir, buckets: str, **extra) -> list[str]:
    # Seed 1 deals the four mixed bucket shapes in the first five batches.
    values = {"model.num_heads": 4, "train.lr": 1e-3, "train.warmup_steps": 1, "train.batch_size": 2,
              "train.seed": 1, "data.bucket_config": buckets, **extra}
    return tiny_overrides(toy_dir, **values)


def train(overrides: list[str], run_dir, steps: int) -> tuple[Trainer, list[float], list[tuple]]:
    """``steps`` optimizer steps; returns the trainer, the losses and each batch's video shape."""
    trainer = Trainer(load_config("tiny", overrides), run_dir)
    batches = trainer.batches()
    losses, shapes = [], []
    for _ in range(steps):
        batch = next(batches)
        shapes.append(tuple(batch.video.shape[2:]))
        losses.append(trainer.train_step([batch])[0])
    return trainer, losses, shapes


def max_weight_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()   # compiling changes no parameter name
    return max((sa[k] - sb[k]).abs().max().item() for k in sa)


def test_inductor_follows_eager_on_two_bucket_shapes_with_one_graph_per_block_kind(mixed_toy, tmp_path):
    """8 steps with inductor over two video resolutions: the loss curve of eager training
    (rel <= 1e-3), the same weights, and no recompile when the resolution changes (the batch,
    frame and position dimensions are dynamic). The run's metrics log ``recompiles``."""
    run = overrides(mixed_toy, VIDEO_BUCKETS, **{"train.max_steps": 8, "train.ema_decay": 0.9})
    eager = Trainer(load_config("tiny", run), tmp_path / "eager")
    eager.fit()
    compiled = Trainer(load_config("tiny", run + ["train.compile=true"]), tmp_path / "compiled")
    shapes = set()
    prepare = compiled.prepare
    compiled.prepare = lambda batch, *args: (shapes.add(tuple(batch.video.shape[2:])), prepare(batch, *args))[1]
    compiled.fit()

    assert shapes == {(4, 16, 16), (4, 24, 24)}
    read = lambda run_dir: [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                            if '"loss"' in line]
    want, got = read(tmp_path / "eager"), read(tmp_path / "compiled")
    assert len(got) == len(want) == 8
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-3)
    assert all(r["recompiles"] == 0 for r in got) and "recompiles" not in want[0]
    stats = compiled.parallel.compile_stats
    assert sorted(kind for kind, _ in stats.graphs) == ["spatial", "temporal"]
    assert max_weight_difference(compiled.model, eager.model) < 1e-4


# Dynamo alone decides graphs and recompiles; the static case skips AOTAutograd (backend eager) for time.
@pytest.mark.parametrize("dynamic, checkpointing, backend", [("auto", "selective", "aot_eager"),
                                                              ("static", "full", "eager")])
def test_recompiles_are_bounded_by_the_bucket_shapes(mixed_toy, tmp_path, dynamic, checkpointing, backend):
    """Videos and images at two resolutions (four bucket shapes) with activation checkpointing:
    a shape is never compiled twice. ``auto`` (dynamic dimensions) needs one graph for the
    videos and one for the images (frames = 1 is specialised) per block kind; ``static`` one
    per bucket shape, no more."""
    run = overrides(mixed_toy, MIXED_BUCKETS, **{"memory.checkpointing": checkpointing, "train.ema_decay": 0})
    eager, want, shapes = train(run, tmp_path / "eager", 6)
    compiled, got, compiled_shapes = train(run + ["train.compile=true", f"train.compile_backend={backend}",
                                                  f"train.compile_dynamic={dynamic}"], tmp_path / "c", 6)
    assert compiled_shapes == shapes and len(set(shapes)) == 4, shapes
    assert got == pytest.approx(want, rel=1e-5)
    assert max_weight_difference(compiled.model, eager.model) < 1e-5   # AOTAutograd decomposes some ops

    stats = compiled.parallel.compile_stats
    per_kind = stats.by_kind()
    assert per_kind.keys() == {"spatial", "temporal"}
    for kind, graph_shapes in per_kind.items():
        assert len(graph_shapes) == len(set(graph_shapes)), graph_shapes     # never the same shape twice
        frames = {shape[1] for shape in graph_shapes}
        if dynamic == "auto":
            assert len(graph_shapes) == 2 and frames == {1, 4}, graph_shapes   # videos, images
        else:
            assert len(graph_shapes) == len(set(shapes)), graph_shapes       # one per bucket shape
    assert stats.recompiles == stats.compiles - 2
    assert compiled.parallel.compile_metrics() == {"recompiles": stats.recompiles}


def test_compile_under_torchrun_follows_one_eager_process(mixed_toy, tmp_path):
    """One torchrun launch (2 gloo processes, one thread each) trains 8 steps of FSDP
    (dp_shard=2) and then of SP (sp=2, videos and images at two resolutions: frames split for
    videos, head-parallel attention with its all-to-alls inside the compiled block for images)
    with compiled blocks; both end where one eager process ends on the same global
    batches (the loss curve within rel 1e-3) and compile at most one graph per bucket shape.
    ``VIDEODIT_TEST_COMPILE_BACKEND=inductor`` runs the same test with generated kernels
    (minutes on 2 cores with an empty inductor cache)."""
    # FSDP's hooks run between the blocks whatever the shapes: one bucket (static graphs, traced
    # in a third of the time of dynamic ones) is enough; dynamic shapes are SP's business here.
    videos = overrides(mixed_toy, ONE_BUCKET, **{"train.ema_decay": 0})
    mixed = overrides(mixed_toy, MIXED_BUCKETS, **{"train.ema_decay": 0})
    compiled = ["train.compile=true", f"train.compile_backend={TORCHRUN_BACKEND}"]
    got = run_layouts(mixed_toy, tmp_path, 2, {"fsdp": videos + compiled + ["parallel.dp_shard=2"],
                                               "sp": mixed + compiled + ["parallel.sp=2"]}, steps=TORCHRUN_STEPS)
    references = {"fsdp": single_process(videos + ["train.grad_accum=2"], tmp_path / "ref2", TORCHRUN_STEPS),
                  "sp": single_process(mixed, tmp_path / "ref1", TORCHRUN_STEPS)}
    for name, (weights, losses) in references.items():
        assert got[name]["losses"] == pytest.approx(losses, rel=1e-3), name
        worst = max((got[name]["weights"][k] - weights[k]).abs().max().item() for k in weights)
        assert worst < 1e-5, (name, worst)
    frames = {shape.split(", ")[2] for step in got["sp"]["keys"][0] for shape in step[1:]}
    assert frames == {"1", "4"}, frames   # image batches took the head-parallel path
    # Graphs per block kind (frames, positions of their first input on rank 0): FSDP's blocks see
    # whole batches of one shape. SP's spatial blocks see half the
    # frames of a video; images keep a position split and attend head-parallel, whose unpadded
    # length is a constant of the graph: one spatial graph per image resolution.
    graphs = {name: sorted((kind, shape[1:3]) for kind, shape in got[name]["graphs"]) for name in got}
    assert graphs["fsdp"] == [("spatial", (4, 16)), ("temporal", (4, 16))], graphs
    assert [kind for kind, _ in graphs["sp"]] == ["spatial"] * 3 + ["temporal"] * 2, graphs
    assert {frames for kind, (frames, _) in graphs["sp"] if kind == "spatial"} == {1, 2}, graphs
    assert sorted(positions for kind, (frames, positions) in graphs["sp"] if (kind, frames) == ("spatial", 1)) \
        == [8, 18], graphs   # 16x16 and 24x24 images: 16 and 36 positions, half on each rank


def test_tensor_parallelism_with_compile_is_refused_before_anything_is_applied():
    """Torch 2.13 compiles DTensor blocks wrongly (static shapes: the caption's gradient misses
    its TP all-reduce) or not at all (dynamic shapes): parallelize refuses, first thing."""
    tp = ParallelDims(dp_replicate=1, dp_shard=1, sp=1, tp=2, pp=1, world_size=2)
    with pytest.raises(UserError) as info:
        tp.check_compile()
    assert str(info.value).startswith("train.compile=true with parallel.tp=2 is not supported") \
        and "\n" not in str(info.value)
    ParallelDims(dp_replicate=1, dp_shard=2, sp=2, tp=1, pp=2, world_size=8).check_compile()   # the rest compiles
    ParallelDims(dp_replicate=2, dp_shard=2, sp=1, tp=1, pp=1, world_size=4).check_compile()

    model = STDiT(DiTGeometry(in_channels=3, caption_channels=8, caption_length=4, depth=1, hidden_size=32,
                              num_heads=4))
    forward = model.blocks[0].forward
    ctx = DistContext(tp, rank=0, local_rank=0, device=torch.device("cpu"))   # no process group needed
    with pytest.raises(UserError, match="parallel.tp=2"):
        parallelize(model, ctx, ParallelConfig(tp=2), memory=MemoryConfig(), loss_fn=None,
                    compile=CompileOptions("aot_eager"))
    assert model.blocks[0].forward == forward   # nothing was applied


def test_bad_compile_options_fail_at_load():
    with pytest.raises(UserError, match="train.compile_dynamic"):
        load_config("tiny", ["train.compile_dynamic=sometimes"])
    with pytest.raises(UserError, match="train.compile_backend"):
        load_config("tiny", ["train.compile_backend=tensorrt"])


def test_wan_blocks_compile_one_graph_for_every_bucket(mixed_toy, tmp_path):
    """Wan's blocks compile too (the family names their dynamic dimensions): its blocks see a
    token sequence [B, L, D], so under ``auto`` one graph serves all four bucket shapes, images
    included (STDiT's frame axis specialises at one frame), and training follows eager."""
    run = overrides(mixed_toy, MIXED_BUCKETS, **{"model.preset": "wan-tiny", "model.depth": 2,
                                                 "train.ema_decay": 0, "memory.checkpointing": "selective"})
    eager, want, shapes = train(run, tmp_path / "eager", 6)
    compiled, got, compiled_shapes = train(run + ["train.compile=true", "train.compile_backend=aot_eager"],
                                           tmp_path / "c", 6)
    assert compiled_shapes == shapes and len(set(shapes)) == 4, shapes
    assert got == pytest.approx(want, rel=1e-5)
    assert max_weight_difference(compiled.model, eager.model) < 1e-5
    graphs = compiled.parallel.compile_stats.by_kind()
    assert graphs.keys() == {"block"} and len(graphs["block"]) == 1, graphs
