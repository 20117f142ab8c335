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

Tables of per-head values handed to an attention module as keyword arguments (LTX-2's RoPE,
whose frequency bands differ per head: (cos, sin) [B, heads, T, head_dim / 2]) are cut to the
rank's heads before the module runs (style ``("head_tables", names)``, :class:`_HeadTables`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)

from videodit.errors import UserError
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
    if kind == "head_tables":
        return _HeadTables(layouts)
    if kind == "fused_colwise":
        return _FusedColwise(layouts)
    if kind == "fused_rowwise":
        return _FusedRowwise(layouts)
    if kind != "inputs":
        raise ValueError(f"unknown tensor-parallel style {style!r}")
    return _replicated_inputs(*(Replicate() if layout == "replicate" else None for layout in layouts))


class _HeadTables(ParallelStyle):
    """A module whose keyword arguments ``names`` are tables of per-head values (heads at dim 1, or
    tuples of such tables): each rank's module gets its own heads' rows, in the column-wise
    projections' order (rank r: heads r H/tp .. (r+1) H/tp). No gradient flows through them."""

    def __init__(self, names):
        super().__init__()
        self.names = tuple(names)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        size, rank = device_mesh.size(), device_mesh.get_local_rank()

        def mine(table):
            if isinstance(table, (tuple, list)):
                return type(table)(mine(part) for part in table)
            if table.shape[1] % size:
                raise UserError(f"a per-head table of {table.shape[1]} heads does not split over parallel.tp={size}")
            return table.chunk(size, dim=1)[rank]

        def narrow(mod, args, kwargs):
            return args, {name: mine(value) if name in self.names and value is not None else value
                          for name, value in kwargs.items()}

        module.register_forward_pre_hook(narrow, with_kwargs=True)
        return module


def _fused_chunks(sizes) -> int:
    """How many equal chunks a fused layer of parts ``sizes`` (attention part first) is cut into:
    the attention part must be one chunk, so that each rank's slice of it is whole heads, and
    every other part a whole number of chunks (hidden units of an MLP may go to any rank)."""
    first = sizes[0]
    if any(size % first for size in sizes):
        raise UserError(f"tensor parallelism shards a fused layer of parts {list(sizes)} only when every part is a "
                        f"multiple of the first ({first}); use an integer model.mlp_ratio or parallel.tp=1")
    return sum(sizes) // first


class _FusedColwise(ColwiseParallel):
    """Column-wise over a layer whose outputs are several parts (the single block's v_mlp: [v; MLP
    input]): each rank takes its slice of every part (Open-Sora's ``FusedLinear1D_Col``). The
    weight is a DTensor ``_StridedShard(0)``, so it gathers to the layer's own layout (checkpoints
    as in one process); the output is this rank's [v slice; MLP slice], local."""

    def __init__(self, sizes):
        super().__init__()
        self.chunks = _fused_chunks(sizes)

    def _partition_linear_fn(self, name, module, device_mesh):
        _shard_fused_weight(module, device_mesh, 0, self.chunks)

    def _apply(self, module, device_mesh):
        return distribute_module(module, device_mesh, self._partition_linear_fn,
                                 functools.partial(self._prepare_input_fn, self.input_layouts,
                                                   self.desired_input_layouts),
                                 lambda mod, outputs, mesh: outputs.to_local())


def _shard_fused_weight(module: nn.Module, device_mesh, dim: int, chunks: int) -> None:
    """A fused linear's weight sharded along ``dim`` (0: outputs, 1: inputs), each rank taking its
    slice of every part; the bias stays replicated (FSDP2 cannot shard a dim TP already strides,
    see fsdp_placement)."""
    weight = distribute_tensor(module.weight, device_mesh, [_StridedShard(dim, split_factor=chunks)])
    module.register_parameter("weight", nn.Parameter(weight, requires_grad=module.weight.requires_grad))
    if getattr(module, "bias", None) is not None:
        bias = distribute_tensor(module.bias, device_mesh, [Replicate()])
        module.register_parameter("bias", nn.Parameter(bias, requires_grad=module.bias.requires_grad))


class _FusedRowwise(RowwiseParallel):
    """Row-wise over a layer whose inputs are several parts (the single block's linear2: [attention;
    MLP activation]), each rank holding its slice of every part as :class:`_FusedColwise` made it;
    the output is all-reduced."""

    def __init__(self, sizes):
        chunks = _fused_chunks(sizes)
        super().__init__(input_layouts=_StridedShard(-1, split_factor=chunks))
        self.chunks = chunks

    def _partition_linear_fn(self, name, module, device_mesh):
        _shard_fused_weight(module, device_mesh, 1, self.chunks)

    def _apply(self, module, device_mesh):
        return distribute_module(module, device_mesh, self._partition_linear_fn,
                                 functools.partial(self._prepare_input_fn, self.input_layouts, self.input_layouts),
                                 functools.partial(self._prepare_output_fn, self.output_layouts,
                                                   self.use_local_output))


def fsdp_placement(param) -> Shard | None:
    """FSDP2's placement of a parameter (``fully_shard``'s ``shard_placement_fn``): a weight that
    tensor parallelism strides along dim 0 (a fused column-wise layer) is sharded along its
    inputs, dim 1 (FSDP2 composes dim 0 with a stride wrongly); others as FSDP2 chooses."""
    if isinstance(param, DTensor) and any(isinstance(p, _StridedShard) and p.dim == 0 for p in param.placements):
        return Shard(1)
    return None


def _plain(tensor):
    """A strided DTensor (a fused layer's TP shard) redistributed to the plain ``Shard`` of the same
    dim; anything else as it is."""
    if not isinstance(tensor, DTensor) or not any(isinstance(p, _StridedShard) for p in tensor.placements):
        return tensor
    with torch.no_grad():
        return tensor.redistribute(placements=[Shard(p.dim) if isinstance(p, _StridedShard) else p
                                               for p in tensor.placements])


def dcp_state(state):
    """``state`` (nested dicts and lists of tensors: model, optimizer, EMA) with every strided
    DTensor as a plain-sharded copy: DCP writes one contiguous chunk per rank and refuses the
    fused layers' strided shards. Load into the result, then :func:`restore_from_dcp`."""
    if isinstance(state, dict):
        return {key: dcp_state(value) for key, value in state.items()}
    if isinstance(state, list):
        return [dcp_state(value) for value in state]
    return _plain(state)


def restore_from_dcp(live, loaded) -> None:
    """Copy what DCP loaded into :func:`dcp_state`'s copies back into ``live``'s strided DTensors."""
    if isinstance(live, dict):
        for key, value in live.items():
            restore_from_dcp(value, loaded[key])
    elif isinstance(live, list):
        for value, other in zip(live, loaded):
            restore_from_dcp(value, other)
    elif loaded is not live and isinstance(live, DTensor):
        with torch.no_grad():
            live.to_local().copy_(loaded.redistribute(placements=live.placements).to_local())


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
