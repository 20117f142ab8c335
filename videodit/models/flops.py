"""The FLOP model, whatever the family: one model for every user. The pipeline balances its
stages with it, the planner gives buckets equal step time with it, ``videodit plan`` prints it
and the trainer reports MFU from it. Each family counts its own parts
(``ModelSpec.forward_flops``, on the patched grid); the step totals are
``models/flop_count.py``'s. ``tests/models/test_flops.py`` holds every family against
FlopCounterMode on real models.
"""

from __future__ import annotations

from videodit.config import MemoryConfig
from videodit.models.families import spec_of
from videodit.models.flop_count import FlopCount, StepFlops, step_costs

__all__ = ["FlopCount", "StepFlops", "block_costs", "forward_flops", "step_costs", "train_step_flops"]


def forward_flops(geometry, frames: int, height: int, width: int, caption_tokens: int) -> FlopCount:
    """Forward FLOPs of one sample of latent shape (frames, height, width) with captions padded
    to ``caption_tokens`` (the mask does not shorten them)."""
    spec = spec_of(geometry)
    return spec.forward_flops(geometry, *spec.token_grid(geometry, frames, height, width), caption_tokens)


def train_step_flops(geometry, batch: int, frames: int, height: int, width: int,
                     caption_tokens: int, memory: MemoryConfig | None = None,
                     fused_attention: bool = True) -> StepFlops:
    """Model and hardware FLOPs of one training step (forward + backward) of ``batch`` samples,
    as the Trainer runs it. ``fused_attention``: SDPA runs a fused kernel (GPU), whose backward
    recomputes QK^T; the math path (CPU under FlopCounterMode) keeps it."""
    count = forward_flops(geometry, frames, height, width, caption_tokens)
    kinds = spec_of(geometry).block_kinds(geometry) if memory is not None and memory.checkpoint_blocks else None
    hardware = sum(step_costs(count, memory, fused_attention, kinds))
    return StepFlops(batch * (count.total + count.backward), batch * hardware)


def block_costs(geometry, frames: int, positions: int, caption_tokens: int) -> list[float]:
    """Pipeline stage balance: :func:`step_costs` on the patched grid (``frames`` T' x
    ``positions`` S). Checkpoint recompute is left out: under pipeline parallelism the
    checkpointed blocks are chosen per stage, after the split these costs decide."""
    return step_costs(spec_of(geometry).forward_flops(geometry, frames, positions, caption_tokens))
