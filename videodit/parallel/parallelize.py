"""Apply parallelism to a DiT from outside, in order: sequence parallel, activation
checkpointing, then data parallel (DDP, or FSDP2 per block and at the root).

``parallelize`` returns the module the training step calls. The model object itself keeps
its parameter names (FSDP2 shards in place), so state dicts, EMA and checkpoints use it
directly.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from videodit.config import ParallelConfig
from videodit.memory.activation import apply_activation_checkpointing
from videodit.parallel.distributed import DistContext
from videodit.parallel.sequence import apply_sequence_parallel


def parallelize(model: nn.Module, ctx: DistContext, cfg: ParallelConfig, *, activation_checkpointing: bool,
                param_dtype: torch.dtype | None) -> nn.Module:
    if ctx.dims.sp > 1:
        apply_sequence_parallel(model, ctx.group("sp"))
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    kind = ctx.dims.data_parallel
    if kind in ("fsdp", "hsdp"):
        apply_fsdp(model, ctx, cfg, param_dtype=param_dtype)
        return model
    if kind == "ddp":
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DistributedDataParallel(model, process_group=ctx.group("dp_sp"), device_ids=device_ids)
    return model


def apply_fsdp(model: nn.Module, ctx: DistContext, cfg: ParallelConfig, *, param_dtype: torch.dtype | None) -> None:
    """FSDP2 on every block, then the root (embedders and output layer).

    Gradients are reduced in fp32 and the sharded master weights stay fp32; only the
    gathered compute copy is ``param_dtype``. HSDP uses a 2D mesh: replicate x shard.
    """
    mesh = ctx.meshes["hsdp" if ctx.dims.data_parallel == "hsdp" else "dp_shard_sp"]
    options = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
                   offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy())
    # FSDP2 warns that the model returns a view (the un-padding slice); nothing writes to it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    blocks = model.blocks
    for i, block in enumerate(blocks):
        # The last block's weights are needed again first in backward: never reshard them.
        fully_shard(block, reshard_after_forward=cfg.reshard_after_forward and i < len(blocks) - 1, **options)
    fully_shard(model, reshard_after_forward=cfg.reshard_after_forward, **options)


def gradient_sync(module: nn.Module, enabled: bool):
    """A context in which backward does (enabled) or skips (disabled) the gradient collective:
    gradient accumulation communicates only on the last micro-batch."""
    if isinstance(module, DistributedDataParallel):
        return contextlib.nullcontext() if enabled else module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):   # FSDP2
        module.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def clip_gradients(parameters, max_norm: float) -> float:
    """Clip by the global gradient norm across all shards; return the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm if max_norm > 0 else math.inf)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)
