"""The activation-memory levers: which blocks are checkpointed, and offload/compression of
what the other blocks save for backward (``videodit.parallel.saved_tensors``)."""

import copy
import math

import pytest
import torch

from conftest import tiny_overrides
from videodit.config import MemoryConfig, load_config
from videodit.parallel import saved_tensors as saved
from videodit.parallel.saved_tensors import saved_tensor_stats, wrap_saved_tensors
from videodit.models.stdit.model import STBlock
from videodit.models.layers import RotaryEmbedding
from videodit.train.trainer import Trainer

DIM, HEADS = 64, 2


def block_inputs(temporal: bool, device="cpu", batch=2, frames=4, spatial=64, length=8):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, frames, spatial, DIM, generator=g)
    y = torch.randn(batch, length, DIM, generator=g)
    y_mask = torch.ones(batch, length, dtype=torch.bool)
    y_mask[0, length // 2:] = False
    t_mod = torch.randn(batch, 6, DIM, generator=g) * 0.1
    rope = RotaryEmbedding(DIM // HEADS)(torch.arange(frames)) if temporal else None
    rope = tuple(r.to(device) for r in rope) if rope else None
    return x.to(device), y.to(device), y_mask.to(device), t_mod.to(device), rope


def gradients(block, inputs):
    """Gradients of a fixed random projection of the output w.r.t. x and every parameter."""
    x, y, y_mask, t_mod, rope = inputs
    x = x.detach().requires_grad_()
    block.zero_grad(set_to_none=True)
    out = block(x, y, y_mask, t_mod, rope)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.device)
    (out * weights).sum().backward()
    return {"x": x.grad, **{n: p.grad for n, p in block.named_parameters()}}


def plain_and_wrapped(temporal, device="cpu", **levers):
    torch.manual_seed(0)
    plain = STBlock(DIM, HEADS, 4.0, True, temporal).to(device)
    wrapped = copy.deepcopy(plain)
    wrap_saved_tensors(wrapped, **levers)
    inputs = block_inputs(temporal, device)
    return gradients(plain, inputs), gradients(wrapped, inputs), wrapped.saved_tensor_stats


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("temporal", [False, True])
def test_hooks_without_compression_give_identical_gradients(temporal):
    # offload on a CPU tensor is a no-op, so this runs every tensor through the hooks unchanged.
    plain, wrapped, stats = plain_and_wrapped(temporal, offload=True, compression="none")
    assert plain.keys() == wrapped.keys()
    assert all(torch.equal(plain[n], wrapped[n]) for n in plain)
    assert stats.packed == 0


@pytest.mark.parametrize("temporal", [False, True])
@pytest.mark.parametrize("compression, ratio, tolerance", [("bf16", 0.5, 2e-2), ("fp8", 0.25, 0.3)])
def test_compression_is_close_and_stores_fewer_bytes(temporal, compression, ratio, tolerance):
    plain, wrapped, stats = plain_and_wrapped(temporal, offload=False, compression=compression)
    # (Skipping gradients that are zero in exact arithmetic: the cross-attention key bias.)
    errors = {n: relative_error(wrapped[n], plain[n]) for n in plain if plain[n].norm() > 1e-3}
    assert max(errors.values()) < tolerance, errors
    assert errors["x"] > 0          # lossy: backward saw rounded activations
    assert stats.packed > 0 and stats.bytes_stored == stats.bytes_in * ratio


def test_fp8_is_coarser_than_bf16():
    plain, bf16, _ = plain_and_wrapped(False, offload=False, compression="bf16")
    _, fp8, _ = plain_and_wrapped(False, offload=False, compression="fp8")
    assert relative_error(fp8["x"], plain["x"]) > relative_error(bf16["x"], plain["x"])


def test_a_tensor_saved_by_several_ops_is_stored_once():
    # q, k and v all save the normed input: one packed copy must serve all three.
    torch.manual_seed(0)
    block = STBlock(DIM, HEADS, 4.0, True, temporal=False)
    large_saves = []
    keep = lambda t: (large_saves.append(t) if t.numel() * t.element_size() >= saved.MIN_BYTES else None, t)[1]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        block(*block_inputs(False))
    wrap_saved_tensors(block, offload=False, compression="bf16")
    calls = []
    original = saved._compress
    saved._compress = lambda t, c: (calls.append(t), original(t, c))[1]
    try:
        block(*block_inputs(False)).sum().backward()
    finally:
        saved._compress = original
    keys = {(t.untyped_storage().data_ptr(), t.storage_offset(), t.shape) for t in calls}
    assert len(keys) == len(calls) == block.saved_tensor_stats.packed < len(large_saves)


def test_parameters_and_their_casts_are_never_packed():
    # The MLP weights are 256 KiB in fp32, 128 KiB as autocast's bf16 copies: large enough to
    # be packed if they were not excluded.
    dim = 128
    torch.manual_seed(0)
    block = STBlock(dim, HEADS, 4.0, True, temporal=False)
    wrap_saved_tensors(block, offload=False, compression="fp8")
    param_storages = {p.untyped_storage().data_ptr() for p in block.parameters()}
    calls = []
    original = saved._compress
    saved._compress = lambda t, c: (calls.append(t), original(t, c))[1]
    x = torch.randn(2, 4, 64, dim)
    y, t_mod = torch.randn(2, 8, dim), torch.randn(2, 6, dim)
    try:
        block(x, y, torch.ones(2, 8, dtype=torch.bool), t_mod, None).sum().backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = block(x, y, torch.ones(2, 8, dtype=torch.bool), t_mod, None)
        out.float().sum().backward()
    finally:
        saved._compress = original
    assert calls
    assert not any(t.untyped_storage().data_ptr() in param_storages for t in calls)
    assert not any(saved._is_parameter_cast(t) for t in calls)
    assert all(t.numel() * t.element_size() >= saved.MIN_BYTES for t in calls)
    # Every parameter still gets a gradient.
    assert all(p.grad is not None for p in block.parameters())


def test_parameter_cast_detection():
    layer = torch.nn.Linear(4, 4)
    activation = torch.randn(3, 4, requires_grad=True) * 2
    assert saved._is_parameter_cast(layer.weight.to(torch.bfloat16))
    assert saved._is_parameter_cast(layer.weight.to(torch.bfloat16).t())   # what a linear layer saves
    assert not saved._is_parameter_cast(activation.to(torch.bfloat16))
    assert not saved._is_parameter_cast(layer.weight)


def test_fp8_handles_an_all_zero_tensor():
    data, scale = saved._compress(torch.zeros(1000), "fp8")
    assert data.dtype == torch.float8_e4m3fn and scale.item() == 1.0
    assert torch.equal(data.float() * scale, torch.zeros(1000))


def test_unknown_compression_is_rejected():
    with pytest.raises(ValueError, match="compression"):
        wrap_saved_tensors(torch.nn.Linear(2, 2), offload=False, compression="int4")


@pytest.mark.parametrize("num_blocks, every, fraction, expected", [
    (8, 1, 1.0, [0, 1, 2, 3, 4, 5, 6, 7]),
    (8, 2, 1.0, [0, 2, 4, 6]),
    (8, 2, 0.5, [0, 2]),
    (8, 3, 0.5, [0, 3]),              # ceil(3 * 0.5) = 2 of [0, 3, 6]
    (6, 1, 1 / 3, [0, 1]),            # exactly 2: no rounding up past a whole block
    (8, 1, 0.0, []),
    (5, 2, 1.0, [0, 2, 4]),
    (4, 8, 1.0, [0]),
])
def test_checkpointed_blocks(num_blocks, every, fraction, expected):
    memory = MemoryConfig(checkpointing="full", checkpoint_every=every, checkpoint_fraction=fraction)
    assert memory.checkpointed_blocks(num_blocks) == expected
    assert len(expected) == math.ceil(len(range(0, num_blocks, every)) * fraction - 1e-9)


# Activations above MIN_BYTES: 4 clips x 4 frames x 64 tokens x width 64 = 256 KiB per block input.
LARGE = {"model.depth": 2, "model.hidden_size": 64, "model.patch_size": "[1,2,2]", "train.seed": 3}


@pytest.mark.parametrize("levers, checkpointed", [
    ({"memory.compression": "bf16"}, []),
    ({"memory.checkpointing": "full", "memory.checkpoint_every": 2}, [0, 2]),
    ({"memory.checkpointing": "full", "memory.checkpoint_every": 2, "memory.compression": "fp8"}, [0, 2]),
])
def test_trainer_steps_with_memory_levers(toy_dir, tmp_path, levers, checkpointed):
    cfg = load_config("tiny", tiny_overrides(toy_dir, **LARGE, **levers))
    trainer = Trainer(cfg, tmp_path / "run")
    blocks = trainer.model.blocks
    wrapped = [i for i, b in enumerate(blocks) if hasattr(b, "saved_tensor_stats")]
    compressing = cfg.memory.compression != "none"
    assert wrapped == ([i for i in range(len(blocks)) if i not in checkpointed] if compressing else [])
    loss, grad_norm = trainer.train_step([next(trainer.batches())])
    assert math.isfinite(loss) and math.isfinite(grad_norm)
    stats = saved_tensor_stats(trainer.model)
    assert (stats.packed > 0) == compressing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload moves CUDA tensors to pinned host memory")
@pytest.mark.parametrize("temporal", [False, True])
def test_offload_gives_identical_gradients_on_cuda(temporal):
    plain, wrapped, stats = plain_and_wrapped(temporal, device="cuda", offload=True, compression="none")
    assert all(torch.equal(plain[n], wrapped[n]) for n in plain)
    assert stats.packed > 0 and stats.bytes_offloaded == stats.bytes_in == stats.bytes_stored
    # Compression then offload equals compression alone: the round trip over PCIe is exact.
    _, compressed, _ = plain_and_wrapped(temporal, device="cuda", offload=False, compression="fp8")
    _, both, both_stats = plain_and_wrapped(temporal, device="cuda", offload=True, compression="fp8")
    assert all(torch.equal(compressed[n], both[n]) for n in plain)
    assert both_stats.bytes_offloaded == both_stats.bytes_in // 4
