"""Predict one GPU's training memory for one micro-batch shape, without running anything.

The model (derived in ``docs/memory.md``, checked against :mod:`videodit.planner.measure`):

* **Model state** from the exact parameter count (the model is built on the meta device):
  fp32 weights and the fp32 EMA of every parameter, fp32 gradients and AdamW's two fp32 moments
  of the trained ones (what ``ModelSpec.configure`` leaves trainable: LTX-2's audio stream is
  frozen without ``model.train_audio``), each divided by
  the ranks that share it: pipeline stages and tensor-parallel ranks split the blocks,
  FSDP shards everything over ``dp_shard x sp`` ranks. DDP's reducer keeps its own fp32 copy of
  the gradients (its buckets) beside ``.grad``: one more gradient's worth.
* **Activations**: what every transformer block keeps for backward, per token, from a
  table of the tensors autograd saves, which the model family gives
  (``ModelSpec.activation_profile``), plus the embedding, final layer and loss (its table too). Sequence parallelism divides the tokens, tensor parallelism the heads
  and the MLP width; checkpointing, compression and offload change what a block keeps.
* **Temporaries**: the largest transient of backward (one block's activation gradients,
  one recomputed block under checkpointing), the weights FSDP gathers for the blocks in
  flight, and autocast's low-precision weight copies when nothing shards.
* **Frozen encoders**: their weight bytes, unless features are cached.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from videodit.config import Config, MemoryConfig
from videodit.models.families import spec_of
from videodit.models.spec import ActivationDims, Saved
from videodit.models.lowmem import CHECKPOINT_INPUTS_IN_FLIGHT
from videodit.planner.levers import (LeverCounts, Levers, float8_operand_bytes, optimizer_bytes_per_param,
                                     swapped_resident_saving)

FP32 = 4

# What autograd keeps comes from the model's family: ``spec_of(geometry).activation_profile``, a
# table of :class:`Saved` entries per block and outside the blocks (``models/<family>/activations.py``).


@dataclass(frozen=True)
class Parallel:
    sp: int = 1
    tp: int = 1
    pp: int = 1
    shard: int = 1           # FSDP shard group (dp_shard x sp); 1 = replicated (DDP / one GPU)
    microbatches: int = 1    # pipeline micro-batches per batch
    in_flight: int = 1       # micro-batches whose activations the first stage holds at once
    cpu_offload: bool = False
    reshard: bool = True     # FSDP frees gathered weights after forward (False: ZeRO-2-like)
    ddp: bool = False        # DDP replicates: its reducer holds a second fp32 copy of the gradients


@dataclass(frozen=True)
class Precision:
    bf16: bool = False

    @property
    def low_bytes(self) -> int:
        return 2 if self.bf16 else FP32


@dataclass(frozen=True)
class Lora:
    """LoRA (``lora.rank > 0``): the base is frozen and held in the compute dtype (bf16 under
    bf16 autocast), the adapters train in fp32. Counts are the whole model's."""
    rank: int
    block_params: int                  # adapter parameters in all blocks
    other_params: int                  # adapter parameters outside the blocks
    block_layers: tuple[str, ...]      # adapted layers inside a block (attn.q, mlp.fc1, ...)
    block_inputs: int = 0              # sum of the in_features of the adapted layers of one block
    block_outputs: int = 0             # ... of their out_features (on video tokens)
    caption_outputs: int = 0           # ... of the adapted layers on caption tokens (cross k, v)
    dropout: float = 0.0

    @property
    def params(self) -> int:
        return self.block_params + self.other_params


