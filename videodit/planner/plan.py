"""``videodit plan``: per-bucket memory, the largest batch that fits, and what to change when
nothing fits, before a single GPU is allocated.

Each (resolution, num_frames) entry of the bucket config is planned at its worst aspect
ratio (the most tokens), since one batch size serves all its ratios. Batch sizes can also
be chosen for equal step time: every bucket gets about the same hardware FLOPs per step
(``models.flops``: what the GPU runs, recompute included), capped by what fits.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from videodit.config import Config, MemoryConfig
from videodit.data.buckets.assign import build_buckets
from videodit.data.buckets.config import resolve_bucket_config
from videodit.errors import UserError
from videodit.planner.distill import Distill, check_distill_layout, distill_from_config, dmd2_estimate
from videodit.planner.levers import Levers, count_levers, levers_from_config
from videodit.planner.estimate import (Estimate, Lora, Parallel, Precision, Shape, count_lora, count_model,
                                      estimate, parallel_from_config, precision_from_config)
from videodit.models.flop_count import step_costs
from videodit.models.flops import StepFlops, train_step_flops
from videodit.models.families import get_spec, spec_of
from videodit.models.vae_base import CHUNK_FRAMES, latent_frames

MAX_BATCH = 4096


@dataclass(frozen=True)
class LatentGeometry:
    """How the VAE maps a clip to latents: channels, frames per latent frame, pixels per latent."""
    channels: int
    temporal: int
    spatial: int
    # Open-Sora 1.2's VAE cuts clips into pieces of this many frames and compresses each one.
    chunk: int | None = None

    def frames(self, num_frames: int) -> int:
        if self.chunk:   # the VAE's own rule (17 -> 5, 20 -> 6), not a copy of it
            return latent_frames(num_frames, self.chunk, self.temporal)
        if num_frames == 1:
            return 1
        return math.ceil(num_frames / self.temporal)

    @classmethod
    def opensora_v12(cls) -> "LatentGeometry":
        """The released Open-Sora 1.2 VAE: 4 channels, 8x8 pixels, 4x time in 17-frame pieces."""
        return cls(4, 4, 8, chunk=CHUNK_FRAMES)

    @classmethod
    def wan21(cls) -> "LatentGeometry":
        """Wan 2.1's causal VAE: 16 channels, 8x8 pixels, 4x time after the first frame
        (T' = (T - 1) // 4 + 1, which equals ceil(T / 4): ``frames`` needs no rule of its own)."""
        return cls(16, 4, 8)

    @classmethod
    def wan22(cls) -> "LatentGeometry":
        """Wan 2.2's VAE (TI2V-5B): 48 channels, 16x16 pixels (2x2 patches inside), time as 2.1's."""
        return cls(48, 4, 16)

    @classmethod
    def hunyuan(cls) -> "LatentGeometry":
        """HunyuanVideo's causal VAE (Open-Sora 2.0): 16 channels, 8x8 pixels, 4x time after the
        first frame (4k + 1 frames -> k + 1 = ceil(T / 4))."""
        return cls(16, 4, 8)

    @classmethod
    def opensora_dc_ae(cls) -> "LatentGeometry":
        """Open-Sora 2.0's Video DC-AE (high compression): 128 channels, 32x32 pixels, 4x time
        (1 frame, or a multiple of 4 from 8: T / 4 = ceil(T / 4))."""
        return cls(128, 4, 32)

    @classmethod
    def ltx2(cls) -> "LatentGeometry":
        """LTX-2's causal video VAE: 128 channels, 32x32 pixels, 8x time after the first frame
        (8k + 1 frames -> k + 1 = ceil(T / 8))."""
        return cls(128, 8, 32)

    @classmethod
    def parse(cls, text: str) -> "LatentGeometry":
        """A known VAE (``KNOWN_LATENTS``: opensora-v1.2, wan2.1, wan2.2, hunyuan, opensora-dc-ae, ltx2)
        or ``C,FT,FS`` (channels, temporal and spatial compression)."""
        if text in KNOWN_LATENTS:
            return KNOWN_LATENTS[text]()
        try:
            channels, temporal, spatial = (int(v) for v in text.split(","))
        except ValueError:
            raise UserError(f"--latent {text!r} must be a known VAE ({', '.join(KNOWN_LATENTS)}) or three integers "
                            "C,FT,FS (latent channels, frames per latent frame, pixels per latent), e.g. 4,1,8 for "
                            "an SD VAE") from None
        if min(channels, temporal, spatial) < 1:
            raise UserError(f"--latent {text!r}: every entry must be at least 1")
        return cls(channels, temporal, spatial)


# vae.kind (and --latent) -> the geometry of a VAE the planner knows without loading it.
KNOWN_LATENTS = {"opensora-v1.2": LatentGeometry.opensora_v12, "wan2.1": LatentGeometry.wan21,
                 "wan2.2": LatentGeometry.wan22, "hunyuan": LatentGeometry.hunyuan,
                 "opensora-dc-ae": LatentGeometry.opensora_dc_ae, "ltx2": LatentGeometry.ltx2}
# text.kind -> caption channels of an encoder the planner knows (its length is text.max_length).
# A family's own text encoders (``ModelSpec.text_kinds``: LTX-2's gemma3-ltx2) give the width of
# the release the config describes instead (``released_encoders_of``: 4096 for LTX-2.3, 3840 for 2.0).
KNOWN_CAPTIONS = {"umt5": 4096,      # umT5-XXL's d_model (Wan 2.1)
                  "t5-clip": 4096}   # T5-XXL's (Open-Sora 2.0; CLIP-L's pooled vector is one per sample)


@dataclass(frozen=True)
class BucketShape:
    """A clip shape to plan: frames and pixel size."""
    num_frames: int
    height: int
    width: int


@dataclass
class BucketFit:
    resolution: str
    num_frames: int
    ratio: str                      # the worst aspect ratio (most tokens)
    height: int
    width: int
    tokens: int                     # per sample, at that ratio
    config_batch_size: int | None   # what the bucket config asked for
    max_batch_size: int             # 0: not even batch 1 fits
    batch_size: int                 # the chosen one (max, or equal step time)
    estimate: Estimate              # at batch_size (or at 1 when nothing fits)
    fix: str | None = None          # the cheapest change that makes batch 1 fit
    flops: StepFlops = StepFlops(0.0, 0.0)   # one sample's forward + backward

    def as_dict(self) -> dict:
        return {"resolution": self.resolution, "num_frames": self.num_frames, "aspect_ratio": self.ratio,
                "height": self.height, "width": self.width, "tokens": self.tokens,
                "config_batch_size": self.config_batch_size, "max_batch_size": self.max_batch_size,
                "batch_size": self.batch_size, "audio_tokens": self.estimate.detail.get("audio_tokens", 0),
                "predicted_peak_bytes": self.estimate.peak,
                "model_flops_per_sample": self.flops.model, "hardware_flops_per_sample": self.flops.hardware,
                "step_flops": self.batch_size * self.flops.hardware,
                "bytes": self.estimate.as_dict(), "fix": self.fix}


@dataclass
class Planner:
    """Everything fixed across buckets: model, parallel layout, precision, memory levers."""
    geometry: Any   # the model family's arguments
    parallel: Parallel
    bf16: bool
    memory: MemoryConfig
    latent: LatentGeometry
    caption_length: int
    gpu_bytes: int
    margin: float = 0.1
    ema: bool = True
    encoder_bytes: int = 0
    batch_multiple: int = 1     # pipeline micro-batches: batch sizes must be multiples
    lora: Lora | None = None    # LoRA adapters on a frozen base (estimate.count_lora)
    experts: int = 1            # whole models held, one trained per step (model.expert=both: 2)
    levers: Levers = Levers()   # fp8 base, 8-bit moments, block swapping, fp8 compute (planner/levers.py)
    world_size: int = 1         # GPUs of the job (the layout ``parallel`` is of)
    config: Any = None          # the Config planned (the advice's settings refer to it), if any
    distill: Distill | None = None   # distill.method=dmd2: critic and teacher beside the student (planner/distill.py)
    # model.train_audio (LTX-2): the frame rate the model sees (sample.fps) and data.frame_interval,
    # which size the clips' soundtracks' audio tokens (ModelSpec.audio_tokens); None: video alone
    audio_fps: float | None = None
    frame_interval: int = 1

    def __post_init__(self):
        spec = spec_of(self.geometry)
        with torch.device("meta"):    # structure only: no memory, no initialisation cost
            self.meta_model = spec.build(self.geometry)
        if self.config is not None:   # what the run trains: LTX-2's audio stream is frozen without train_audio
            spec.configure(self.meta_model, self.config.model)
        self.counts = count_model(self.geometry, self.meta_model)
        self.lever_counts = count_levers(self.meta_model)

    @property
    def budget(self) -> float:
        return self.gpu_bytes * (1 - self.margin)

    def shape(self, batch: int, num_frames: int, height: int, width: int) -> Shape:
        s = self.latent.spatial
        return Shape(batch, self.latent.frames(num_frames), height // s, width // s, self.latent.channels,
                     self.caption_length, self.audio_tokens(num_frames))

    def audio_tokens(self, num_frames: int) -> int:
        """Audio tokens of a clip of ``num_frames`` (0: no audio stream trains)."""
        if self.audio_fps is None:
            return 0
        return spec_of(self.geometry).audio_tokens(num_frames, self.audio_fps, self.frame_interval)

    def estimate(self, batch: int, num_frames: int, height: int, width: int, **changes) -> Estimate:
        memory = dataclasses.replace(self.memory, **changes.pop("memory", {}))
        parallel = dataclasses.replace(self.parallel, **changes.pop("parallel", {}))
        levers = dataclasses.replace(self.levers, **changes.pop("levers", {}))

        def plain(levers: Levers) -> Estimate:
            return estimate(self.geometry, self.shape(batch, num_frames, height, width), parallel=parallel,
                            precision=Precision(self.bf16), memory=memory, ema=self.ema,
                            encoder_bytes=self.encoder_bytes, counts=self.counts, lora=self.lora,
                            experts=self.experts, levers=levers, lever_counts=self.lever_counts)
        student = plain(levers)
        if self.distill is None:
            return student
        # The critic is not converted by train.fp8: its graded pass is the plain one without it.
        critic = plain(dataclasses.replace(levers, fp8_compute=False)) if levers.fp8_compute else student
        return dmd2_estimate(student, critic, self.counts.num_params, Precision(self.bf16).low_bytes,
                             with_critic=self.distill.method == "dmd2", teacher_held=not self.distill.cached)

    def max_batch(self, num_frames: int, height: int, width: int, **changes) -> int:
        """The largest batch (a multiple of ``batch_multiple``) under the budget; 0 if none."""
        step = self.batch_multiple
        fits = lambda b: self.estimate(b, num_frames, height, width, **changes).peak <= self.budget  # noqa: E731
        if not fits(step):
            return 0
        low, high = 1, MAX_BATCH // step          # in units of `step`; low fits
        if fits(high * step):
            return high * step
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid * step) else (low, mid)
        return low * step

    def cheapest_fix(self, num_frames: int, height: int, width: int) -> str | None:
        """The first change on this plan's GPUs, cheapest in step time first, under which batch 1
        fits (``planner/advice.py``); None if none does."""
        from videodit.planner.advice import cheapest_fix
        found = cheapest_fix(self, [BucketShape(num_frames, height, width)])
        return None if found is None else found[0].label

    def flops_per_sample(self, num_frames: int, height: int, width: int) -> StepFlops:
        """Model and hardware FLOPs of one sample's training step (fused GPU attention, this
        plan's checkpointing)."""
        shape = self.shape(1, num_frames, height, width)
        if not shape.audio_tokens:
            return train_step_flops(self.geometry, 1, shape.latent_frames, shape.latent_height, shape.latent_width,
                                    self.caption_length, self.memory)
        return audio_step_flops(self.geometry, shape, self.memory)


