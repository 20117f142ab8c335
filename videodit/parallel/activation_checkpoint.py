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
in small steps; or ``memory.checkpoint_blocks``, the first n blocks of each kind (the MMDiT's
double and single blocks: Open-Sora 2.0's ``grad_ckpt_settings``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from videodit.config import MemoryConfig
from videodit.errors import UserError
from videodit.models.lora import adapter_names, adapter_state, lora_layers, using_adapter

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
    layers = lora_layers(module)

    def forward(*args, **kwargs):
        if len(adapter_names(layers)) < 2:
            return checkpoint(inner, *args, **options, **kwargs)
        # A shared-base run switches adapters between forward and backward (models/lora.py): the
        # recomputation must use the adapter this forward used, not the one active at backward.
        adapter = adapter_state(layers)

        def run(*args, **kwargs):
            with using_adapter(layers, adapter):
                return inner(*args, **kwargs)
        return checkpoint(run, *args, **options, **kwargs)

    module.forward = forward


def block_kinds(model: nn.Module) -> list[str]:
    """The kind of each of ``model.blocks`` (the family's ``block_kind``: MMDiT double/single)."""
    from videodit.models.families import spec_of
    spec = spec_of(model)
    return [spec.block_kind(block) for block in model.blocks]


def chosen_blocks(model: nn.Module, memory: MemoryConfig) -> list[int]:
    """The indices of ``model.blocks`` that ``memory`` checkpoints; ``memory.checkpoint_blocks``
    (first n per kind) is checked against the model's kinds, in one line. For a pipeline stage
    (``block_ids``: its blocks' numbers in the whole model) the first n of a kind are the whole
    model's, so a stage of later blocks checkpoints only those among them."""
    if memory.checkpoint_blocks is None:
        return memory.checkpointed_blocks(len(model.blocks))
    from videodit.models.families import spec_of
    kinds = list(spec_of(model).block_kinds(model.geometry))   # every block of the whole model
    ids = getattr(model, "block_ids", range(len(model.blocks)))
    counts = memory.checkpoint_blocks
    known = sorted(set(kinds), key=kinds.index)
    example = ", ".join(f"{kind}: n" for kind in known)
    if memory.checkpointing == "none":
        raise UserError("memory.checkpoint_blocks chooses which blocks to checkpoint, but memory.checkpointing=none; "
                        "set memory.checkpointing=full (or selective)")
    bad = [f"{kind}: {n!r}" for kind, n in counts.items()
           if kind not in known or isinstance(n, bool) or not isinstance(n, int) or n < 0]
    if bad:
        raise UserError(f"memory.checkpoint_blocks has {', '.join(bad)}; give a count >= 0 per block kind of this "
                        f"model: {{{example}}}")
    whole = set(memory.checkpointed_blocks(len(kinds), kinds))
    return [local for local, i in enumerate(ids) if i in whole]


def apply_activation_checkpointing(model: nn.Module, memory: MemoryConfig) -> list[int]:
    """Checkpoint the blocks of ``model.blocks`` that ``memory`` chooses; returns their indices."""
    chosen = chosen_blocks(model, memory)
    for i in chosen:
        checkpoint_module(model.blocks[i], memory.checkpointing)
    return chosen
