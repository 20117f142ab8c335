"""``memory.offload`` on checkpointed blocks (``videodit/parallel/checkpoint_offload.py``): the token
input each checkpointed block keeps for its recompute goes to host memory and comes back, one block
ahead, for the recompute. On CPU the lever is a no-op (the inputs already are in host memory); these
tests run its CPU stand-in (``stand_in=True``: the host copy is a tensor LiveMemory does not count,
as a GPU's allocator would not), which takes the same pack, prefetch and unpack path."""

from pathlib import Path

import pytest
import torch

from conftest import tiny_overrides
from test_lora_parallel import make_base
from videodit.config import load_config
from videodit.models.spec import model_parts
from videodit.parallel.block_swap import block_swappers
from videodit.parallel.checkpoint_offload import apply_checkpoint_input_offload, input_offload_stats
from videodit.planner.measure import measure_trainer
from videodit.train.trainer import Trainer

STEPS = 3
# Token inputs above the lever's 64 KiB floor: 2 clips x 4 frames x 64 positions x width 64, fp32 = 128 KiB.
FAMILIES = {"stdit": {"model.depth": 2},
            "wan": {"model.preset": "wan-tiny", "model.depth": 3}}


def overrides(toy_dir, family: str, **extra) -> list[str]:
    return tiny_overrides(toy_dir, **{"model.num_heads": 2, "model.hidden_size": 64, "model.patch_size": "[1,2,2]",
                                      "train.lr": 1e-3, "train.warmup_steps": 1, "train.ema_decay": 0,
                                      "train.batch_size": 2, **FAMILIES[family], **extra})


def build(run: list[str], run_dir: Path, offload: bool) -> Trainer:
    trainer = Trainer(load_config("tiny", run), run_dir)
    if offload:
        for _, part in model_parts(trainer.model):
            apply_checkpoint_input_offload(part, trainer.cfg.memory.checkpointed_blocks(len(part.blocks)),
                                           stand_in=True)
    return trainer


def train(trainer: Trainer, steps: int = STEPS):
    grads = []
    trainer.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: grads.append(
        {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}))
    batches = trainer.batches()
    return [trainer.train_step([next(batches)])[0] for _ in range(steps)], grads


def assert_bitwise(got, want) -> None:
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1]) == STEPS
    for g, w in zip(got[1], want[1]):
        assert g.keys() == w.keys() and g and all(torch.equal(g[n], w[n]) for n in g)


@pytest.mark.parametrize("family, levers", [
    ("stdit", {"memory.checkpointing": "full"}),
    ("wan", {"memory.checkpointing": "full"}),
    ("stdit", {"memory.checkpointing": "selective", "memory.checkpoint_every": 2}),
])
def test_offloaded_checkpoint_inputs_train_bitwise_as_kept_ones(toy_dir, tmp_path, family, levers):
    run = overrides(toy_dir, family, **levers)
    want = train(build(run, tmp_path / "kept", offload=False))
    trainer = build(run, tmp_path / "offloaded", offload=True)
    assert_bitwise(train(trainer), want)
    checkpointed = trainer.cfg.memory.checkpointed_blocks(len(trainer.model.blocks))
    stats = input_offload_stats(trainer.model)
    assert stats.offloaded == STEPS * len(checkpointed)
    # Each block's input comes back while the block after it runs backward; only the last one's is waited for.
    assert stats.unprefetched == STEPS and stats.prefetched == STEPS * (len(checkpointed) - 1)


@pytest.mark.parametrize("family", ["stdit", "wan"])
def test_offload_frees_exactly_the_checkpointed_inputs(toy_dir, tmp_path, family):
    """LiveMemory over one step: what forward leaves alive for backward drops by the bytes sent to
    the host, the checkpointed blocks' token inputs."""
    run = overrides(toy_dir, family, **{"memory.checkpointing": "full"})
    kept, offloaded = (build(run, tmp_path / name, offload=name == "offloaded") for name in ("kept", "offloaded"))
    batch = next(kept.batches())
    before = measure_trainer(kept, batch)
    after = measure_trainer(offloaded, batch)
    stats = input_offload_stats(offloaded.model)
    blocks = len(offloaded.model.blocks)
    token_input = 2 * 4 * 64 * 64 * 4   # batch x frames x positions x width, fp32
    assert stats.bytes_offloaded == blocks * token_input
    assert before.activations - after.activations == stats.bytes_offloaded
    assert after.params == before.params and after.grads == before.grads


def test_on_cpu_the_trainer_lever_wraps_the_checkpointed_blocks_and_moves_nothing(toy_dir, tmp_path):
    trainer = Trainer(load_config("tiny", overrides(toy_dir, "stdit", **{"memory.checkpointing": "full",
                                                                         "memory.offload": True})), tmp_path / "run")
    assert all(hasattr(block, "input_offloader") for block in trainer.model.blocks)
    train(trainer, steps=1)
    assert input_offload_stats(trainer.model).offloaded == 0


def test_offload_composes_with_block_swapping(toy_dir, tmp_path):
    run = overrides(toy_dir, "wan", **{"memory.checkpointing": "full"})
    run += ["lora.rank=4", f"model.init_from={make_base(run, tmp_path / 'base')}"]
    want = train(build(run, tmp_path / "plain", offload=False))
    trainer = build(run + ["memory.swap_blocks=2"], tmp_path / "both", offload=True)
    assert_bitwise(train(trainer), want)
    assert input_offload_stats(trainer.model).offloaded == STEPS * 3
    assert block_swappers(trainer.model)[0].stats.unprefetched == 0


def test_a_host_copy_keeps_the_layout_the_recompute_must_see():
    """A checkpointed block's saved input may be a permuted view of its token input: its host copy
    keeps those strides (ops choose kernels, and the order they save tensors in, by layout; a
    contiguous copy made CUDA's recompute fail its metadata check). Memory that is not dense is
    copied contiguous."""
    from videodit.parallel.checkpoint_offload import host_like

    x = torch.randn(2, 3, 5, 4)
    permuted = x.permute(0, 2, 1, 3)
    copy = host_like(permuted, pin=False).copy_(permuted)
    assert copy.stride() == permuted.stride() and torch.equal(copy, permuted)
    sliced = x[:, :, ::2]
    assert host_like(sliced, pin=False).is_contiguous()
