"""Tensor parallelism for the spatial-temporal DiT with DTensor ``parallelize_module``.

Megatron-style pairs inside every block, so each pair costs one all-reduce in forward
and one in backward:

- self- and cross-attention: q, k, v column-wise (each rank owns ``heads / tp`` heads),
  the output projection row-wise;
- MLP: fc1 column-wise, fc2 row-wise.

At the root, the caption MLP is a column/row pair too, and the adaLN-single projection
(``t_block``, ``6 x hidden`` outputs) is column-wise with its output gathered. Blocks
see whole (replicated) activations between the pairs, so sequence parallelism, which
works on the block inputs, composes with this unchanged.

Everything else stays whole on every TP rank: the patch embedding, the embedders' small
MLPs, the per-block adaLN tables and the output layer. Their gradients are identical on
every TP rank, except for the per-head q/k RMSNorm weights: each rank sees only its own
heads, so their gradients are partial sums that :func:`partial_gradient_names` lists
and ``parallel.gradients`` all-reduces over the TP group after backward.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)

from videodit.models.lora import is_lora_layer
from videodit.parallel.lora import tensor_parallel_plan


def _replicated_inputs(*layouts) -> PrepareModuleInput:
    """Hand a module's tensor inputs to its column-wise projections as one replicated DTensor
    each: the gradients of q, k and v (or fc1) then add up as partial sums and cross the
    TP group in one all-reduce, instead of one per projection."""
    return PrepareModuleInput(input_layouts=layouts, desired_input_layouts=layouts, use_local_output=False)


def _attention_plan(prefix: str, inputs: tuple) -> dict:
    return {prefix: _replicated_inputs(*inputs),
            f"{prefix}.q": ColwiseParallel(), f"{prefix}.k": ColwiseParallel(),
            f"{prefix}.v": ColwiseParallel(), f"{prefix}.proj": RowwiseParallel()}


def block_plan(temporal: bool) -> dict:
    self_attention_inputs = (Replicate(), None) if temporal else (Replicate(),)   # temporal also gets RoPE
    return {**_attention_plan("attn", self_attention_inputs),
            **_attention_plan("cross_attn", (Replicate(), Replicate(), None)),   # x, caption, caption mask
            "mlp": _replicated_inputs(Replicate()), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}

ROOT_PLAN = {"caption_embedder.proj.fc1": ColwiseParallel(), "caption_embedder.proj.fc2": RowwiseParallel(),
             "t_block.1": ColwiseParallel(output_layouts=Replicate())}


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> list[str]:
    """Shard ``model`` over ``tp_mesh`` in place; return the names of the parameters whose
    gradients each TP rank computes only in part (see the module docstring)."""
    for block in model.blocks:   # layers with LoRA adapters: their base and adapters (parallel/lora.py)
        parallelize_module(block, tp_mesh, tensor_parallel_plan(block, block_plan(block.temporal)))
    root_plan = {name: style for name, style in ROOT_PLAN.items() if _has_module(model, name)}
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model, root_plan))
    return partial_gradient_names(model)


def partial_gradient_names(model: nn.Module) -> list[str]:
    """The per-head q/k norm weights of self-attention."""
    return [name for name, _ in model.named_parameters()
            if name.rsplit(".", 2)[-2] in ("q_norm", "k_norm")]


def _has_module(model: nn.Module, name: str) -> bool:
    """A pipeline stage keeps only some of the root modules (see ``parallel/pipeline.py``)."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return False
    return isinstance(module, nn.Linear) or is_lora_layer(module)
