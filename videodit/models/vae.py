"""Frozen VAE adapters: pixels <-> ~unit-variance latents for the diffusion transformer.

Every adapter implements the small interface of ``models/vae_base.py`` (``FrozenVAE``), so the
trainer and the sampler never look at diffusers' many output types. ``build_vae`` is the one
factory for every kind: identity, diffusers (this file) and each model family's own
(opensora-v1.2, wan2.1), which its spec builds (``ModelSpec.build_vae``). Nothing is ever
downloaded: diffusers models load with ``local_files_only=True``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from videodit.config.schema import WEIGHT_FREE_VAE_KINDS
from videodit.errors import UserError
from videodit.models.families import encoder_kinds, encoder_spec
from videodit.models.vae_base import FrozenVAE
from videodit.user_files import read_user_json

OWN_VAE_KINDS = WEIGHT_FREE_VAE_KINDS + ("diffusers",)   # built here; the families bring the others


def vae_kinds() -> tuple[str, ...]:
    """Every vae.kind: identity, diffusers, and each family's own (opensora-v1.2, wan2.1)."""
    return OWN_VAE_KINDS + encoder_kinds("vae_kinds")

# diffusers autoencoders that take one image [N,C,H,W]; videos are folded into frames.
_IMAGE_VAE_CLASSES = (
    "AutoencoderKL",
    "AsymmetricAutoencoderKL",
    "AutoencoderTiny",
    "AutoencoderDC",
    "AutoencoderKLFlux2",
    "AutoencoderKLHunyuanImage",
    "ConsistencyDecoderVAE",
    "VQModel",
)

# diffusers autoencoders that take a whole clip [B,C,T,H,W]. The Qwen-Image VAE is an
# image model with the Wan architecture, so it also wants 5-D input (with T=1).
_VIDEO_VAE_CLASSES = (
    "AutoencoderKLCogVideoX",
    "AutoencoderKLWan",
    "AutoencoderKLHunyuanVideo",
    "AutoencoderKLHunyuanVideo15",
    "AutoencoderKLLTXVideo",
    "AutoencoderKLLTX2Video",
    "AutoencoderKLMochi",
    "AutoencoderKLCosmos",
    "AutoencoderKLMagvit",
    "AutoencoderKLQwenImage",
)

# Classes that look like autoencoders but cannot be wrapped by a plain encode/decode.
_UNSUPPORTED_CLASSES = {
    "AutoencoderKLTemporalDecoder": "its decoder mixes frames and needs num_frames at decode time",
    "AutoencoderKLAllegro": "its diffusers encoder only runs fixed 24-frame tiles",
}

# Fallback for classes missing from the tables above: a name containing one of these
# markers, or a config with a temporal-compression key, marks a video (5-D) VAE; any
# other "Autoencoder*" class is used per frame.
_VIDEO_NAME_MARKERS = ("Video", "3D", "Vid")
_VIDEO_CONFIG_KEYS = ("temporal_compression_ratio", "scale_factor_temporal", "temperal_downsample")


# --------------------------------------------------------------------------- identity


class IdentityVAE(FrozenVAE):
    """Latents are the pixels themselves (C=3, no compression); for tiny CPU runs."""

    def __init__(self, scaling_factor: float = 1.0):
        super().__init__()
        self.latent_channels = 3
        self.spatial_compression = 1
        self.temporal_compression = 1
        self.scaling_factor = float(scaling_factor)
        self._freeze()

    @torch.no_grad()
    def encode(self, video: Tensor) -> Tensor:
        self._check_input(video)
        return video.float() * self.scaling_factor

    @torch.no_grad()
    def decode(self, latents: Tensor, num_frames: int | None = None) -> Tensor:
        self._check_num_frames(latents, num_frames)
        return (latents.float() / self.scaling_factor).clamp(-1.0, 1.0)