def count_lora(cfg, geometry, model: nn.Module | None = None) -> Lora | None:
    """The adapters ``cfg`` (a LoraConfig) adds to ``geometry``'s model (None when off)."""
    from videodit.models.lora import target_shapes
    if not cfg.rank:
        return None
    if model is None:
        with torch.device("meta"):
            model = spec_of(geometry).build(geometry)
    shapes = target_shapes(model, cfg)
    caption_layers = spec_of(geometry).activation_profile(geometry).caption_layers
    first = next(name for name, module in model.named_modules() if module is model.blocks[0]) + "."
    block = {path[len(first):]: shape for path, shape in shapes.items() if path.startswith(first)}
    in_blocks = sum(cfg.rank * (i + o) for path, (i, o) in shapes.items() if path.split(".")[0].endswith("blocks"))
    return Lora(cfg.rank, in_blocks, sum(cfg.rank * (i + o) for i, o in shapes.values()) - in_blocks,
                tuple(sorted(block)), sum(i for i, _ in block.values()),
                sum(o for path, (_, o) in block.items() if path not in caption_layers),
                sum(o for path, (_, o) in block.items() if path in caption_layers), cfg.dropout)


@dataclass
class ModelCounts:
    num_params: int
    block_params: int        # all transformer blocks together
    depth_blocks: int        # spatial + temporal blocks
    kinds: tuple[str, ...] = ()   # each block's kind (the MMDiT: double, single), in order
    # What the run trains of them (``ModelSpec.configure``: LTX-2's audio stream is frozen unless
    # ``model.train_audio``): gradients, optimizer state, DDP buckets; None: every parameter.
    trained_params: int | None = None
    trained_block_params: int | None = None

    @property
    def other_params(self) -> int:
        return self.num_params - self.block_params

    @property
    def trained(self) -> tuple[int, int]:
        """(trained parameters in the blocks, outside them)."""
        blocks = self.block_params if self.trained_block_params is None else self.trained_block_params
        total = self.num_params if self.trained_params is None else self.trained_params
        return blocks, total - blocks


def count_model(geometry, model: nn.Module | None = None) -> ModelCounts:
    """Exact parameter counts, from the model built on the meta device (no memory, no time); the
    trained ones are those that require gradients (after ``ModelSpec.configure``, if applied)."""
    if model is None:
        with torch.device("meta"):
            model = spec_of(geometry).build(geometry)
    blocks = sum(p.numel() for b in model.blocks for p in b.parameters())
    spec = spec_of(geometry)
    return ModelCounts(sum(p.numel() for p in model.parameters()), blocks, len(model.blocks),
                       tuple(spec.block_kind(b) for b in model.blocks),
                       sum(p.numel() for p in model.parameters() if p.requires_grad),
                       sum(p.numel() for b in model.blocks for p in b.parameters() if p.requires_grad))


@dataclass
class Shape:
    """One micro-batch on one GPU, in latent space; ``audio_tokens``: per sample, of a model that
    trains its audio stream too (LTX-2's ``model.train_audio``), 0 without."""
    batch: int
    latent_frames: int
    latent_height: int
    latent_width: int
    latent_channels: int
    caption_length: int
    audio_tokens: int = 0

    def tokens(self, geometry) -> int:
        """Tokens per sample: T' x H' x W' after patching (padded up, as the model pads)."""
        return spec_of(geometry).tokens(geometry, self.latent_frames, self.latent_height, self.latent_width)

    @property
    def latent_elements(self) -> int:
        return self.batch * self.latent_channels * self.latent_frames * self.latent_height * self.latent_width


