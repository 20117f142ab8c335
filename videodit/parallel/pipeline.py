"""Pipeline parallelism for any family's DiT with ``torch.distributed.pipelining``.

The block stack (``model.blocks``) is cut into contiguous stages (evenly by blocks, or
balanced by the family's FLOP model of the blocks). The first stage also runs the input
embedding, the last stage the output layer. A stage is the family's ``pipeline_stage``: the
model restricted to some of its parts, whose submodules keep their names in the whole model,
so the stages' state dicts, optimizer states and DCP shards add up to the model's and a
checkpoint written under one layout loads into any other. What travels between stages is the
family's too (``stage_io`` declares it; STDiT's: ``models/stdit/stage.py``; LTX-2's carries its
audio stream beside the video, ``models/ltx2/stage.py``). With an interleaved schedule a rank holds
several stages; the rank's parameters are then one more stage over the union of its parts
(``local_model``).

The schedule cuts tensors only: a model input that is None reaches the first stage as an empty
[B, 0] tensor (:func:`with_placeholders`), which the family's stage reads as None. And it cuts one
target: the loss's target and any extra per-sample targets it takes (LTX-2's audio target and
mask) travel packed in one [B, N] tensor (:func:`pack_samples`), unpacked per micro-batch on the
last stage.

Micro-batches: each step's batch is cut into ``parallel.pp_microbatches`` equal
micro-batches, so every bucket's batch size must be a multiple of it (checked before
training starts). Bucket shapes change from step to step; the pipeline keeps one set of
stages and one schedule per input shape, each of which infers its inter-stage shapes on
its first step, and reuses them when the shape comes back.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Callable, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from videodit.errors import UserError
from videodit.models.families import spec_of

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


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

    ``loss_fn(output_patches, target, **extra_targets)`` runs on the last stage once per
    micro-batch, with that micro-batch's slices, and returns its mean loss; :meth:`step` scales
    it so that gradients are those of ``scale`` x the batch's mean loss.
    """

    def __init__(self, stages: dict[int, nn.Module], num_stages: int, schedule: str, microbatches: int,
                 group, device: torch.device, loss_fn: Callable):
        self.stages = stages
        self.num_stages = num_stages
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.group = group
        self.device = device
        self.loss_fn = loss_fn
        self.spec = spec_of(next(iter(stages.values())).geometry)
        self.has_first = 0 in stages
        self.has_last = num_stages - 1 in stages
        self._scale = 1.0
        self._layout: list = []   # how this step's targets are packed (pack_samples)
        self._schedules: dict = {}

    def step(self, inputs: tuple[torch.Tensor | None, ...], target: torch.Tensor, scale: float = 1.0,
             extra_targets: dict[str, torch.Tensor] | None = None) -> float:
        """Forward and backward of one batch through the pipeline; returns the batch's mean
        loss times ``scale`` on the rank holding the last stage and 0.0 elsewhere.
        ``extra_targets``: more per-sample tensors the loss takes as keywords."""
        self._scale = scale
        inputs = with_placeholders(inputs)
        key = tuple((tuple(x.shape), x.dtype) for x in inputs)
        if key not in self._schedules:
            self._schedules[key] = self._build_schedule(inputs)
        packed, self._layout = pack_samples({"target": target, **(extra_targets or {})})
        losses: list = []
        args = inputs if self.has_first else ()
        extra = dict(target=packed, losses=losses) if self.has_last else {}
        self._schedules[key].step(*args, **extra)
        return float(sum(loss.detach().float() for loss in losses)) if losses else 0.0

    def _scaled_loss(self, output, packed):
        targets = unpack_samples(packed, self._layout)
        return self.loss_fn(output, targets.pop("target"), **targets) * (self._scale / self.microbatches)

    def _build_schedule(self, inputs: tuple[torch.Tensor, ...]):
        # Shapes are declared, not inferred: inference would run a forward on this rank
        # alone whenever a new shape arrives, and data-parallel peers (which see other
        # buckets) would then disagree on FSDP's collectives.
        stages = [PipelineStage(module, index, self.num_stages, self.device, group=self.group,
                                **self.spec.stage_io(module, inputs, self.microbatches))
                  for index, module in sorted(self.stages.items())]
        cls = SCHEDULES[self.schedule_name]
        options = dict(n_microbatches=self.microbatches, loss_fn=self._scaled_loss)
        if "scale_grads" in inspect.signature(cls.__init__).parameters:
            options["scale_grads"] = False   # _scaled_loss divides by the micro-batch count itself
        return cls(stages if self.schedule_name == "interleaved_1f1b" else stages[0], **options)