class SpaceToDepthVAE(IdentityVAE):
    """Latents are the pixels folded 4 x 4 into channels (48 channels, 4x smaller frames): a
    weight-free stand-in for a VAE's spatial compression, for tiny CPU runs of models whose patch
    is 1 x 1 (LTX-2), which would otherwise see one token per pixel."""

    FACTOR = 4

    def __init__(self, scaling_factor: float = 1.0):
        super().__init__(scaling_factor)
        self.latent_channels = 3 * self.FACTOR ** 2
        self.spatial_compression = self.FACTOR

    @torch.no_grad()
    def encode(self, video: Tensor) -> Tensor:
        self._check_input(video)
        frames = video.float().transpose(1, 2)                                    # [B, T, 3, H, W]
        return F.pixel_unshuffle(frames, self.FACTOR).transpose(1, 2) * self.scaling_factor

    @torch.no_grad()
    def decode(self, latents: Tensor, num_frames: int | None = None) -> Tensor:
        self._check_num_frames(latents, num_frames)
        frames = F.pixel_shuffle(latents.float().transpose(1, 2) / self.scaling_factor, self.FACTOR)
        return frames.transpose(1, 2).clamp(-1.0, 1.0)


# --------------------------------------------------------------------------- diffusers helpers


def _config_get(config: Any, *names: str) -> Any:
    """First non-None config value among ``names`` (diffusers configs are FrozenDicts)."""
    for name in names:
        value = config.get(name) if hasattr(config, "get") else getattr(config, name, None)
        if value is not None:
            return value
    return None


def _int_attr(model: nn.Module, name: str) -> int | None:
    """An int attribute set on the model instance (several diffusers VAEs define these).

    Read from ``vars()`` because diffusers' ``__getattr__`` would otherwise fall back to
    the config with a deprecation warning.
    """
    value = vars(model).get(name)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _latent_channels(model: nn.Module) -> int:
    value = _config_get(model.config, "latent_channels", "z_dim", "z_channels")
    if value is None:
        raise UserError(
            f"cannot tell the latent channel count of {type(model).__name__}; "
            "its config has no latent_channels / z_dim / z_channels (check vae.path)"
        )
    return int(value)


def _spatial_compression(model: nn.Module) -> int:
    """Pixels per latent along H/W, from the model or its config.

    Order: Wan-style ``temperal_downsample`` (one 2x spatial stage per entry, times the
    patch size), then an explicit ``spatial_compression_ratio`` on the instance/config,
    then 2 ** (number of blocks - 1) from ``block_out_channels`` (or ``ch_mult``).
    """
    cfg = model.config
    stages = _config_get(cfg, "temperal_downsample")
    if stages is not None:
        patch = _config_get(cfg, "patch_size") or 1
        patch = patch[0] if isinstance(patch, (list, tuple)) else patch
        return 2 ** len(stages) * int(patch)
    explicit = _int_attr(model, "spatial_compression_ratio") or _config_get(
        cfg, "spatial_compression_ratio", "scale_factor_spatial"
    )
    if explicit is not None:
        return int(explicit)
    blocks = _config_get(cfg, "block_out_channels", "encoder_block_out_channels", "ch_mult")
    if blocks is not None:
        return 2 ** (len(blocks) - 1)
    raise UserError(
        f"cannot tell the spatial compression of {type(model).__name__} from its config "
        "(check vae.path)"
    )


def _temporal_compression(model: nn.Module) -> int:
    """Frames per latent frame, from the model or its config.

    Wan-style configs count the True entries of ``temperal_downsample`` (their
    ``scale_factor_temporal`` is only a pipeline hint and may disagree with the layers).
    """
    cfg = model.config
    stages = _config_get(cfg, "temperal_downsample")
    if stages is not None:
        return 2 ** sum(bool(s) for s in stages)
    explicit = _int_attr(model, "temporal_compression_ratio") or _config_get(
        cfg, "temporal_compression_ratio", "scale_factor_temporal", "temporal_compress_times"
    )
    if explicit is not None:
        return int(explicit)
    raise UserError(
        f"cannot tell the temporal compression of {type(model).__name__} from its config "
        "(check vae.path)"
    )