@dataclass
class Estimate:
    """Bytes per GPU by category; ``peak`` is their sum. A DMD2 run (``planner/distill.py``) adds
    its critic's and teacher's terms; ``lines`` names every term."""
    params: int
    grads: int
    optimizer: int
    ema: int
    activations: int
    temporaries: int
    encoders: int
    detail: dict = field(default_factory=dict)
    ddp_buckets: int = 0         # DDP's gradient buckets (the reducer's flat fp32 copy of the gradients)
    critic_params: int = 0       # DMD2: the critic's fp32 weights (shared-base LoRA: its adapter's)
    critic_grads: int = 0        # ... its gradients beyond the student's (they never coexist: 0)
    critic_optimizer: int = 0    # ... its AdamW state
    critic_ddp_buckets: int = 0  # ... its DDP gradient buckets
    teacher: int = 0             # DMD2: the frozen teacher's weights (0 on a shared base)
    passes: int = 0              # DMD2: the teacher's and critic's passes beyond the student's graded one

    ROLE_FIELDS = ("ddp_buckets", "critic_params", "critic_grads", "critic_optimizer", "critic_ddp_buckets",
                   "teacher", "passes")

    @property
    def peak(self) -> int:
        return (self.params + self.grads + self.optimizer + self.ema + self.activations + self.temporaries
                + self.encoders + sum(getattr(self, name) for name in self.ROLE_FIELDS))

    @property
    def distilled(self) -> bool:
        return bool(self.detail.get("distill"))

    def lines(self) -> list[tuple[str, int]]:
        """Every term of ``peak``, named (a DMD2 run's by role); they add up to ``peak``."""
        student = "student " if self.distilled else ""
        rows = [(f"{student}weights", self.params), (f"{student}grads", self.grads),
                (f"{student}optimizer", self.optimizer), (f"{student}EMA", self.ema)]
        if self.ddp_buckets or self.critic_ddp_buckets:
            rows.append((f"{student}DDP gradient buckets", self.ddp_buckets))
        critic = self.detail.get("distill") == "dmd2"   # trajectory distillation has none
        if critic:
            rows += [("critic weights", self.critic_params),
                     ("critic grads (made after the student's are freed: counted there)", self.critic_grads),
                     ("critic optimizer", self.critic_optimizer)]
            if self.ddp_buckets or self.critic_ddp_buckets:
                rows.append(("critic DDP gradient buckets", self.critic_ddp_buckets))
        if self.distilled:
            rows.append(("teacher: the student's base, adapters off (counted there)" if self.detail.get("shared_base")
                         else "teacher weights (frozen)", self.teacher))
        rows += [("activations" + (" (the graded pass: student's or critic's)" if critic else ""),
                  self.activations), ("transients" + (" (of the graded pass)" if self.distilled else ""),
                                      self.temporaries)]
        if critic:
            rows.append(("teacher and critic no-grad passes beyond those", self.passes))
        rows.append(("frozen encoders", self.encoders))
        return rows

    def as_dict(self) -> dict:
        out = {"params": self.params, "grads": self.grads, "optimizer": self.optimizer, "ema": self.ema,
               "activations": self.activations, "temporaries": self.temporaries, "encoders": self.encoders}
        out.update({name: getattr(self, name) for name in self.ROLE_FIELDS if getattr(self, name)})
        return {**out, "peak": self.peak}


# --------------------------------------------------------------------------- activations


def stream_counts(tokens: int, batch: int, caption_length: int, audio_tokens: int = 0,
                  latent: int = 0) -> dict[str, int]:
    """How many of each thing a :class:`Saved` entry is ``on``: the video ``tokens`` given (a rank's
    or the whole grid's), caption tokens, latent elements; with an audio stream (``audio_tokens``
    of the micro-batch, whole on every rank) its tokens, its text (as long as the video's) and the
    video tokens its cross-modal attentions read (``av_tokens``), all 0 without one."""
    audio = audio_tokens > 0
    return {"tokens": tokens, "caption": batch * caption_length, "latent": latent, "audio": audio_tokens,
            "audio_caption": batch * caption_length if audio else 0, "av_tokens": tokens if audio else 0}


def saved_bytes(entries: tuple[Saved, ...], dims: ActivationDims, counts: dict[str, float], parallel: Parallel,
                precision: Precision, mode: str = "none", adapted: set[str] | None = None) -> float:
    """Bytes of a family's :class:`Saved` entries: ``counts`` gives how many tokens, caption tokens
    and latent elements there are; ``adapted``: LoRA's adapted layers (None: no LoRA)."""
    widths = {"D": dims.hidden_size, "M": dims.mlp_hidden, "C": dims.caption_channels, "H": dims.num_heads, "1": 1}
    total = 0.0
    for saved in entries:
        if mode == "selective":
            units = saved.selective_units if saved.selective_units is not None else \
                (saved.units if saved.selective else 0)
        else:
            if adapted is not None and mode == "none" and saved.needed_by and not adapted & set(saved.needed_by):
                continue   # kept for a frozen weight's gradient only (selective keeps matmul outputs regardless)
            units = saved.autocast_units if precision.bf16 and saved.autocast_units is not None else saved.units
        if not units:
            continue
        width = widths[saved.per] / (parallel.tp if saved.tp else 1)
        total += units * counts[saved.on] * width * (precision.low_bytes if saved.low else FP32)
    return total


