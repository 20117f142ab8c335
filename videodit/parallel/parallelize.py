"""Apply parallelism to a DiT from outside, in order: pipeline stages, tensor parallel,
sequence parallel, the activation-memory levers (checkpointing, offload, compression), then
data parallel (DDP, or FSDP2 per block and at each root).

``parallelize`` returns a :class:`ParallelModel`. Its ``local_model`` holds this rank's
parameters under their names in the whole model (FSDP2 and TP shard in place; pipeline
stages keep only their parts), so state dicts, EMA and checkpoints use it directly.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from videodit.config import MemoryConfig, ParallelConfig
from videodit.parallel.activation_checkpoint import apply_activation_checkpointing
from videodit.parallel.distributed import DistContext
from videodit.parallel.gradients import clip_gradients, sum_partial_gradients
from videodit.parallel.pipeline import Pipeline, build_pipeline
from videodit.parallel.saved_tensors import wrap_saved_tensors
from videodit.parallel.sequence import apply_sequence_parallel
from videodit.parallel.tensor import apply_tensor_parallel


@dataclass
class ParallelModel:
    local_model: nn.Module          # this rank's parameters, named as in the whole model
    module: nn.Module               # what a step calls when there is no pipeline
    pipeline: Pipeline | None = None
    ctx: DistContext | None = None
    partial_gradients: list[str] = field(default_factory=list)   # summed over TP after backward

    def clip_gradients(self, max_norm: float) -> float:
        """Finish this step's gradients (TP partial sums) and clip them by the global norm."""
        if self.partial_gradients:
            sum_partial_gradients(self.local_model, self.partial_gradients, self.ctx.group("tp"))
        pp_group = self.ctx.group("pp") if self.pipeline is not None else None
        return clip_gradients(self.local_model.parameters(), max_norm, pp_group)


def parallelize(model: nn.Module, ctx: DistContext, cfg: ParallelConfig, *, memory: MemoryConfig,
                param_dtype: torch.dtype | None, pipeline_loss: Callable | None = None,
                block_costs: Sequence[float] | None = None) -> ParallelModel:
    """With ``parallel.pp > 1``: ``pipeline_loss(output_patches, target)`` is the last stage's
    loss (see ``pipeline.velocity_mse``) and ``block_costs`` the relative cost of each block
    (see ``pipeline.block_costs``)."""
    dims = ctx.dims
    pipeline, stages = None, [model]
    if dims.pp > 1:
        per_rank, microbatches = dims.check_pipeline(cfg, depth=len(model.blocks) // 2)
        pipeline, model = build_pipeline(
            model, pp=dims.pp, pp_rank=ctx.rank_in("pp"), schedule=cfg.pp_schedule, stages_per_rank=per_rank,
            microbatches=microbatches, costs=block_costs or [1.0] * len(model.blocks), group=ctx.group("pp"),
            device=ctx.device, loss_fn=pipeline_loss)
        stages = [pipeline.stages[s] for s in sorted(pipeline.stages)]
    partial = apply_tensor_parallel(model, ctx.meshes["tp"]) if dims.tp > 1 else []
    if dims.sp > 1:
        apply_sequence_parallel(model, ctx.group("sp"))
    apply_memory_levers(model, memory)
    module = model
    if dims.data_parallel in ("fsdp", "hsdp"):
        apply_fsdp(model, stages, ctx, cfg, param_dtype=param_dtype)
    elif dims.data_parallel == "ddp":
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        module = DistributedDataParallel(model, process_group=ctx.group("dp_sp"), device_ids=device_ids)
    return ParallelModel(model, module, pipeline, ctx, partial)


def apply_memory_levers(model: nn.Module, cfg: MemoryConfig) -> list[int]:
    """Checkpoint the chosen blocks; offload or compress what the other blocks save for
    backward (a checkpointed block saves only its inputs). Returns the checkpointed indices."""
    chosen = apply_activation_checkpointing(model, cfg)
    if cfg.offload or cfg.compression != "none":
        for i, block in enumerate(model.blocks):
            if i not in chosen:
                wrap_saved_tensors(block, offload=cfg.offload, compression=cfg.compression)
    return chosen


def apply_fsdp(model: nn.Module, roots: list[nn.Module], ctx: DistContext, cfg: ParallelConfig, *,
               param_dtype: torch.dtype | None) -> None:
    """FSDP2 on every block, then on each root (the model, or each pipeline stage): the
    embedders and the output layer.

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
    for root in roots:
        fully_shard(root, reshard_after_forward=cfg.reshard_after_forward, **options)