def _posterior_mode(output: Any) -> Tensor:
    """Deterministic latents from any diffusers encode() output.

    KL autoencoders return ``.latent_dist`` (use its mode = mean); Tiny/DC/VQ return
    ``.latents`` (DC: ``.latent``); ``return_dict=False`` tuples hold either in slot 0.
    """
    if isinstance(output, tuple):
        output = output[0]
    for field in ("latent_dist", "latents", "latent"):
        if hasattr(output, field):
            output = getattr(output, field)
            break
    # Check Tensor first: torch.Tensor.mode() exists too (the statistical mode).
    if isinstance(output, Tensor):
        return output
    if hasattr(output, "mode"):
        return output.mode()
    raise TypeError(f"unexpected VAE encode output: {type(output).__name__}")


def _decoded_sample(output: Any) -> Tensor:
    if isinstance(output, tuple):
        return output[0]
    return output.sample if hasattr(output, "sample") else output


def _channel_stats(values: Any, channels: int, num_frames: int | None) -> Tensor | None:
    """Per-channel (or per-channel-per-frame, e.g. Cosmos) stats shaped to broadcast.

    Returns [1,C,1,1] for image latents (num_frames None) or [1,C,T',1,1] / [1,C,1,1,1]
    for video latents.
    """
    if values is None:
        return None
    stats = torch.as_tensor(values, dtype=torch.float32).flatten()
    if stats.numel() == 1:
        return stats.reshape(())  # a scalar broadcasts anywhere
    if stats.numel() % channels:
        raise UserError(
            f"VAE latents_mean/latents_std has {stats.numel()} values for {channels} latent "
            "channels; fix the VAE config in vae.path"
        )
    per_frame = stats.reshape(channels, -1)
    if num_frames is None:
        return per_frame[:, 0].reshape(1, channels, 1, 1)
    if per_frame.shape[1] == 1:
        return per_frame.reshape(1, channels, 1, 1, 1)
    # Time-varying stats (Cosmos): take the first T' entries, repeating the last if short.
    idx = torch.arange(num_frames).clamp(max=per_frame.shape[1] - 1)
    return per_frame[:, idx].reshape(1, channels, num_frames, 1, 1)


class _DiffusersVAE(FrozenVAE):
    """Common part of the 2-D and 3-D diffusers adapters: normalisation and freezing.

    Normalisation (``encode``): ``z = (mode - mean) / std * scale`` where ``mean/std``
    are the config's (or module buffers') ``latents_mean/latents_std`` when present
    (Wan, Mochi, Cosmos, LTX), otherwise ``mean = shift_factor`` (SD3/Flux) or 0 and
    ``std = 1``; ``scale`` is the ``scaling_factor`` argument, else the config's, else 1.
    ``decode`` applies the exact inverse.
    """

    def __init__(self, vae: nn.Module, scaling_factor: float | None = None):
        super().__init__()
        self.vae = vae
        cfg = vae.config
        self.class_name = type(vae).__name__
        self.latent_channels = _latent_channels(vae)
        self.spatial_compression = _spatial_compression(vae)
        cfg_scale = _config_get(cfg, "scaling_factor")
        self.scaling_factor = float(
            scaling_factor if scaling_factor is not None else (cfg_scale if cfg_scale is not None else 1.0)
        )
        self._mean_values = _config_get(cfg, "latents_mean")
        self._std_values = _config_get(cfg, "latents_std")
        buffers = dict(vae.named_buffers(recurse=False))
        if self._mean_values is None and "latents_mean" in buffers:
            # LTX-Video keeps its statistics as module buffers rather than config entries.
            self._mean_values = buffers["latents_mean"].detach().float().cpu()
            self._std_values = buffers["latents_std"].detach().float().cpu()
        if self._mean_values is None:
            self._mean_values = _config_get(cfg, "shift_factor")
        self._freeze()

    def _stats(self, latents: Tensor) -> tuple[Tensor | float, Tensor | float]:
        frames = latents.shape[2] if latents.ndim == 5 else None
        mean = _channel_stats(self._mean_values, self.latent_channels, frames)
        std = _channel_stats(self._std_values, self.latent_channels, frames)
        mean = 0.0 if mean is None else mean.to(latents.device)
        std = 1.0 if std is None else std.to(latents.device)
        return mean, std

    def _normalise(self, raw: Tensor) -> Tensor:
        raw = raw.float()
        mean, std = self._stats(raw)
        return (raw - mean) / std * self.scaling_factor

    def _denormalise(self, latents: Tensor) -> Tensor:
        latents = latents.float()
        mean, std = self._stats(latents)
        return latents / self.scaling_factor * std + mean