def block_activation_bytes(geometry, tokens: int, batch: int, caption_length: int,
                           parallel: Parallel, precision: Precision, mode: str = "none",
                           compression: str = "none", lora: Lora | None = None, kind: str | None = None,
                           audio_tokens: int = 0) -> float:
    """Bytes one block keeps for backward, for ``tokens`` tokens on this rank (and ``audio_tokens``
    of the micro-batch's audio stream: :func:`stream_counts`).

    ``mode`` is the block's checkpointing: ``none`` keeps the family's block table, ``full`` only
    the block input, ``selective`` the matmul and attention outputs. ``lora``: the frozen base
    keeps no input for its own weights' gradients (``needed_by``), the adapters keep their
    rank-wide intermediate (and with dropout, their dropped-out input and its mask). ``kind``:
    the block's kind (the family's table for it); None: the table of the average block.
    """
    spec = spec_of(geometry)
    dims = spec.activation_dims(geometry)
    profile = spec.activation_profile(geometry) if kind is None else spec.kind_activation_profile(geometry, kind)
    if mode == "full":
        return block_input_bytes(geometry, tokens, batch * caption_length, profile, precision, audio_tokens)
    total = 0.0
    adapted = None
    if lora is not None:
        adapted = set(lora.block_layers)
        video = [layer for layer in lora.block_layers if layer not in profile.caption_layers]
        total += lora.rank * (tokens * len(video) + batch * caption_length * (len(adapted) - len(video))) \
            * precision.low_bytes
        if lora.dropout > 0 and mode == "none":
            total += tokens * lora.block_inputs * (precision.low_bytes + 1)
        if mode == "selective":   # it keeps every matmul output: the adapters' full-width ones too
            total += (tokens * lora.block_outputs + batch * caption_length * lora.caption_outputs) \
                * precision.low_bytes
    counts = stream_counts(tokens, batch, caption_length, audio_tokens)
    total += saved_bytes(profile.block, dims, counts, parallel, precision, mode, adapted)
    if mode == "none" and compression != "none":
        total *= {"bf16": 0.5 if not precision.bf16 else 1.0, "fp8": 0.25 if not precision.bf16 else 0.5}[compression]
    return total


def block_input_bytes(geometry, tokens: int, caption_tokens: int, profile,
                      precision: Precision = Precision(), audio_tokens: int = 0) -> float:
    """What a fully checkpointed block keeps: its input, the rank's video tokens and, where the
    caption is a stream through the blocks (the MMDiT's text, whole on every SP rank), the
    caption tokens too, D-wide: fp32, or the compute dtype where the family's residual stream is
    (``profile.residual_low``); and a second stream's tokens (LTX-2's audio: the profile's
    ``stream_inputs``, of a family whose profile has them)."""
    dims = spec_of(geometry).activation_dims(geometry)
    width = precision.low_bytes if profile.residual_low else FP32
    streams = getattr(profile, "stream_inputs", ())
    others = saved_bytes(streams, dims, stream_counts(0, 0, 0, audio_tokens), Parallel(), precision) \
        if streams and audio_tokens else 0.0
    return (tokens + (caption_tokens if profile.caption_stream else 0)) * dims.hidden_size * width + others