def build_pipeline(model: nn.Module, *, pp: int, pp_rank: int, schedule: str, stages_per_rank: int,
                   microbatches: int, costs: Sequence[float], group, device: torch.device,
                   loss_fn: Callable) -> tuple[PipelineSchedule, nn.Module]:
    """Split ``model`` into stages; return this rank's pipeline and ``local_model``, the
    stage module holding every parameter of this rank (what the optimizer, EMA and checkpoints use):
    the family's ``pipeline_stage``.

    Stage s runs on pipeline rank ``s % pp`` (interleaved schedules loop over the ranks).
    """
    runs = stage_blocks(costs, pp, stages_per_rank)
    num_stages = len(runs)
    mine = [s for s in range(num_stages) if s % pp == pp_rank]
    spec = spec_of(model.geometry)
    stages = {s: spec.pipeline_stage(model, runs[s], first=s == 0, last=s == num_stages - 1) for s in mine}
    if len(stages) == 1:
        local = next(iter(stages.values()))
    else:
        local = spec.pipeline_stage(model, [i for s in mine for i in runs[s]], first=0 in stages,
                                    last=num_stages - 1 in stages)
    return PipelineSchedule(stages, num_stages, schedule, microbatches, group, device, loss_fn), local


def with_placeholders(inputs: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor, ...]:
    """The model inputs with each None as an empty [B, 0] tensor: the schedule cuts tensors only."""
    batch = inputs[0].shape[0]
    return tuple(inputs[0].new_empty(batch, 0) if x is None else x for x in inputs)


def pack_samples(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list]:
    """One [B, N] tensor of per-sample tensors (the schedule cuts a single target into
    micro-batches), in the widest of their dtypes so that unpacking restores them exactly, and
    the layout that unpacks it (:func:`unpack_samples`)."""
    dtype = functools.reduce(torch.promote_types, (x.dtype for x in tensors.values()))
    batch = next(iter(tensors.values())).shape[0]
    packed = torch.cat([x.reshape(batch, -1).to(dtype) for x in tensors.values()], dim=1)
    return packed, [(name, x.shape[1:], x.dtype) for name, x in tensors.items()]


def unpack_samples(packed: torch.Tensor, layout: list) -> dict[str, torch.Tensor]:
    """The tensors of :func:`pack_samples` from its [n, N] tensor (one micro-batch's samples)."""
    parts = packed.split([math.prod(shape) for _, shape, _ in layout], dim=1)
    return {name: part.reshape(packed.shape[0], *shape).to(dtype) for (name, shape, dtype), part in zip(layout, parts)}


def pack_target(x_t: torch.Tensor, velocity_target: torch.Tensor, t: torch.Tensor,
                x_mask: torch.Tensor | None = None, frames_per_patch: int = 1) -> torch.Tensor:
    """One tensor the schedule can cut into micro-batches: [B, 3, C, T, H, W] = (x_t, velocity
    target, t broadcast), with frame conditioning [B, 4, ...]: the mask of the latent frames too."""
    planes = [x_t, velocity_target.to(x_t.dtype), t.to(x_t.dtype).view(-1, 1, 1, 1, 1).expand_as(x_t)]
    if x_mask is not None:
        frames = x_mask.repeat_interleave(frames_per_patch, dim=1)[:, :x_t.shape[2]]
        planes.append(frames.to(x_t.dtype)[:, None, :, None, None].expand_as(x_t))
    return torch.stack(planes, 1)


def pipeline_loss(geometry, loss_fn: Callable) -> Callable:
    """The last stage's loss: its output back to the model's (the family's ``stage_latents``), then
    ``loss_fn(output, x_t, t, velocity_target[, x_mask], **extra_targets)`` against the packed
    target (:func:`pack_target`)."""
    spec = spec_of(geometry)
    frames_per_patch = spec.patch_size(geometry)[0]

    def stage_loss(output, target: torch.Tensor, **extra_targets) -> torch.Tensor:
        x_t, v_target, t, *frames = target.unbind(1)
        # The patched frames' mask back from the latent frames' plane: each patch's first frame.
        x_mask = [frames[0][:, 0, ::frames_per_patch, 0, 0] > 0.5] if frames else []
        return loss_fn(spec.stage_latents(output, x_t.shape, geometry), x_t, t.flatten(1)[:, 0], v_target, *x_mask,
                       **extra_targets)
    return stage_loss