# --------------------------------------------------------------------------- 2-D (per frame)


class Diffusers2DVAE(_DiffusersVAE):
    """A diffusers image autoencoder applied frame by frame.

    Frames of all clips are folded into the batch and processed ``micro_batch`` at a
    time, so memory is bounded by the chunk size, not by B*T. Rule: T' = T.
    """

    def __init__(self, vae: nn.Module, scaling_factor: float | None = None, micro_batch: int = 16):
        super().__init__(vae, scaling_factor)
        self.temporal_compression = 1
        self.micro_batch = max(1, int(micro_batch))

    @torch.no_grad()
    def encode(self, video: Tensor) -> Tensor:
        self._check_input(video)
        b, _, t, h, w = video.shape
        frames = video.permute(0, 2, 1, 3, 4).reshape(b * t, 3, h, w)
        frames = frames.to(device=self.device, dtype=self.dtype)
        chunks = [_posterior_mode(self.vae.encode(c)) for c in frames.split(self.micro_batch)]
        latents = self._normalise(torch.cat(chunks))
        return latents.reshape(b, t, *latents.shape[1:]).permute(0, 2, 1, 3, 4).contiguous()

    @torch.no_grad()
    def decode(self, latents: Tensor, num_frames: int | None = None) -> Tensor:
        self._check_num_frames(latents, num_frames)
        b, c, t, h, w = latents.shape
        flat = latents.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        flat = self._denormalise(flat.to(self.device)).to(self.dtype)
        chunks = [_decoded_sample(self.vae.decode(z)) for z in flat.split(self.micro_batch)]
        frames = torch.cat(chunks).float().clamp(-1.0, 1.0)
        return frames.reshape(b, t, *frames.shape[1:]).permute(0, 2, 1, 3, 4).contiguous()


# --------------------------------------------------------------------------- 3-D (whole clip)