def activation_bytes(geometry, shape: Shape, parallel: Parallel, precision: Precision,
                     memory: MemoryConfig, num_blocks: int, lora: Lora | None = None,
                     kinds: tuple[str, ...] = ()) -> tuple[int, dict]:
    """Everything forward keeps until backward, on the rank with the most of it. ``kinds``: each
    block's kind (``memory.checkpoint_blocks`` counts per kind, and kinds keep different amounts);
    empty: every block the average one."""
    if parallel.pp > 1:   # one micro-batch at a time, several in flight
        shape = dataclasses.replace(shape, batch=max(1, shape.batch // parallel.microbatches))
    tokens = shape.batch * shape.tokens(geometry) // parallel.sp
    audio = shape.batch * shape.audio_tokens   # whole on every SP rank
    blocks_here = math.ceil(num_blocks / parallel.pp)
    # The first pipeline stage holds the most: its blocks, numbered 0 .. blocks_here-1. Under PP
    # each rank chooses among its own blocks (parallelize() checkpoints the stage module), so
    # checkpoint_every / checkpoint_fraction / checkpoint_blocks count per rank, not over the model.
    kinds_here = tuple(kinds[:blocks_here]) if len(kinds) >= blocks_here else (None,) * blocks_here
    checkpointed = set(memory.checkpointed_blocks(blocks_here, list(kinds_here)
                                                  if memory.checkpoint_blocks is not None else None))
    args = (geometry, tokens, shape.batch, shape.caption_length, parallel, precision)
    per_kind = {kind: {mode: block_activation_bytes(*args, mode=mode, compression=memory.compression, lora=lora,
                                                    kind=kind, audio_tokens=audio)
                       for mode in ("none", "full", "selective")}
                for kind in dict.fromkeys(kinds_here)}
    modes = [memory.checkpointing if i in checkpointed else "none" for i in range(blocks_here)]
    kept = [per_kind[kind][mode] for kind, mode in zip(kinds_here, modes)]
    kept_blocks = sum(kept)
    if lora is not None and modes and modes[0] == "none":   # LoRA: the first block's input needs no gradient
        profile = spec_of(geometry).activation_profile(geometry)
        kept_blocks -= block_input_bytes(geometry, tokens, shape.batch * shape.caption_length, profile, precision,
                                         audio)
    offloaded = 0.0
    if memory.offload:
        # Offloaded blocks keep nothing on the GPU once their copies finish; count one in flight.
        plain = [bytes_ for bytes_, mode in zip(kept, modes) if mode == "none"]
        offloaded = sum(plain) - max(plain, default=0.0)
        # A checkpointed block's input (what full checkpointing keeps) goes to the host too,
        # back one block ahead of its recompute: two on the GPU (parallel/checkpoint_offload.py).
        inputs = [per_kind[kind]["full"] for kind, mode in zip(kinds_here, modes) if mode != "none"]
        offloaded += sum(sorted(inputs)[:max(0, len(inputs) - CHECKPOINT_INPUTS_IN_FLIGHT)])
        kept_blocks -= offloaded
    # Outside the blocks, on the whole token grid even under SP (the grid is split before the
    # first block and gathered after the last): the final layer's norm and modulation (2 D per
    # token), the gathered block output under SP, and about five latent-sized tensors (input,
    # patch output, unpatchified output, velocity, error).
    # The family's ``outside`` table lists them (LoRA: a frozen output layer keeps neither its
    # norm's output nor its projection's input).
    spec = spec_of(geometry)
    dims, profile = spec.activation_dims(geometry), spec.activation_profile(geometry)
    all_tokens = shape.batch * shape.tokens(geometry)
    gathered = (profile.sp_gathered * all_tokens + profile.sp_local * tokens) * dims.hidden_size * FP32 \
        if parallel.sp > 1 else 0
    counts = stream_counts(all_tokens, shape.batch, shape.caption_length, audio, shape.latent_elements)
    outside = saved_bytes(profile.outside, dims, counts, dataclasses.replace(parallel, tp=1),
                          precision, adapted=None if lora is None else set(lora.block_layers)) + gathered
    if any(mode != "none" for mode in modes):   # the inputs every checkpointed block holds, once
        outside += saved_bytes(profile.checkpoint_inputs, dims,
                               stream_counts(tokens, shape.batch, shape.caption_length, audio), parallel, precision)
    in_flight = parallel.in_flight if parallel.pp > 1 else 1
    total = int((kept_blocks + outside) * in_flight)
    # Per block: the largest kind's (the recomputed block and backward's gradients are one block's).
    per_block = {mode: max(bytes_[mode] for bytes_ in per_kind.values()) for mode in ("none", "full", "selective")}
    return total, {"per_block_plain": int(per_block["none"]), "per_block_full": int(per_block["full"]),
                   "per_block_selective": int(per_block["selective"]), "blocks_on_rank": blocks_here,
                   "checkpointed_blocks": sum(1 for mode in modes if mode != "none"),
                   "offloaded_bytes": int(offloaded * in_flight), "tokens_per_rank": tokens,
                   "audio_tokens": shape.audio_tokens}   # a sample's


# --------------------------------------------------------------------------- the whole GPU


def local_params(counts: ModelCounts, parallel: Parallel, trained: bool = False) -> float:
    """Parameters on one rank (``trained``: the trained ones): blocks split over stages and TP
    ranks, then FSDP shards."""
    blocks, other = counts.trained if trained else (counts.block_params, counts.other_params)
    return (blocks / parallel.pp / parallel.tp + other) / parallel.shard


def estimate(geometry, shape: Shape, *, parallel: Parallel = Parallel(),
             precision: Precision = Precision(), memory: MemoryConfig = MemoryConfig(),
             ema: bool = True, encoder_bytes: int = 0, counts: ModelCounts | None = None,
             lora: Lora | None = None, experts: int = 1, levers: Levers = Levers(),
             lever_counts: LeverCounts | None = None) -> Estimate:
    """Bytes per GPU of one training step. ``experts``: whole models held, one of them trained
    per step (2 for both experts of Wan 2.2 A14B, ``model.expert=both``): each holds its weights,
    optimizer state and EMA; gradients and activations are the step's expert's alone.
    ``levers``: fp8 base, 8-bit moments, block swapping, fp8 compute (``planner/levers.py``),
    counted on ``lever_counts`` (of the model on the meta device)."""
    counts = counts or count_model(geometry)
    n_local = local_params(counts, parallel)
    on_gpu = 0.0 if parallel.cpu_offload else 1.0
    # LoRA: the base in the compute dtype (fp8 block weights with lora.base_dtype=fp8) without
    # gradients or optimizer state; the adapters in fp32 with both (not split by TP: an upper
    # bound, they are ~1-2% of the model).
    adapters = 0.0 if lora is None else (lora.block_params / parallel.pp + lora.other_params) / parallel.shard
    trained = local_params(counts, parallel, trained=True) if lora is None else adapters
    fp32_weights = n_local if lora is None else adapters   # a frozen part of a full fine-tune stays fp32 too
    split = parallel.pp * parallel.tp * parallel.shard   # how the block weights are divided
    base = 0.0 if lora is None else n_local * precision.low_bytes
    block_base = counts.block_params / counts.depth_blocks * precision.low_bytes   # one block's frozen weights
    if lora is not None and levers.fp8_base and lever_counts is not None:
        fp8 = lever_counts.fp8_base_bytes(precision.bf16)
        base += (fp8 - lever_counts.fp8_base_params * precision.low_bytes) / split
        block_base += (fp8 - lever_counts.fp8_base_params * precision.low_bytes) / counts.depth_blocks
    if lora is not None:   # block swapping moves frozen weights only (parallel/block_swap.py)
        base -= swapped_resident_saving(levers, math.ceil(counts.depth_blocks / parallel.pp), block_base)
    params = int((fp32_weights * FP32 + base) * on_gpu) * experts
    grads = int(trained * FP32 * on_gpu)
    optimizer = int(trained * optimizer_bytes_per_param(levers.optimizer) * on_gpu) * experts
    # The EMA shadows every parameter but a LoRA base's (train/ema.py), frozen ones included.
    ema_bytes = int(fp32_weights * FP32 * on_gpu) * experts if ema else 0
    ddp_buckets = grads * experts if parallel.ddp else 0   # every trained parameter's, both experts' too

    activations, detail = activation_bytes(geometry, shape, parallel, precision, memory, counts.depth_blocks, lora,
                                           counts.kinds)
    converted = lever_counts.fp8_compute_params / counts.depth_blocks / parallel.tp \
        if levers.fp8_compute and lever_counts is not None else 0.0   # one block's float8 weights

    # Temporaries of backward: the activation gradients flowing through one block (taken as
    # half a plain block; on CPU activations plus this came out 1.02-1.3x the measured peak),
    # the recomputed block under checkpointing, and gathered weights.
    block_weights = counts.block_params / counts.depth_blocks / parallel.tp
    block_grads = counts.trained[0] / counts.depth_blocks / parallel.tp   # one block's trained weights
    temporaries = 0.5 * detail["per_block_plain"]
    if memory.checkpointing != "none":
        temporaries += detail["per_block_plain"] if memory.checkpointing == "full" else 0.5 * detail["per_block_plain"]
    if parallel.shard > 1 or parallel.cpu_offload:
        # FSDP gathers the current and the prefetched block, and their unsharded gradients (at
        # backward's start: the last block, never resharded, and the one its backward prefetches;
        # parallel/parallelize.py, apply_fsdp); without resharding (parallel.reshard_after_forward=
        # false) every block of the rank stays gathered from its forward until its backward.
        gathered = 2 if parallel.reshard else max(2, math.ceil(counts.depth_blocks / parallel.pp))
        if lora is None:   # train.fp8 gathers its converted weights in 1 byte (float8 all-gather)
            temporaries += gathered * ((block_weights - converted) * precision.low_bytes + converted) \
                + 2 * block_grads * FP32
        else:
            adapters_block = lora.block_params / counts.depth_blocks
            temporaries += gathered * (block_weights + adapters_block) * precision.low_bytes + 2 * adapters_block * FP32
    elif precision.bf16:
        # autocast keeps a bf16 copy of every fp32 weight it used until backward is done (a
        # LoRA base is bf16 already: only the adapters are copied; train.fp8 casts its converted
        # weights straight to float8).
        copies = (trained - converted * counts.depth_blocks / parallel.pp) * 2
        temporaries += copies
        detail["autocast_copies"] = int(copies)
    if lever_counts is not None:
        temporaries += float8_operand_bytes(levers, lever_counts, detail["tokens_per_rank"])
    detail.update(num_params=counts.num_params * experts, params_per_gpu=int(n_local) * experts,
                  levers=levers.describe())
    if lora is not None:
        detail.update(adapter_params=lora.params * experts, adapter_params_per_gpu=int(adapters) * experts)
    return Estimate(params, grads, optimizer, ema_bytes, activations, int(temporaries), encoder_bytes, detail,
                    ddp_buckets=ddp_buckets)


# --------------------------------------------------------------------------- from a config


def default_world_size(cfg: Config) -> int:
    """GPUs the config's parallel sizes imply (``parallel.dp_shard=-1`` counts as 1)."""
    p = cfg.parallel
    return p.dp_replicate * max(p.dp_shard, 1) * p.sp * p.tp * p.pp


def parallel_from_config(cfg: Config, world_size: int | None = None) -> Parallel:
    """The layout the Trainer would build on ``world_size`` GPUs (default: the product of the
    configured sizes), with its sizes checked the same way."""
    from videodit.parallel.dims import check_layout
    p = cfg.parallel
    world = world_size or default_world_size(cfg)
    dims, _, _ = check_layout(cfg, world)   # training's own checks: a layout it refuses is refused here
    shard = dims.dp_shard * dims.sp if dims.data_parallel in ("fsdp", "hsdp") else 1
    microbatches = p.pp_microbatches or p.pp
    # GPipe runs every forward before any backward; 1F1B keeps at most pp micro-batches alive.
    in_flight = microbatches if p.pp_schedule == "gpipe" else min(p.pp, microbatches)
    return Parallel(sp=p.sp, tp=p.tp, pp=p.pp, shard=shard, microbatches=microbatches, in_flight=in_flight,
                    cpu_offload=p.cpu_offload and shard > 1, reshard=p.reshard_after_forward,
                    ddp=dims.data_parallel == "ddp")


def precision_from_config(cfg: Config, device: str = "cuda") -> Precision:
    precision = cfg.train.precision
    return Precision(bf16=precision == "bf16" or (precision == "auto" and device == "cuda"))
