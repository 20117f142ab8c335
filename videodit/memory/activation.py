"""Activation checkpointing applied from outside the model.

Each chosen block's ``forward`` is replaced on the instance by one that runs the original
under ``torch.utils.checkpoint``: activations inside the block are recomputed in backward
instead of stored. Parameter names and state dicts stay exactly as they were.
"""

from __future__ import annotations

from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_module(module: nn.Module) -> None:
    inner = module.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def apply_activation_checkpointing(model: nn.Module, every: int = 1) -> int:
    """Checkpoint every ``every``-th block of ``model.blocks``; returns how many."""
    chosen = [block for i, block in enumerate(model.blocks) if i % every == 0]
    for block in chosen:
        checkpoint_module(block)
    return len(chosen)