class Diffusers3DVAE(_DiffusersVAE):
    """A diffusers video autoencoder that compresses time as well as space.

    Temporal rule: all supported video VAEs (CogVideoX, Wan, HunyuanVideo(1.5), LTX-Video,
    Mochi, Cosmos, EasyAnimate/Magvit, Qwen-Image) are causal: the first frame is encoded
    on its own, so T' = (T-1)//r + 1, and they need T = 1 + r*k frames (other counts are
    rejected because several encoders silently drop or pad frames). Spatial rule:
    H' = H // s, W' = W // s. Clips are encoded ``max(1, micro_batch // T)`` at a time
    to bound memory.
    """

    def __init__(self, vae: nn.Module, scaling_factor: float | None = None, micro_batch: int = 16):
        super().__init__(vae, scaling_factor)
        self.temporal_compression = _temporal_compression(vae)
        self.micro_batch = max(1, int(micro_batch))

    def latent_size(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        r, s = self.temporal_compression, self.spatial_compression
        return (num_frames - 1) // r + 1, height // s, width // s

    def num_frames_for(self, latent_frames: int) -> int:
        """Pixel frame count that ``decode`` returns for ``latent_frames`` latent frames."""
        return 1 + (latent_frames - 1) * self.temporal_compression

    def _check_frames(self, num_frames: int) -> None:
        r = self.temporal_compression
        if num_frames < 1 or (num_frames - 1) % r:
            raise UserError(
                f"num_frames={num_frames} does not fit the {self.class_name} VAE, which needs "
                f"1 + {r}*k frames (e.g. 1, {1 + r}, {1 + 2 * r}, {1 + 4 * r}); change the clip length"
            )

    def _clips_per_chunk(self, num_frames: int) -> int:
        return max(1, self.micro_batch // max(1, num_frames))

    @torch.no_grad()
    def encode(self, video: Tensor) -> Tensor:
        self._check_input(video)
        b, _, t, h, w = video.shape
        self._check_frames(t)
        video = video.to(device=self.device, dtype=self.dtype)
        chunks = [_posterior_mode(self.vae.encode(c)) for c in video.split(self._clips_per_chunk(t))]
        latents = self._normalise(torch.cat(chunks))
        expected = (b, self.latent_channels, *self.latent_size(t, h, w))
        if tuple(latents.shape) != expected:
            # A config we read wrongly would otherwise mis-size the whole model downstream.
            raise RuntimeError(
                f"{self.class_name} encoded {tuple(video.shape)} to {tuple(latents.shape)}, "
                f"but latent_size() predicted {expected}"
            )
        return latents

    @torch.no_grad()
    def decode(self, latents: Tensor, num_frames: int | None = None) -> Tensor:
        self._check_num_frames(latents, num_frames)
        latents = self._denormalise(latents.to(self.device)).to(self.dtype)
        per_chunk = self._clips_per_chunk(self.num_frames_for(latents.shape[2]))
        chunks = [_decoded_sample(self.vae.decode(z)) for z in latents.split(per_chunk)]
        video = torch.cat(chunks).float().clamp(-1.0, 1.0)
        # Some decoders (e.g. CogVideoX with an even T') return extra frames; keep the
        # canonical count so encode -> decode round-trips the clip length (at most num_frames:
        # a count that is not 1 + r*k, which encode refuses, decodes to fewer frames).
        return video[:, :, : min(self.num_frames_for(latents.shape[2]), num_frames or video.shape[2])]


# --------------------------------------------------------------------------- factory


def _where(path: str | None, subfolder: str | None) -> str:
    """How error messages name the configured location."""
    return f"vae.path='{path}'" + (f" (vae.subfolder='{subfolder}')" if subfolder else "")


def _read_model_config(path: str | None, subfolder: str | None) -> dict:
    """The model's config.json, with one-line errors naming vae.path / vae.subfolder."""
    if path is None or str(path).strip() == "":
        raise UserError(
            "vae.path is required for vae.kind='diffusers': point it to a local diffusers "
            "model folder (nothing is downloaded)"
        )
    root = Path(path).expanduser()
    if not root.is_dir():
        raise UserError(
            f"vae.path='{path}' is not an existing folder: point vae.path to a local "
            "diffusers model folder (nothing is downloaded)"
        )
    folder = root / subfolder if subfolder else root
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise UserError(
            f"{_where(path, subfolder)} has no config.json: point vae.path (and vae.subfolder) "
            "to a diffusers VAE folder saved with save_pretrained"
        )
    try:
        return read_user_json(config_file)
    except (OSError, ValueError) as exc:
        message = f"{_where(path, subfolder)}: cannot read config.json ({exc}); fix or replace vae.path"
        raise UserError(message) from None


def _vae_class(config: dict, where: str) -> tuple[type, bool]:
    """The diffusers class named by ``config`` and whether it is a video (5-D) VAE."""
    class_name = config.get("_class_name")
    if config.get("model_type") == "VideoAutoencoderPipeline":
        raise UserError(f"{where} holds Open-Sora 1.2's VAE (VideoAutoencoderPipeline); set vae.kind=opensora-v1.2")
    try:
        import diffusers  # heavy optional import, only needed for real VAEs
    except ImportError:
        raise UserError(
            "vae.kind='diffusers' needs the diffusers package: pip install 'videodit[hf]'"
        ) from None

    supported = ", ".join(_IMAGE_VAE_CLASSES + _VIDEO_VAE_CLASSES)
    cls = getattr(diffusers, class_name, None) if isinstance(class_name, str) else None
    looks_like_vae = isinstance(class_name, str) and (
        class_name.startswith("Autoencoder") or class_name in _IMAGE_VAE_CLASSES
    )
    if cls is None or not looks_like_vae or class_name in _UNSUPPORTED_CLASSES or "Audio" in class_name:
        reason = _UNSUPPORTED_CLASSES.get(class_name or "", "it is not a supported diffusers VAE")
        raise UserError(
            f"{where} holds _class_name={class_name!r}, but {reason}; use a VAE folder of one "
            f"of: {supported} (or set vae.kind to one of: {', '.join(vae_kinds())})"
        )
    if class_name in _VIDEO_VAE_CLASSES:
        return cls, True
    if class_name in _IMAGE_VAE_CLASSES:
        return cls, False
    named_video = any(marker in class_name for marker in _VIDEO_NAME_MARKERS)
    return cls, named_video or any(key in config for key in _VIDEO_CONFIG_KEYS)


def build_vae(
    kind: str,
    path: str | None = None,
    subfolder: str | None = None,
    scaling_factor: float | None = None,
    micro_batch: int = 16,
    dtype: torch.dtype = torch.float32,
    temporal_micro_batch: int = 4,
    sample_posterior: bool = False,
) -> nn.Module:
    """Build a frozen VAE adapter.

    ``kind='identity'``: :class:`IdentityVAE`; ``'space-to-depth'``: :class:`SpaceToDepthVAE`
    (``path`` is ignored).
    ``kind='diffusers'``: load the local diffusers model at ``path``/``subfolder``; the
    class named by ``_class_name`` in its config.json picks :class:`Diffusers2DVAE` or
    :class:`Diffusers3DVAE` (explicit tables above, then the name/config fallback).
    ``scaling_factor`` overrides the config's value.
    A family's own kind (``opensora-v1.2``, ``wan2.1``): built by its spec
    (``ModelSpec.build_vae``), with the normalisation of its release.
    ``micro_batch``: frames per (SD-)VAE pass; ``temporal_micro_batch``: 17-frame pieces per
    pass of Open-Sora's temporal VAE. ``sample_posterior``: encode to a posterior sample, for
    the adapters that can (a ``sample_posterior`` attribute: ``vae.kind=hunyuan``).
    """
    if sample_posterior and kind in OWN_VAE_KINDS:
        raise UserError(f"vae.sample_posterior=true does not apply to vae.kind={kind} (only to vae.kind=hunyuan); "
                        "set it to false")
    if kind in WEIGHT_FREE_VAE_KINDS:
        return (IdentityVAE if kind == "identity" else SpaceToDepthVAE)(1.0 if scaling_factor is None else scaling_factor)
    family = encoder_spec("vae_kinds", kind)
    if family is not None:   # a family's own VAE (Open-Sora 1.2's, Wan's): its spec builds it
        vae = family.build_vae(kind, path, subfolder, scaling_factor=scaling_factor, micro_batch=micro_batch,
                               temporal_micro_batch=temporal_micro_batch, dtype=dtype)
        if sample_posterior:   # an option of the adapter, not of every family's build_vae
            if not hasattr(vae, "sample_posterior"):
                raise UserError(f"vae.sample_posterior=true does not apply to vae.kind={kind} (only to "
                                "vae.kind=hunyuan); set it to false")
            vae.sample_posterior = True
        return vae
    if kind != "diffusers":
        raise UserError(f"vae.kind={kind!r} is not supported; choose one of: {', '.join(vae_kinds())}")

    config = _read_model_config(path, subfolder)
    where = _where(path, subfolder)
    cls, is_video = _vae_class(config, where)
    try:
        model = cls.from_pretrained(
            str(Path(path).expanduser()),
            subfolder=subfolder,
            local_files_only=True,
            torch_dtype=dtype,
        )
    except (OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot load the VAE from {where}: {first_line}") from None
    adapter = Diffusers3DVAE if is_video else Diffusers2DVAE
    return adapter(model, scaling_factor=scaling_factor, micro_batch=micro_batch)


__all__ = [
    "vae_kinds",
    "FrozenVAE",
    "IdentityVAE",
    "Diffusers2DVAE",
    "Diffusers3DVAE",
    "build_vae",
]
