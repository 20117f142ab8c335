"""Block swapping (``memory.swap_blocks``, ``videodit/parallel/block_swap.py``): LoRA runs whose
first K blocks keep their frozen weights on the host train bitwise as runs without (losses and
gradients, 5 steps, tiny STDiT, Wan and LTX-2, with and without full checkpointing, compiled, on
an fp8 base, on a two-expert model), and at every block boundary the swapped blocks hold at most
``IN_FLIGHT`` (2) blocks' bytes on the compute device. Layouts it cannot work with are refused in
one line before anything is built."""

import copy
from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides
from test_distributed import run_layouts
from test_lora_parallel import assert_matches, lora_runs, make_base, single_process
from videodit.cli import main
from videodit.config import LoraConfig, MemoryConfig, ParallelConfig, load_config
from videodit.errors import UserError
from videodit.models.lora import add_adapters
from videodit.models.spec import model_parts
from videodit.models.wan.experts import WanExperts
from videodit.models.wan.model import WanDiT, WanGeometry
from videodit.parallel.block_swap import IN_FLIGHT, block_swappers, frozen_tensors
from videodit.parallel.dims import ParallelDims
from videodit.parallel.distributed import DistContext
from videodit.parallel.parallelize import parallelize
from videodit.train.trainer import Trainer

STEPS = 5
# STDiT: 2 pairs = 4 blocks; Wan: 3 blocks. Hidden 32, fp32, batch 2 of 4 x 16 x 16 toy clips.
FAMILIES = {"stdit": {"model.depth": 2},
            "wan": {"model.preset": "wan-tiny", "model.depth": 3, "model.hidden_size": 32},
            # LTX-2.3 tiny: 2 blocks of two streams, 8x8-pixel clips at patch 1, LTX's objective
            "ltx2": {"model.preset": "ltx2-tiny", "model.depth": 2, "model.patch_size": "[1,1,1]", "text.dim": 32,
                     "data.height": 8, "data.width": 8, "diffusion.prediction": "velocity",
                     "diffusion.loss_space": "velocity"}}


def overrides(toy_dir, family: str, **extra) -> list[str]:
    return tiny_overrides(toy_dir, **{"model.num_heads": 2, "train.lr": 1e-3, "train.warmup_steps": 1,
                                      "train.ema_decay": 0, "train.batch_size": 2, **FAMILIES[family], **extra})


@pytest.fixture(scope="module")
def lora(toy_dir, tmp_path_factory):
    """family -> overrides of a LoRA run on a random base of that family (made once)."""
    folder = tmp_path_factory.mktemp("bases")
    made = {family: make_base(overrides(toy_dir, family), folder / family) for family in FAMILIES}
    return lambda family, **extra: overrides(toy_dir, family, **extra) + ["lora.rank=4",
                                                                         f"model.init_from={made[family]}"]


def train(run: list[str], run_dir: Path, steps: int = STEPS, probe=None):
    """``steps`` optimizer steps; (trainer, losses, the gradients each step stepped with)."""
    trainer = Trainer(load_config("tiny", run), run_dir)
    if probe:
        probe(trainer)
    grads = []
    trainer.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: grads.append(
        {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}))
    batches = trainer.batches()
    losses = [trainer.train_step([next(batches)])[0] for _ in range(steps)]
    return trainer, losses, grads


def assert_bitwise(got, want) -> None:
    (_, losses, grads), (_, want_losses, want_grads) = got, want
    assert losses == want_losses
    assert len(grads) == len(want_grads) == STEPS
    for step, (g, w) in enumerate(zip(grads, want_grads)):
        assert g.keys() == w.keys() and g, step
        assert all(torch.equal(g[n], w[n]) for n in g), step


@pytest.mark.parametrize("family, checkpointing, swap, extra", [
    ("stdit", "none", 2, {}),
    ("stdit", "full", 4, {}),                     # every block swapped
    ("wan", "none", 3, {}),
    ("wan", "full", 2, {}),
    ("stdit", "full", 2, {"train.compile": True, "train.compile_backend": "aot_eager"}),
    ("wan", "none", 2, {"lora.base_dtype": "fp8"}),
    ("ltx2", "none", 1, {}),
    ("ltx2", "full", 2, {"lora.base_dtype": "fp8"}),   # every block, on an fp8 base
], ids=["stdit", "stdit-checkpointed-all", "wan-all", "wan-checkpointed", "stdit-compiled", "wan-fp8-base", "ltx2",
        "ltx2-checkpointed-all-fp8-base"])
