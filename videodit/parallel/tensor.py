"""Tensor parallelism with DTensor ``parallelize_module``, from the family's declared plan
(``ModelSpec.tensor_parallel_plan``, see ``models/spec.py``).

Megatron-style pairs inside every block, so each pair costs one all-reduce in forward and one
in backward: attention's q, k, v column-wise (each rank owns ``heads / tp`` heads) and its
output projection row-wise, the MLP's first layer column-wise and its second row-wise. Blocks
see whole (replicated) activations between the pairs, so sequence parallelism, which works on
the block inputs, composes with this unchanged. What stays whole on every TP rank (embedders,
modulation tables, the output layer) gets identical gradients on every rank, except the
parameters the plan names ``partial`` (STDiT's per-head q/k norms: each rank sees only its
heads), which ``parallel.gradients`` all-reduces over the TP group after backward.

Norms over all heads (Wan's q/k RMSNorm over the full width, the plan's ``sharded_norms``)
need the mean of squares of the whole width: they run on DTensors sharded like the columns
(:func:`_shard_norm`), so DTensor all-reduces it.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)

from videodit.models.families import spec_of
from videodit.models.lora import is_lora_layer
from videodit.parallel.lora import tensor_parallel_plan


def _replicated_inputs(*layouts) -> PrepareModuleInput:
    """Hand a module's tensor inputs to its column-wise projections as one replicated DTensor
    each: the gradients of q, k and v (or fc1) then add up as partial sums and cross the
    TP group in one all-reduce, instead of one per projection."""
    return PrepareModuleInput(input_layouts=layouts, desired_input_layouts=layouts, use_local_output=False)


def _style(style):
    """A declared style (``models/spec.py``'s TensorParallelPlan) as a DTensor ParallelStyle."""
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "colwise_gathered":
        return ColwiseParallel(output_layouts=Replicate())
    kind, layouts = style
    if kind != "inputs":
        raise ValueError(f"unknown tensor-parallel style {style!r}")
    return _replicated_inputs(*(Replicate() if layout == "replicate" else None for layout in layouts))


def _styles(plan: dict) -> dict:
    return {path: _style(style) for path, style in plan.items()}


def _shard_norm(module: nn.Module, mesh) -> None:
    """A norm over a column-sharded width (Wan's q/k RMSNorm over all heads): its weight is
    sharded like the columns and it computes on DTensors, so the mean of squares over the
    sharded width becomes one all-reduce (DTensor's), and hands on this rank's columns."""
    def partition(name, mod, mesh):
        for key, param in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]),
                                                     requires_grad=param.requires_grad))

    distribute_module(module, mesh, partition,
                      input_fn=lambda mod, inputs, mesh: tuple(
                          DTensor.from_local(x, mesh, [Shard(-1)], run_check=False) for x in inputs),
                      output_fn=lambda mod, out, mesh: out.to_local())


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> list[str]:
    """Shard ``model`` (a whole model or a pipeline stage) over ``tp_mesh`` in place as its
    family's plan says; return the names of the parameters whose gradients each TP rank
    computes only in part (see the module docstring)."""
    plan = spec_of(model).tensor_parallel_plan()
    for block in model.blocks:   # layers with LoRA adapters: their base and adapters (parallel/lora.py)
        parallelize_module(block, tp_mesh, tensor_parallel_plan(block, _styles(plan.block(block))))
        for name, module in block.named_modules():
            if plan.sharded_norms and name.endswith(plan.sharded_norms):
                _shard_norm(module, tp_mesh)
    root_plan = {name: style for name, style in plan.root.items() if _has_module(model, name)}
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model, _styles(root_plan)))
    return [name for name, _ in model.named_parameters()
            if plan.partial and name.rsplit(".", 2)[-2] in plan.partial]


def _has_module(model: nn.Module, name: str) -> bool:
    """A pipeline stage keeps only some of the root modules (see ``parallel/pipeline.py``)."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return False
    return isinstance(module, nn.Linear) or is_lora_layer(module)
