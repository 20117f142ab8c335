"""The activation-memory levers of ``config.memory``, applied to a model's blocks from outside."""

from __future__ import annotations

from torch import nn

from videodit.config import MemoryConfig
from videodit.memory.activation import apply_activation_checkpointing
from videodit.memory.saved import wrap_saved_tensors


def apply_memory_levers(model: nn.Module, cfg: MemoryConfig) -> list[int]:
    """Checkpoint the chosen blocks; offload or compress what the other blocks save for
    backward (a checkpointed block saves only its inputs). Returns the checkpointed indices."""
    chosen = apply_activation_checkpointing(model, cfg.checkpointing, cfg.checkpoint_every, cfg.checkpoint_fraction)
    if cfg.offload or cfg.compression != "none":
        for i, block in enumerate(model.blocks):
            if i not in chosen:
                wrap_saved_tensors(block, offload=cfg.offload, compression=cfg.compression)
    return chosen
