"""Apply parallelism to a DiT from outside, in order: pipeline stages, fp8 compute of the block
linears (``train.fp8``, ``float8.py``: torchtitan converts before it parallelises), tensor parallel,
sequence parallel, activation checkpointing, regional compilation (``train.compile``), the
offload and compression levers, block swapping (``memory.swap_blocks``), then data parallel (DDP,
or FSDP2 per block and at each root).

``parallelize`` returns a :class:`ParallelModel`. Its ``local_model`` holds this rank's
parameters under their names in the whole model (FSDP2 and TP shard in place; pipeline
stages keep only their parts), so state dicts, EMA and checkpoints use it directly; its
``forward_backward`` runs one micro-batch whatever the layout (the pipeline branch lives
here, not in the training loop).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from videodit.config import MemoryConfig, ParallelConfig
from videodit.parallel.activation_checkpoint import apply_activation_checkpointing
from videodit.parallel.block_swap import apply_block_swap, swapped_names
from videodit.parallel.checkpoint_offload import apply_checkpoint_input_offload
from videodit.parallel.compile import CompileOptions, CompileStats, apply_compile
from videodit.parallel.distributed import DistContext
from videodit.parallel.float8 import Float8Options, apply_float8
from videodit.parallel.full_attention import apply_full_attention_sp
from videodit.parallel.joint_attention import apply_joint_attention_sp
from videodit.models.flops import block_costs
from videodit.models.families import spec_of
from videodit.models.lora import adapter_names, lora_layers
from videodit.models.spec import model_parts
from videodit.parallel.gradients import clip_gradients, gradient_sync, sum_partial_gradients
from videodit.parallel.pipeline import (PipelineSchedule, build_pipeline, check_microbatches,
                                       pack_target, pipeline_loss)
from videodit.parallel.saved_tensors import wrap_saved_tensors
from videodit.parallel.sequence import apply_sequence_parallel
from videodit.parallel.tensor import apply_tensor_parallel, fsdp_placement



@dataclass
class ParallelModel:
    """A model with its parallelism applied: what a training step calls, whatever the layout.

    ``forward_backward`` runs one micro-batch (through the pipeline schedule when there is
    one), so the trainer's loop has no layout branches.
    """

    local_model: nn.Module          # this rank's parameters, named as in the whole model
    module: nn.Module               # what a step calls when there is no pipeline
    loss_fn: Callable               # (model output, x_t, t, velocity target) -> mean loss
    # A loss with ``extra_targets()`` (the micro-batch's other per-sample targets: LTX-2's audio
    # stream's) takes them as keywords under a pipeline; it reads its own otherwise.
    ctx: DistContext
    pipeline: PipelineSchedule | None = None
    autocast_dtype: torch.dtype | None = None
    partial_gradients: list[str] = field(default_factory=list)   # summed over TP after backward
    compile_stats: CompileStats | None = None                      # graphs compiled for the blocks

    @functools.cached_property
    def frame_mask_index(self) -> int | None:
        """Where the model inputs carry ``x_mask`` (the family's, for frame conditioning)."""
        return spec_of(self.local_model).frame_mask_index()

    @property
    def sharded(self) -> bool:
        """Whether this rank holds only part of the weights (FSDP/HSDP shards, TP shards or
        pipeline stages): checkpoints then gather whole tensors and also write DCP shards."""
        dims = self.ctx.dims
        return dims.data_parallel in ("fsdp", "hsdp") or dims.tp > 1 or dims.pp > 1

    def autocast(self):
        """The mixed-precision context of forward passes (none in fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.autocast_dtype)

    def train(self) -> None:
        self.module.train()

    def loss(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        """The mean loss of one micro-batch, for backward (not with a pipeline, whose schedule
        computes the loss on its last stage)."""
        if self.pipeline is not None:
            raise RuntimeError("under pipeline parallelism the loss is computed inside forward_backward")
        with self.autocast():
            out = self.module(*inputs)
        at = self.frame_mask_index
        return self.loss_fn(out, noisy_latents(inputs, target), inputs[1], target,
                            *(inputs[at:at + 1] if at is not None else ()))

    def forward_backward(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, *, scale: float,
                         sync: bool) -> float:
        """Forward and backward of one micro-batch of model inputs (x_t, t, y, y_mask, fps,
        drop_caption) against its velocity target, with gradients of ``scale`` x its mean
        loss. ``sync``: communicate gradients (the last micro-batch of a step). Returns the
        scaled loss this rank saw (0 on pipeline ranks without the last stage)."""
        if self.pipeline is not None:
            with self.autocast():
                at = self.frame_mask_index
                x_mask = inputs[at] if at is not None and len(inputs) > at else None
                geometry = self.local_model.geometry
                packed = pack_target(noisy_latents(inputs, target), target, inputs[1], x_mask,
                                     spec_of(geometry).patch_size(geometry)[0])
                # A loss's own targets of the micro-batch (LTX-2's audio), cut with the video's
                extra = getattr(self.loss_fn, "extra_targets", dict)()
                return self.pipeline.step(inputs, packed, scale, extra)
        with gradient_sync(self.module, enabled=sync):
            loss = self.loss(inputs, target) * scale
            loss.backward()
        return loss.item()

    def compile_metrics(self) -> dict:
        """``{"recompiles": n}`` under ``train.compile`` (graphs compiled after the first of each
        block kind, on this rank), else nothing."""
        return {} if self.compile_stats is None else {"recompiles": self.compile_stats.recompiles}

    def global_loss(self, local: float) -> float:
        """A step's loss over every rank, from each rank's sum of ``forward_backward`` results."""
        if self.pipeline is not None:   # only the last stage saw the loss
            local = self.ctx.sum_over("pp", local)
        return self.ctx.mean(local)

    def clip_gradients(self, max_norm: float) -> float:
        """Finish this step's gradients (TP partial sums) and clip them by the global norm."""
        if self.partial_gradients:
            sum_partial_gradients(self.local_model, self.partial_gradients, self.ctx.group("tp"))
        pp_group = self.ctx.group("pp") if self.pipeline is not None else None
        return clip_gradients(self.local_model.parameters(), max_norm, pp_group)


def noisy_latents(inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    """x_t of the model inputs: their first tensor, without the conditioning channels a family may
    append to it (Wan i2v's mask and given frame's latents), which the target does not have."""
    return inputs[0][:, :target.shape[1]]


def parallelize(model: nn.Module, ctx: DistContext, cfg: ParallelConfig, *, memory: MemoryConfig,
                loss_fn: Callable, autocast_dtype: torch.dtype | None = None,
                bucket_batch_sizes: dict[str, int] | None = None,
                base_grid: tuple[int, int, int] | None = None,
                compile: CompileOptions | None = None, fp8: Float8Options | None = None) -> ParallelModel:
    """Apply ``cfg``'s layout and ``memory``'s levers to ``model``.

    ``loss_fn(output, x_t, t, velocity_target)`` is the training loss (the pipeline's last
    stage computes it per micro-batch). With ``parallel.pp > 1``: every bucket's batch size
    (``bucket_batch_sizes``, name -> size) must cut into the micro-batches, and
    ``pp_split=cost`` balances the stages by FLOPs at ``base_grid`` = (latent frames,
    positions per frame, caption tokens) after patching: the data's base bucket. ``compile``:
    compile every block (``parallel/compile.py``); refused combinations fail here, first. ``fp8``:
    float8 matmuls in the blocks' linear layers (``parallel/float8.py``)."""
    dims = ctx.dims
    shapes = len(bucket_batch_sizes or {}) or 1
    if compile is not None:
        dims.check_compile()
    if memory.swap_blocks:   # as init_distributed checks it from the config, for callers without one
        dims.check_block_swap(memory.swap_blocks, blocks=len(model_parts(model)[0][1].blocks),
                              frozen_base=any(not p.requires_grad for p in model.parameters()))
    pipeline, stages = None, [model]
    if dims.pp > 1:
        check_microbatches(bucket_batch_sizes or {}, ctx.pp_microbatches)
        costs = [1.0] * len(model.blocks)
        if cfg.pp_split == "cost" and base_grid is not None:
            costs = block_costs(model.geometry, *base_grid)   # every bucket scales alike
        pipeline, model = build_pipeline(
            model, pp=dims.pp, pp_rank=ctx.rank_in("pp"), schedule=cfg.pp_schedule,
            stages_per_rank=ctx.pp_stages_per_rank, microbatches=ctx.pp_microbatches, costs=costs,
            group=ctx.group("pp"), device=ctx.device, loss_fn=pipeline_loss(model.geometry, loss_fn))
        stages = [pipeline.stages[s] for s in sorted(pipeline.stages)]
    stacks = model_parts(model)
    partial, stats = [], None
    for prefix, part in stacks:   # each expert of a two-expert model gets every layer on its own
        if fp8 is not None:   # before TP, compile and FSDP2, which see the float8 layers
            apply_float8(part, fp8)
        if dims.tp > 1:
            partial += [prefix + name for name in apply_tensor_parallel(part, ctx.meshes["tp"])]
        if dims.sp > 1:
            apply_family_sequence_parallel(part, ctx, cfg)
        chosen = apply_activation_checkpointing(part, memory)
        if compile is not None:   # torchtitan's place: after TP, SP and checkpointing, before FSDP
            stats = apply_compile(part, compile, shapes=shapes * len(stacks), stats=stats)
        apply_saved_tensor_levers(part, memory, chosen)
    swapped: list[str] = []   # the weights block swapping keeps on the host, by name
    if memory.swap_blocks:   # last on the blocks, outside every other wrapper
        for _, part in stacks:
            swapped += swapped_names(model, apply_block_swap(part, memory.swap_blocks, ctx.device))
    module = model
    if dims.data_parallel in ("fsdp", "hsdp"):
        apply_fsdp([part for _, part in stacks], stages, ctx, cfg, param_dtype=autocast_dtype)
    elif dims.data_parallel == "ddp" and any(p.requires_grad for p in model.parameters()):   # a frozen model: none
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # Swapped weights are frozen and identical on every rank; broadcasting them would read them whole.
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, swapped)
        # A two-expert model trains one expert per step, a shared-base run one adapter per
        # backward: the others' parameters get no gradient.
        module = DistributedDataParallel(model, process_group=ctx.group("dp_sp"), device_ids=device_ids,
                                         find_unused_parameters=len(stacks) > 1
                                         or len(adapter_names(lora_layers(model))) > 1)
    return ParallelModel(model, module, loss_fn, ctx, pipeline, autocast_dtype, partial, stats)



def apply_family_sequence_parallel(model: nn.Module, ctx: DistContext, cfg: ParallelConfig) -> None:
    """The family's sequence parallelism: STDiT's frame/position swap (``sequence.py``), or for
    full 3D attention Ulysses x ring over the token sequence (``full_attention.py``; the MMDiT's
    joint [text; image] attention over the image tokens, ``joint_attention.py``), slicing the
    block inputs the family names (``ModelSpec.sequence_args``)."""
    spec = spec_of(model)
    if spec.sequence_parallel == "stdit_frames":
        apply_sequence_parallel(model, ctx.group("sp"))
    elif spec.sequence_parallel == "joint_attention":   # MMDiT: the caption whole, the image sharded
        apply_joint_attention_sp(model.blocks, ctx.meshes["sp"], ring_degree=cfg.sp_ring,
                                 sequence_args=spec.sequence_args)
    else:   # LTX-2: its audio queries, whole on every rank, over the sharded video (whole_query_kinds)
        apply_full_attention_sp(model.blocks, ctx.meshes["sp"], ring_degree=cfg.sp_ring,
                                sequence_args=spec.sequence_args, whole_query_kinds=spec.whole_query_kinds)


def apply_memory_levers(model: nn.Module, cfg: MemoryConfig) -> list[int]:
    """Checkpoint the chosen blocks; offload or compress what the other blocks save for
    backward (a checkpointed block saves only its inputs). Returns the checkpointed indices."""
    chosen = apply_activation_checkpointing(model, cfg)
    apply_saved_tensor_levers(model, cfg, chosen)
    return chosen


def apply_saved_tensor_levers(model: nn.Module, cfg: MemoryConfig, checkpointed: list[int]) -> None:
    """Offload or compress what the blocks that are not checkpointed save for backward; with
    offload, also the token inputs the checkpointed blocks keep (``checkpoint_offload.py``)."""
    if cfg.offload and checkpointed:   # the block inputs that are the previous block's outputs
        apply_checkpoint_input_offload(model, checkpointed, streams=spec_of(model).block_streams)
    if cfg.offload or cfg.compression != "none":
        for i, block in enumerate(model.blocks):
            if i not in checkpointed:
                wrap_saved_tensors(block, offload=cfg.offload, compression=cfg.compression)


def apply_fsdp(parts: list[nn.Module], roots: list[nn.Module], ctx: DistContext, cfg: ParallelConfig, *,
               param_dtype: torch.dtype | None) -> None:
    """FSDP2 on every block of each part (the model, or each expert of a two-expert model),
    then on each expert (its embedders and head: an expert that sits out a step is never
    gathered), then on each root (the model, or each pipeline stage), with the schedule of
    :func:`block_reshards`, :func:`set_block_prefetch` and ``reshard_after_forward=False`` on
    the expert and root units (docs/parallelism.md, "FSDP2 schedule").

    Gradients are reduced in fp32 and the sharded master weights stay fp32; only the
    gathered compute copy is ``param_dtype``. HSDP uses a 2D mesh: replicate x shard.
    """
    mesh = ctx.meshes["hsdp" if ctx.dims.data_parallel == "hsdp" else "dp_shard_sp"]
    options = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
                   offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy(),
                   shard_placement_fn=fsdp_placement)   # fused TP layers: along their inputs
    # FSDP2 warns that the model returns a view (the un-padding slice); nothing writes to it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for part in parts:
        blocks = part.blocks
        for i, block in enumerate(blocks):
            fully_shard(block, reshard_after_forward=block_reshards(cfg, i, len(blocks)), **options)
        if len(parts) > 1:   # the expert's embedders and head, gathered through its backward anyway
            fully_shard(part, reshard_after_forward=False, **options)
        if ctx.dims.pp == 1:   # a pipeline schedule interleaves micro-batches: its own order
            set_block_prefetch(blocks)
    for root in roots:
        # Its head runs last in forward and first in backward, and its unit stays gathered
        # through the whole backward: resharding after forward would only add an all-gather.
        # torch < 2.8 forced this on a root; later versions take the argument as given. A
        # pipeline stage too (as torchtitan): its root holds at most the embedders or the head.
        fully_shard(root, reshard_after_forward=False, **options)


def block_reshards(cfg: ParallelConfig, index: int, count: int) -> bool:
    """``reshard_after_forward`` of block ``index`` of ``count``: as ``parallel.reshard_after_forward``
    says (ZeRO-3 or ZeRO-2-like), except the last block, whose backward starts right after its
    forward: resharding it would free its weights only to gather them again (torchtitan's choice)."""
    return cfg.reshard_after_forward and index < count - 1


def set_block_prefetch(blocks: list[nn.Module]) -> None:
    """Each block's forward starts the all-gather of the next block, and each backward that of
    the previous block, so the weights arrive while a block computes rather than after it.

    Backward is what FSDP2 infers from the forward order anyway, made explicit. In forward
    FSDP2 issues a block's all-gather only when the CPU reaches that block; issued from the
    previous block's start instead, it still overlaps that block's compute when the CPU does
    not run ahead of the GPU (launch-bound small blocks, a host sync). One block ahead keeps
    at most two blocks gathered, as before (the planner's count)."""
    if len(blocks) < 2 or not hasattr(blocks[0], "set_modules_to_forward_prefetch"):   # torch >= 2.6 has it
        return
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])