def audio_step_flops(geometry, shape: Shape, memory: MemoryConfig) -> StepFlops:
    """``models.flops.train_step_flops`` of one sample with its audio stream (``shape.audio_tokens``):
    the family's count with the audio tokens, the same step costs (fused GPU attention)."""
    spec = spec_of(geometry)
    grid = spec.token_grid(geometry, shape.latent_frames, shape.latent_height, shape.latent_width)
    count = spec.forward_flops(geometry, *grid, shape.caption_length, audio_tokens=shape.audio_tokens)
    kinds = spec.block_kinds(geometry) if memory.checkpoint_blocks else None
    return StepFlops(count.total + count.backward, sum(step_costs(count, memory, True, kinds)))


def plan_buckets(planner: Planner, buckets: list[tuple[str, int, str, int, int, int | None]],
                 equal_step_time: bool = False) -> list[BucketFit]:
    """``buckets``: (resolution, num_frames, ratio, height, width, batch_size) rows; one plan
    per (resolution, num_frames), at the ratio with the most tokens."""
    worst: dict[tuple[str, int], tuple] = {}
    for row in buckets:
        resolution, num_frames, ratio, height, width, batch = row
        tokens = planner.shape(1, num_frames, height, width).tokens(planner.geometry)
        key = (resolution, num_frames)
        if key not in worst or tokens > worst[key][0]:
            worst[key] = (tokens, row)
    plans = []
    for tokens, (resolution, num_frames, ratio, height, width, batch) in worst.values():
        max_batch = planner.max_batch(num_frames, height, width)
        fix = None if max_batch else planner.cheapest_fix(num_frames, height, width)
        plans.append(BucketFit(resolution, num_frames, ratio, height, width, tokens, batch, max_batch,
                                max_batch, planner.estimate(max(max_batch, 1), num_frames, height, width), fix,
                                planner.flops_per_sample(num_frames, height, width)))
    if equal_step_time:
        equalise_step_time(planner, plans)
    return plans


