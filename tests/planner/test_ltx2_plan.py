"""The planner's activation profile of LTX-2's video stream (``models/ltx2/activations.py``)
against ``LiveMemory`` over one step of the model (noise, x_t, target, forward, the loss, read once
autocast has exited as it has when training's backward runs), fp32 and bf16 autocast on CPU,
LTX-2.0 and 2.3 at test size (4 heads x 32, 2 blocks, 256 video tokens and 32 caption tokens per
sample, time per token as training's model inputs give it).

Without checkpointing the planner is within 5% (measured: 1.00 fp32, 1.006-1.018 bf16; the block
table's autocast units were fitted with the bf16 weight copies the blocks save, at this size).
Under checkpointing (selective, full) a block keeps none of those copies, and the comparison leaves
out the ones the layers outside the blocks save (``estimate`` counts autocast's weight copies as
temporaries): the checkpointed blocks hold their inputs, the per-token modulation [B, T, rows D]
and time embedding among them (``ActivationProfile.checkpoint_inputs``, once), and under bf16 the
residual stream they keep is bf16 (``residual_low``). Measured 1.000-1.010."""

import dataclasses
import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from videodit.config import MemoryConfig
from videodit.models.families import spec_of
from videodit.models.ltx2.geometry import LTX2_0, LTX2_3
from videodit.models.ltx2.model import LTX2Model
from videodit.models.spec import Conditions
from videodit.planner.estimate import Parallel, Precision, Shape, activation_bytes
from videodit.parallel.activation_checkpoint import apply_activation_checkpointing
from videodit.planner.estimate import block_activation_bytes
from videodit.planner.measure import LiveMemory

GRID, TEXT, BATCH = (4, 8, 8), 32, 2


def geometry(version: str):
    base = LTX2_3 if version == "2.3" else LTX2_0
    return dataclasses.replace(base, num_layers=2, num_heads=4, head_dim=32, audio_head_dim=8, in_channels=16,
                               audio_in_channels=8, caption_channels=None if version == "2.3" else 48)


class _Tracker(LiveMemory):
    """LiveMemory that also notes the storages of parameters' autocast copies."""

    def __init__(self):
        super().__init__()
        self.copies = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.nn.Parameter):
            self.copies.add(StorageWeakRef(out.untyped_storage()))
        return out

    @property
    def weight_copies(self) -> int:
        self.live   # drops the expired storages
        return sum(n for ref, n in self._storages.items() if ref in self.copies)


def measured_activations(g, bf16: bool, memory: MemoryConfig = MemoryConfig(), weight_copies: bool = True) -> int:
    """Bytes live after one forward and loss; ``weight_copies=False``: less the parameters'
    autocast copies still held."""
    torch.manual_seed(0)
    model = LTX2Model(g)
    apply_activation_checkpointing(model, memory)
    spec = spec_of(model)
    x0 = torch.randn(BATCH, g.in_channels, *GRID)
    cond = Conditions(y=torch.randn(BATCH, TEXT, g.caption_channels or g.dim), y_mask=None,
                      fps=torch.full((BATCH,), 24.0))
    t = torch.rand(BATCH)
    with _Tracker() as tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            noise = torch.randn_like(x0)
            s = t.view(-1, 1, 1, 1, 1)
            x_t = (1 - s) * x0 + s * noise
            target = noise - x0
            loss = ((model(*spec.model_inputs(x_t, t, cond)).float() - target) ** 2).mean()
        # Out of autocast, as training's backward runs: its cache of bf16 weight copies is gone
        # (those a block saved for backward stay; a checkpointed block saved none).
        gc.collect()
        live = tracker.live - (0 if weight_copies else tracker.weight_copies)
    del loss
    return live


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_ltx2_activations_match_live_memory(version, precision):
    g = geometry(version)
    bf16 = precision == "bf16"
    measured = measured_activations(g, bf16)
    predicted, _ = activation_bytes(g, Shape(BATCH, *GRID, g.in_channels, TEXT), Parallel(), Precision(bf16),
                                    MemoryConfig(), g.num_layers)
    assert abs(predicted / measured - 1) <= 0.05, f"LTX-{version} {precision}: {predicted / measured:.3f}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_ltx2_checkpointed_activations_match_live_memory(version, mode, precision):
    g = geometry(version)
    bf16 = precision == "bf16"
    memory = MemoryConfig(checkpointing=mode)
    measured = measured_activations(g, bf16, memory, weight_copies=False)
    predicted, detail = activation_bytes(g, Shape(BATCH, *GRID, g.in_channels, TEXT), Parallel(), Precision(bf16),
                                         memory, g.num_layers)
    assert detail["checkpointed_blocks"] == g.num_layers
    assert abs(predicted / measured - 1) <= 0.05, f"LTX-{version} {mode} {precision}: {predicted / measured:.3f}"


def test_ltx2_checkpointed_blocks_keep_a_bf16_residual_and_the_modulation_once():
    g = geometry("2.3")
    shape = Shape(BATCH, *GRID, g.in_channels, TEXT)
    tokens = BATCH * 256
    args = (g, tokens, BATCH, TEXT, Parallel())
    assert block_activation_bytes(*args, Precision(True), mode="full") == tokens * g.dim * 2
    assert block_activation_bytes(*args, Precision(False), mode="full") == tokens * g.dim * 4
    # the shared inputs (9 rows of modulation, the time embedding: 10 D fp32) once, not per block
    full = MemoryConfig(checkpointing="full")
    one, detail = activation_bytes(g, shape, Parallel(), Precision(False), full, 1)
    two, _ = activation_bytes(g, shape, Parallel(), Precision(False), full, 2)
    assert two - one == detail["per_block_full"] == tokens * g.dim * 4
    plain, plain_detail = activation_bytes(g, shape, Parallel(), Precision(False), MemoryConfig(), 1)
    outside = plain - plain_detail["per_block_plain"]
    assert one - detail["per_block_full"] - outside == pytest.approx(10 * tokens * g.dim * 4, abs=1)


def test_ltx2_profile_splits_heads_under_tensor_parallelism():
    """TP=2 halves the per-head tensors (q, k, v, attention outputs, the FFN hidden) but not the
    residual stream or the modulation sums."""
    g = geometry("2.3")
    shape = Shape(BATCH, *GRID, g.in_channels, TEXT)
    one, _ = activation_bytes(g, shape, Parallel(), Precision(False), MemoryConfig(), 2)
    two, _ = activation_bytes(g, shape, Parallel(tp=2), Precision(False), MemoryConfig(), 2)
    assert 0.5 * one < two < 0.8 * one
