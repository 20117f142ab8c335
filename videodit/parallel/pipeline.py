"""Pipeline parallelism for the spatial-temporal DiT with ``torch.distributed.pipelining``.

The block stack is cut into contiguous stages (evenly by blocks, or balanced by a FLOP
model of the blocks). The first stage also runs the input embedding, the last stage the
output layer. Between stages travel five tensors: the token grid, the embedded caption,
its mask, the adaLN input ``t_mod`` and ``cond``; gradients flow back through all but the
mask, so the embedders on stage 0 learn from every block. With frame conditioning
(``diffusion.mask_ratios``) a sixth travels, the frame mask ``x_mask``: ``t_mod`` and ``cond``
are then per frame, and the last stage's output layer and loss need the mask too.

A :class:`DiTStage` is an STDiT restricted to some of its parts. Its submodules keep
their names in the whole model, so the stages' state dicts, optimizer states and DCP
shards add up to the model's, and a checkpoint written under one layout loads into any
other. With an interleaved schedule a rank holds several stages; the rank's parameters
are then one more DiTStage over the union of its parts (``local_model``).

Micro-batches: each step's batch is cut into ``parallel.pp_microbatches`` equal
micro-batches, so every bucket's batch size must be a multiple of it (checked before
training starts). Bucket shapes change from step to step; the pipeline keeps one set of
stages and one schedule per input shape, each of which infers its inter-stage shapes on
its first step, and reuses them when the shape comes back.
"""

from __future__ import annotations

import inspect
from typing import Callable, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from videodit.errors import UserError
from videodit.models.stdit import DiTGeometry, STDiT, unpatchify

X_MASK = 8   # model inputs: (x, t, y, y_mask, fps, drop_caption, height, width[, x_mask])

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