def test_swapping_trains_bitwise_as_without(lora, tmp_path, family, checkpointing, swap, extra):
    run = lora(family, **{"memory.checkpointing": checkpointing, **extra})
    want = train(run, tmp_path / "resident")
    got = train(run + [f"memory.swap_blocks={swap}"], tmp_path / "swapped")
    assert_bitwise(got, want)
    trainer = got[0]
    (swapper,) = block_swappers(trainer.model)
    blocks = len(trainer.model.blocks)
    # Each swapped block travels for its forward and its backward (the last block of the model
    # stays for its backward), always prefetched: compute never waited on a copy it could hide.
    assert swapper.stats.fetches == STEPS * (2 * swap - (swap == blocks))
    assert swapper.stats.unprefetched == 0
    assert swapper.resident_bytes() == 0 and swapper.stats.peak_resident_bytes <= IN_FLIGHT * swapper.block_bytes
    if extra.get("train.compile"):
        assert trainer.parallel.compile_metrics() == {"recompiles": 0}


def residency_probe(records: list, swap: int):
    """Hooks on every block that record, at each block boundary (forward starts and ends, backward
    starts and ends), the bytes the swapped blocks' frozen tensors hold in storage, and whether the
    block at the boundary has its weights there."""
    def install(trainer):
        blocks = trainer.model.blocks
        swapped = [t for block in blocks[:swap] for _, t in frozen_tensors(block)]
        held = lambda: sum(t.untyped_storage().nbytes() for t in swapped)   # noqa: E731
        here = lambda i: all(t.untyped_storage().nbytes() > 0 for _, t in frozen_tensors(blocks[i]))  # noqa: E731
        for i, block in enumerate(blocks):
            def ended(module, args, out, i=i):
                records.append(("forward ends", i, held(), here(i)))
                if out.requires_grad:
                    out.register_hook(lambda grad: records.append(("backward starts", i, held(), here(i))))
                if args[0].requires_grad:
                    args[0].register_hook(lambda grad: records.append(("backward ends", i, held(), None)))
            block.register_forward_pre_hook(lambda module, args, i=i: records.append(
                ("forward starts", i, held(), here(i))))
            block.register_forward_hook(ended)
    return install


@pytest.mark.parametrize("family, checkpointing, swap", [("stdit", "none", 4), ("stdit", "full", 2),
                                                         ("wan", "full", 3), ("wan", "none", 1)])
def test_at_most_two_swapped_blocks_are_on_the_device_at_every_block_boundary(lora, tmp_path, family,
                                                                            checkpointing, swap):
    records = []
    run = lora(family, **{"memory.checkpointing": checkpointing}) + [f"memory.swap_blocks={swap}"]
    trainer, _, _ = train(run, tmp_path / "run", steps=2, probe=residency_probe(records, swap))
    blocks = trainer.model.blocks
    block_bytes = max(sum(t.numel() * t.element_size() for _, t in frozen_tensors(b)) for b in blocks[:swap])
    assert {kind for kind, *_ in records} == {"forward starts", "forward ends", "backward starts", "backward ends"}
    worst = max(held for _, _, held, _ in records)
    assert worst <= min(swap, IN_FLIGHT) * block_bytes, records
    assert worst >= block_bytes   # the probe does see the weights
    # Every swapped block is there when its forward and its backward start: prefetched, not waited for.
    starts = [(kind, i) for kind, i, _, here in records if kind.endswith("starts") and not here]
    assert not starts, starts
    # After the step nothing swapped is left on the device; the other blocks never left.
    assert sum(t.untyped_storage().nbytes() for b in blocks[:swap] for _, t in frozen_tensors(b)) == 0
    assert all(t.untyped_storage().nbytes() > 0 for b in blocks[swap:] for _, t in frozen_tensors(b))


def test_swapped_weights_hold_no_storage_between_uses_and_state_dict_gives_them(lora, tmp_path):
    trainer, _, _ = train(lora("stdit") + ["memory.swap_blocks=2"], tmp_path / "run", steps=1)
    plain = Trainer(load_config("tiny", lora("stdit")), tmp_path / "plain")
    got, want = trainer.model.state_dict(), plain.model.state_dict()
    assert got.keys() == want.keys()
    base = [name for name in want if "lora_" not in name]
    assert all(torch.equal(got[name], want[name]) for name in base)   # the frozen base, unchanged, readable
    weight = trainer.model.blocks[0].attn.q.base_layer.weight   # same object, shape and dtype; no storage
    assert weight.shape == (32, 32) and weight.dtype == torch.float32 and weight.untyped_storage().nbytes() == 0
    assert weight is dict(trainer.model.named_parameters())["spatial_blocks.0.attn.q.base_layer.weight"]


