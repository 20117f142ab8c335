"""Activation checkpointing applied from outside the model.

Each chosen block's ``forward`` is replaced on the instance by one that runs the original
under ``torch.utils.checkpoint`` (non-reentrant). Parameter names and state dicts stay
exactly as they were.

* ``full``: a block keeps only its inputs; everything inside is recomputed in backward.
* ``selective``: a block keeps the outputs of its matmuls and attention kernels (the
  expensive ops) and recomputes the cheap elementwise ones (norms, adaLN modulation, GELU,
  rotary embedding, gating), whose saved tensors are about half of a block's activations.

Which blocks: ``MemoryConfig.checkpointed_blocks`` (every ``checkpoint_every``-th block, then
the first ``checkpoint_fraction`` of those), so the planner can trade memory for recompute
in small steps.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from videodit.config import MemoryConfig

_aten = torch.ops.aten
# Ops whose outputs selective checkpointing keeps: the matmuls and every attention kernel
# SDPA may dispatch to (the flash/efficient/cudnn kernels on CUDA, flash or math on CPU).
_SAVED_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    *(getattr(_aten, name).default for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_efficient_attention_forward", "_flash_attention_forward")
      if hasattr(_aten, name)),
}


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_module(module: nn.Module, mode: str = "full") -> None:
    inner = module.forward
    options = dict(use_reentrant=False)
    if mode == "selective":
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, **options, **kwargs)

    module.forward = forward


def apply_activation_checkpointing(model: nn.Module, memory: MemoryConfig) -> list[int]:
    """Checkpoint the blocks of ``model.blocks`` that ``memory`` chooses; returns their indices."""
    chosen = memory.checkpointed_blocks(len(model.blocks))
    for i in chosen:
        checkpoint_module(model.blocks[i], memory.checkpointing)
    return chosen