class DiTStage(STDiT):
    """Part of an STDiT: optionally the embedding, a run of blocks, optionally the output layer."""

    EMBEDDING = ("patch_embed", "t_embedder", "fps_embedder", "t_block", "caption_embedder", "caption_pool")

    def __init__(self, model: STDiT, block_ids: Sequence[int], *, first: bool, last: bool):
        nn.Module.__init__(self)   # not STDiT.__init__: the parts come from ``model``
        self.geometry = model.geometry
        self.first, self.last = first, last
        self.rope = model.rope     # no parameters
        if first:
            for name in self.EMBEDDING:
                setattr(self, name, getattr(model, name))
        all_blocks = model.blocks  # execution order: spatial 0, temporal 0, spatial 1, ...
        self.spatial_blocks = nn.ModuleDict({str(i // 2): all_blocks[i] for i in block_ids if i % 2 == 0})
        self.temporal_blocks = nn.ModuleDict({str(i // 2): all_blocks[i] for i in block_ids if i % 2 == 1})
        self._order = sorted(block_ids)
        if last:
            self.final_layer = model.final_layer

    @property
    def blocks(self) -> list[nn.Module]:
        return [(self.temporal_blocks if i % 2 else self.spatial_blocks)[str(i // 2)] for i in self._order]

    def forward(self, *args):
        """First stage: the model's inputs (x, t, y, y_mask, fps, drop_caption, height, width[, x_mask]).
        Other stages: the previous stage's outputs. Returns the inter-stage tensors, or on the last
        stage the output patches [B, T', S, patch values] (``unpatchify`` makes latents)."""
        if self.first:
            x_mask = args[X_MASK] if len(args) > X_MASK else None
            tokens, y, y_mask, t_mod, cond = self.embed(*args)
        else:
            tokens, y, y_mask, t_mod, cond, *rest = args
            x_mask = rest[0] if rest else None
        rope = self.rope(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            tokens = block(tokens, y, y_mask, t_mod, rope)
        if self.last:
            return self.final_layer(tokens, cond, x_mask).float()
        # Sent dense and in fp32 whatever the autocast, as ``stage_io`` declares them.
        sent = (tokens, y, y_mask, t_mod, cond) + (() if x_mask is None else (x_mask,))
        return tuple(x.float().contiguous() if x.is_floating_point() else x.contiguous() for x in sent)


# ---------------------------------------------------------------------- splitting

def balanced_split(costs: Sequence[float], parts: int) -> list[range]:
    """Cut ``costs`` into ``parts`` contiguous non-empty runs minimising the largest run's sum."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible maximum when the first i items form k runs.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(parts, 0, -1):
        bounds.append(range(cut[k][i], i))
        i = cut[k][i]
    return bounds[::-1]


def stage_blocks(costs: Sequence[float], pp: int, stages_per_rank: int) -> list[range]:
    stages = pp * stages_per_rank
    if stages > len(costs):
        raise UserError(f"parallel.pp={pp} x {stages_per_rank} stage(s) per rank needs {stages} blocks but the model "
                        f"has {len(costs)}; lower parallel.pp or parallel.pp_stages_per_rank")
    return balanced_split(costs, stages)


# ---------------------------------------------------------------------- the schedule

def check_microbatches(batch_sizes: dict[str, int], microbatches: int) -> None:
    """Every bucket's batch must cut into equal micro-batches."""
    bad = {name: size for name, size in batch_sizes.items() if size % microbatches}
    if bad:
        shown = ", ".join(f"{name}: {size}" for name, size in list(bad.items())[:4])
        raise UserError(f"pipeline parallelism cuts each batch into parallel.pp_microbatches={microbatches} equal "
                        f"micro-batches, but these buckets' batch sizes do not divide: {shown}; make every batch "
                        f"size a multiple of {microbatches} or change parallel.pp_microbatches")


class PipelineSchedule:
    """This rank's stages and one schedule per input shape.

    ``loss_fn(output_patches, target)`` runs on the last stage once per micro-batch and
    returns that micro-batch's mean loss; :meth:`step` scales it so that gradients are
    those of ``scale`` x the batch's mean loss.
    """

    def __init__(self, stages: dict[int, DiTStage], num_stages: int, schedule: str, microbatches: int,
                 group, device: torch.device, loss_fn: Callable):
        self.stages = stages
        self.num_stages = num_stages
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.group = group
        self.device = device
        self.loss_fn = loss_fn
        self.has_first = 0 in stages
        self.has_last = num_stages - 1 in stages
        self._scale = 1.0
        self._schedules: dict = {}

    def step(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, scale: float = 1.0) -> float:
        """Forward and backward of one batch through the pipeline; returns the batch's mean
        loss times ``scale`` on the rank holding the last stage and 0.0 elsewhere."""
        self._scale = scale
        key = tuple((tuple(x.shape), x.dtype) for x in inputs)
        if key not in self._schedules:
            self._schedules[key] = self._build_schedule(inputs)
        losses: list = []
        args = inputs if self.has_first else ()
        extra = dict(target=target, losses=losses) if self.has_last else {}
        self._schedules[key].step(*args, **extra)
        return float(sum(loss.detach().float() for loss in losses)) if losses else 0.0

    def _scaled_loss(self, output, target):
        return self.loss_fn(output, target) * (self._scale / self.microbatches)

    def _build_schedule(self, inputs: tuple[torch.Tensor, ...]):
        # Shapes are declared, not inferred: inference would run a forward on this rank
        # alone whenever a new shape arrives, and data-parallel peers (which see other
        # buckets) would then disagree on FSDP's collectives.
        stages = [PipelineStage(module, index, self.num_stages, self.device, group=self.group,
                                **stage_io(module, inputs, self.microbatches))
                  for index, module in sorted(self.stages.items())]
        cls = SCHEDULES[self.schedule_name]
        options = dict(n_microbatches=self.microbatches, loss_fn=self._scaled_loss)
        if "scale_grads" in inspect.signature(cls.__init__).parameters:
            options["scale_grads"] = False   # _scaled_loss divides by the micro-batch count itself
        return cls(stages if self.schedule_name == "interleaved_1f1b" else stages[0], **options)


def stage_io(stage: DiTStage, inputs: tuple[torch.Tensor, ...], microbatches: int) -> dict:
    """Meta tensors of one micro-batch's stage inputs and outputs, from the model inputs
    (x, t, y, y_mask, fps, drop_caption, height, width[, x_mask]) of the whole batch."""
    x, _, y = inputs[:3]
    g = stage.geometry
    n = x.shape[0] // microbatches
    pt, ph, pw = g.patch_size
    frames, height, width = x.shape[-3:]
    grid = (-(-frames // pt), -(-height // ph) * -(-width // pw))
    d, length = g.hidden_size, y.shape[1]

    def meta(*shape, dtype=torch.float32):   # float tensors carry gradients between stages
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

    if len(inputs) > X_MASK:   # frame conditioning: adaLN per frame, the mask travels along
        between = (meta(n, *grid, d), meta(n, length, d), meta(n, length, dtype=torch.bool),
                   meta(n, grid[0], 6, d), meta(n, 2, d), meta(n, grid[0], dtype=torch.bool))
    else:
        between = (meta(n, *grid, d), meta(n, length, d), meta(n, length, dtype=torch.bool), meta(n, 6, d),
                   meta(n, d))
    root = tuple(torch.empty(n, *t.shape[1:], dtype=t.dtype, device="meta") for t in inputs)
    output = meta(n, *grid, g.in_channels * pt * ph * pw) if stage.last else between
    return dict(input_args=root if stage.first else between, output_args=output)


def build_pipeline(model: STDiT, *, pp: int, pp_rank: int, schedule: str, stages_per_rank: int,
                   microbatches: int, costs: Sequence[float], group, device: torch.device,
                   loss_fn: Callable) -> tuple[PipelineSchedule, DiTStage]:
    """Split ``model`` into stages; return this rank's pipeline and ``local_model``, the
    DiTStage holding every parameter of this rank (what the optimizer, EMA and checkpoints use).

    Stage s runs on pipeline rank ``s % pp`` (interleaved schedules loop over the ranks).
    """
    runs = stage_blocks(costs, pp, stages_per_rank)
    num_stages = len(runs)
    mine = [s for s in range(num_stages) if s % pp == pp_rank]
    stages = {s: DiTStage(model, runs[s], first=s == 0, last=s == num_stages - 1) for s in mine}
    if len(stages) == 1:
        local = next(iter(stages.values()))
    else:
        local = DiTStage(model, [i for s in mine for i in runs[s]], first=0 in stages, last=num_stages - 1 in stages)
    return PipelineSchedule(stages, num_stages, schedule, microbatches, group, device, loss_fn), local


def pack_target(x_t: torch.Tensor, velocity_target: torch.Tensor, t: torch.Tensor,
                x_mask: torch.Tensor | None = None, frames_per_patch: int = 1) -> torch.Tensor:
    """One tensor the schedule can cut into micro-batches: [B, 3, C, T, H, W] = (x_t, velocity
    target, t broadcast), with frame conditioning [B, 4, ...]: the mask of the latent frames too."""
    planes = [x_t, velocity_target.to(x_t.dtype), t.to(x_t.dtype).view(-1, 1, 1, 1, 1).expand_as(x_t)]
    if x_mask is not None:
        frames = x_mask.repeat_interleave(frames_per_patch, dim=1)[:, :x_t.shape[2]]
        planes.append(frames.to(x_t.dtype)[:, None, :, None, None].expand_as(x_t))
    return torch.stack(planes, 1)


def pipeline_loss(geometry: DiTGeometry, loss_fn: Callable) -> Callable:
    """The last stage's loss: output patches -> latents, then ``loss_fn(output, x_t, t,
    velocity_target[, x_mask])`` against the packed target (:func:`pack_target`)."""
    def stage_loss(patches: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x_t, v_target, t, *frames = target.unbind(1)
        # The patched frames' mask back from the latent frames' plane: each patch's first frame.
        x_mask = [frames[0][:, 0, ::geometry.patch_size[0], 0, 0] > 0.5] if frames else []
        return loss_fn(unpatchify(patches, x_t.shape, geometry), x_t, t.flatten(1)[:, 0], v_target, *x_mask)
    return stage_loss