def test_each_expert_of_a_two_expert_model_swaps_its_own_first_blocks():
    geometry = WanGeometry(dim=32, ffn_dim=64, num_heads=2, num_layers=3, text_dim=16, text_len=8)
    torch.manual_seed(0)
    model = WanExperts(WanDiT(geometry), WanDiT(geometry), boundary=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    add_adapters(model, LoraConfig(rank=4, targets=["self_attn.q", "self_attn.o", "ffn.0"]))
    swapped = copy.deepcopy(model)
    ctx = DistContext(ParallelDims.from_config(ParallelConfig(), 1), 0, 0, torch.device("cpu"))
    loss = lambda out, *args: out.square().mean()   # noqa: E731
    memory = MemoryConfig(checkpointing="full")
    plain = parallelize(model, ctx, ParallelConfig(), memory=memory, loss_fn=loss)
    swapping = parallelize(swapped, ctx, ParallelConfig(), memory=MemoryConfig(checkpointing="full", swap_blocks=2),
                           loss_fn=loss)
    assert [len(s.weights) for s in block_swappers(swapped)] == [2, 2]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, 2, 8, 8, generator=g)
    t = torch.tensor([0.9, 0.2, 0.7, 0.1])          # both experts in one batch
    context = torch.randn(4, 8, 16, generator=g)
    for parallel in (plain, swapping):
        parallel.module(x, t, context).square().mean().backward()
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in swapped.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and {n.split(".")[0] for n in got} == {"high_noise_model", "low_noise_model"}
    assert all(torch.equal(got[n], want[n]) for n in got)
    assert all(s.resident_bytes() == 0 and s.stats.unprefetched == 0 for s in block_swappers(swapped))
    assert all(len(part.blocks) == 3 for _, part in model_parts(swapped))


@pytest.mark.parametrize("sizes, world, swap, frozen, message", [
    ({}, 1, 5, True, "memory.swap_blocks=5 exceeds the model's 4 blocks; valid: 0 (off) to 4"),
    ({}, 1, 2, False, "memory.swap_blocks=2 swaps frozen weights only and this run trains every weight; use LoRA"),
    ({"dp_shard": 2}, 2, 2, True, "with FSDP sharding (world 2: dp_shard=2 (fsdp)) is redundant"),
    ({"sp": 2}, 2, 2, True, "with FSDP sharding (world 2: sp=2 (fsdp)) is redundant"),   # dp_shard=-1 shards over SP
    ({"tp": 2}, 2, 2, True, "memory.swap_blocks=2 with parallel.tp=2 is not supported"),
    ({"pp": 2}, 2, 2, True, "memory.swap_blocks=2 with parallel.pp=2 is not supported"),
])
def test_what_swapping_cannot_work_with_is_refused_in_one_line(sizes, world, swap, frozen, message):
    dims = ParallelDims.from_config(ParallelConfig(**sizes), world)
    with pytest.raises(UserError) as error:
        dims.check_block_swap(swap, blocks=4, frozen_base=frozen)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("sizes", [{"dp_replicate": 2, "dp_shard": 1}, {"sp": 2, "dp_shard": 1}])
def test_replicated_layouts_may_swap(sizes):
    ParallelDims.from_config(ParallelConfig(**sizes), 2).check_block_swap(4, blocks=4, frozen_base=True)


def test_train_refuses_too_many_swapped_blocks_before_anything_is_written(lora, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), *lora("wan"), "memory.swap_blocks=4"]) == 2
    assert capsys.readouterr().err == "error: memory.swap_blocks=4 exceeds the model's 3 blocks; valid: 0 (off) to 3\n"
    assert not run.exists()


def test_replicated_layouts_swap_as_one_process_does(toy_dir, tmp_path):
    """2 gloo processes: DDP (the swapped weights left out of its broadcast) and SP over DDP, each
    with 2 of 4 blocks swapped, train the adapters as one process does (test_lora_parallel's
    tolerance) and leave the base as it was."""
    runs = lora_runs(toy_dir, tmp_path, **{"model.depth": 2}) + ["memory.swap_blocks=2"]
    got = run_layouts(toy_dir, tmp_path, 2, {
        "ddp": runs + ["parallel.dp_replicate=2", "parallel.dp_shard=1", "memory.checkpointing=full"],
        "sp": runs + ["parallel.sp=2", "parallel.dp_shard=1"],
    })
    assert_matches(got["ddp"], single_process(runs + ["train.grad_accum=2"], tmp_path / "ref2"))
    assert_matches(got["sp"], single_process(runs, tmp_path / "ref1"))