def equalise_step_time(planner: Planner, plans: list[BucketFit]) -> None:
    """Give every bucket about the same hardware FLOPs per step (step time follows what the
    GPU runs, recompute included): the most that every bucket reaches within memory (the
    smallest of max_batch x FLOPs per sample)."""
    fitting = [p for p in plans if p.max_batch_size]
    if not fitting:
        return
    target = min(p.max_batch_size * p.flops.hardware for p in fitting)
    step = planner.batch_multiple
    for p in fitting:
        batch = max(step, int(target / p.flops.hardware) // step * step)
        p.batch_size = min(batch, p.max_batch_size)
        p.estimate = planner.estimate(p.batch_size, p.num_frames, p.height, p.width)


def bucket_rows(cfg: Config) -> list[tuple[str, int, str, int, int, int | None]]:
    """The config's buckets, or its single training shape when it has no bucket_config."""
    config = resolve_bucket_config(cfg.data)
    if config is None:
        d = cfg.data
        return [(f"{d.height}x{d.width}", d.num_frames, f"{d.height / d.width:.2f}", d.height, d.width,
                 cfg.train.batch_size)]
    return [(b.resolution, b.num_frames, b.ratio, b.height, b.width, b.batch_size) for b in build_buckets(config)]


def written_bucket_config(cfg: Config, plans: list[BucketFit]) -> dict:
    """The config's bucket_config with the planned batch sizes (keep probabilities unchanged);
    buckets where nothing fits are switched off with (0.0, None)."""
    original = resolve_bucket_config(cfg.data) or {}
    chosen = {(p.resolution, p.num_frames): p.batch_size for p in plans}
    out: dict = {}
    for resolution, frames in original.items():
        out[resolution] = {}
        for num_frames, (keep, _batch) in frames.items():
            batch = chosen.get((resolution, int(num_frames)))
            if batch:
                keep = list(keep) if isinstance(keep, (tuple, list)) else keep
                out[resolution][int(num_frames)] = [keep, batch]
            else:
                out[resolution][int(num_frames)] = [0.0, None]
    return out


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def frozen_encoder_bytes(cfg: Config) -> int:
    """GPU bytes of the frozen VAE and text encoder (and with ``model.train_audio`` the audio VAE):
    the built-in ones are counted, local pretrained ones from their weight files without loading
    them: safetensors headers give the element counts (at ``vae.dtype`` / ``text.dtype`` /
    ``audio.dtype``), other files count by their size."""
    from pathlib import Path

    from videodit.components import build_text_encoder
    total = 0
    if cfg.text.kind == "toy":
        encoder = build_text_encoder("toy", path=None, max_length=cfg.text.max_length, dim=cfg.text.dim)
        total += sum(t.numel() * t.element_size() for t in (*encoder.parameters(), *encoder.buffers()))
    text_sub = None
    if cfg.text.kind == "umt5" and cfg.text.path and (Path(cfg.text.path) / "text_encoder").is_dir():
        text_sub = "text_encoder"   # a whole diffusers Wan folder: not its transformer/ and vae/ as well
    encoders = ((cfg.vae.path, cfg.vae.subfolder, cfg.vae.dtype), (cfg.text.path, text_sub, cfg.text.dtype))
    for path, sub, dtype in encoders:
        total += _encoder_bytes(_target(path, sub), _DTYPE_BYTES[dtype])
    if cfg.model.train_audio and cfg.audio.kind == "ltx2":   # the toy codec has no weights
        total += _audio_vae_bytes(_target(cfg.audio.path, cfg.audio.subfolder), _DTYPE_BYTES[cfg.audio.dtype])
    return total


def _target(path, sub):
    from pathlib import Path
    return Path(path) / sub if path and sub else Path(path) if path else None


def _encoder_bytes(target, element_bytes: int, prefix: str = "") -> int:
    """Weight bytes of a folder's files (every one) or of one weight file (its tensors named
    ``prefix*``, where its header tells); 0 for what is not there."""
    if target is not None and target.is_dir():
        return sum(_weight_bytes(f, element_bytes) for f in target.rglob("*")
                   if f.suffix in _WEIGHT_SUFFIXES and not f.is_dir())
    if target is not None and target.exists() and target.suffix in _WEIGHT_SUFFIXES:   # a FIFO: refused
        return _weight_bytes(target, element_bytes, prefix)   # e.g. vae.path=Wan2.1_VAE.pth
    return 0


def _audio_vae_bytes(target, element_bytes: int) -> int:
    """The frozen audio VAE training builds (``audio.kind=ltx2``, no vocoder): the release file's
    ``audio_vae.*`` tensors, or a diffusers folder's ``audio_vae/`` (``models/ltx2/audio_vae.py``
    reads the same)."""
    if target is not None and target.is_dir() and (target / "audio_vae" / "config.json").is_file():
        target = target / "audio_vae"
    return _encoder_bytes(target, element_bytes, prefix="audio_vae.")


def _weight_bytes(file, element_bytes: int, prefix: str = "") -> int:
    """Bytes of a weight file's tensors once loaded at ``element_bytes`` per element: from the
    JSON header of a safetensors file (read as text, never executed; its tensors named
    ``prefix*`` only), else the file's size."""
    import json
    import math
    import os

    from videodit.errors import os_error_message
    from videodit.user_files import NotRegularFile, open_user_file

    try:
        handle = open_user_file(file)   # a FIFO would block the read forever
    except NotRegularFile as exc:
        raise UserError(f"encoder weights: {os_error_message(exc)}") from None
    except OSError:   # unreadable here: its size is the best guess (0 for a dangling link)
        try:
            return file.stat().st_size
        except OSError:
            return 0
    with handle:
        if file.suffix == ".safetensors":
            try:
                size = int.from_bytes(handle.read(8), "little")
                if size > 100 * 2**20:   # safetensors caps headers at 100 MB: not one
                    raise ValueError(size)
                header = json.loads(handle.read(size))
                return element_bytes * sum(math.prod(entry["shape"]) for name, entry in header.items()
                                           if name != "__metadata__" and name.startswith(prefix))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass   # not a readable safetensors file: its size is the best guess
        return os.fstat(handle.fileno()).st_size


def planner_from_config(cfg: Config, gpu_bytes: int, *, world_size: int | None = None, margin: float = 0.1,
                        latent: LatentGeometry | None = None, caption: tuple[int, int] | None = None,
                        encoder_bytes: int | None = None) -> Planner:
    """A planner for ``cfg`` on GPUs of ``gpu_bytes``. Latent and caption geometry come from
    the config's encoders when they are built in (identity VAE, toy text) or known
    (vae.kind=opensora-v1.2, wan2.1, wan2.2, hunyuan, opensora-dc-ae or ltx2, text.kind=umt5, t5-clip
    or the family's own, e.g. gemma3-ltx2, at text.max_length tokens); other local
    pretrained ones are described with ``latent``/``caption`` instead of being loaded."""
    if cfg.data.cache:   # features are cached: no encoder on the GPU; geometry from the cache when built
        latent, caption, encoder_bytes = *_cached_geometry(cfg, latent, caption), 0
    if latent is None:
        if cfg.vae.kind == "diffusers":
            raise UserError("vae.kind=diffusers: give the latent geometry with --latent C,FT,FS (or opensora-v1.2); "
                            "the planner does not load the VAE")
        known = KNOWN_LATENTS.get(cfg.vae.kind)
        latent = known() if known else LatentGeometry(3, 1, 1)
    spec = get_spec(cfg.model.family)
    if caption is None and cfg.text.kind in spec.text_kinds:   # the family's own: its release's width
        caption = (spec.released_encoders_of(cfg.model)[1], cfg.text.max_length)
    if caption is None and cfg.text.kind in KNOWN_CAPTIONS:
        caption = (KNOWN_CAPTIONS[cfg.text.kind], cfg.text.max_length)
    if caption is None:
        if cfg.text.kind != "toy":
            raise UserError(f"text.kind={cfg.text.kind}: give the caption geometry with --caption CHANNELS,LENGTH "
                            "(e.g. 4096,300 for T5-XXL); the planner does not load the encoder")
        caption = (cfg.text.dim, cfg.text.max_length)
    channels, length = caption
    geometry = spec.geometry(cfg.model, latent.channels, channels, length)
    from videodit.planner.estimate import default_world_size

    world_size = world_size or default_world_size(cfg)
    parallel = parallel_from_config(cfg, world_size)
    check_distill_layout(cfg, parallel, world_size)   # DMD2's roles are full replicas: as training refuses
    p = cfg.parallel
    multiple = (p.pp_microbatches or p.pp) if p.pp > 1 else 1
    return Planner(geometry, parallel, precision_from_config(cfg).bf16, cfg.memory, latent, length, gpu_bytes,
                   margin, ema=cfg.train.ema_decay > 0, batch_multiple=multiple,
                   encoder_bytes=frozen_encoder_bytes(cfg) if encoder_bytes is None else encoder_bytes,
                   lora=count_lora(cfg.lora, geometry), experts=2 if cfg.model.expert == "both" else 1,
                   levers=levers_from_config(cfg), world_size=world_size, config=cfg,
                   distill=distill_from_config(cfg), audio_fps=_audio_fps(cfg),
                   frame_interval=cfg.data.frame_interval)


def _audio_fps(cfg: Config) -> float | None:
    """``model.train_audio``: the frame rate the model sees (``sample.fps``, which matches the
    training clips' fps / data.frame_interval), which with the interval sizes each clip's
    soundtrack; refused in one line as training refuses it (a family without an audio stream, no
    ``audio.kind``). None: the video stream alone."""
    if not cfg.model.train_audio:
        return None
    from videodit.components import check_audio_training
    check_audio_training(cfg)
    return float(cfg.sample.fps)


def _cached_geometry(cfg: Config, latent: LatentGeometry | None,
                     caption: tuple[int, int] | None) -> tuple[LatentGeometry | None, tuple[int, int] | None]:
    """Latent and caption geometry from ``data.cache``'s manifest where not given (and where the
    cache exists already); the Open-Sora 1.2 VAE's chunked rule stays the planner's own."""
    from pathlib import Path

    from videodit.data.feature_cache.format import MANIFEST, read_manifest
    if not (Path(cfg.data.cache) / MANIFEST).is_file():
        return latent, caption
    manifest = read_manifest(Path(cfg.data.cache))
    # What the cache holds, not the released size.
    if latent is None and cfg.vae.kind in ("diffusers", "wan2.1", "wan2.2", "hunyuan", "opensora-dc-ae", "ltx2"):
        g = manifest["latent"]
        latent = LatentGeometry(g["channels"], g["temporal_compression"], g["spatial_compression"])
    if caption is None and cfg.text.kind != "toy":
        caption = (manifest["text_geometry"]["dim"], manifest["text_geometry"]["max_length"])
    return latent, caption
