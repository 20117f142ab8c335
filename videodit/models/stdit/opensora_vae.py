"""Open-Sora 1.2's VAE (``VideoAutoencoderPipeline``, ``hpcai-tech/OpenSora-VAE-v1.2``) as a
frozen VAE adapter: ``vae.kind=opensora-v1.2``, ``vae.path`` = the released folder.

Encoding, as Open-Sora does it:

1. every frame through an SD-VAE (diffusers ``AutoencoderKL``, SDXL architecture), times the
   hard-coded 0.18215 of Open-Sora's ``VideoAutoencoderKL`` (not the SDXL config's 0.13025);
2. the clip cut into pieces of 17 frames (the last may be shorter), each through the temporal
   VAE (``models/stdit/temporal_vae.py``), which front-pads it to a multiple of 4 frames and
   compresses time 4x;
3. per channel ``(z - shift) / scale``, both tensors of the checkpoint.

Open-Sora samples both posteriors; this adapter takes their means (deterministic, like every
adapter). Decoding runs the steps backwards and needs the clip's frame count, since the rule
of step 2 cannot be inverted. The folder is read, never executed: ``config.json`` (Open-Sora's
``VideoAutoencoderPipelineConfig``) and ``model.safetensors`` (``spatial_vae.module.*``,
``temporal_vae.*``, ``scale``, ``shift``). The released config does not describe the SD-VAE, so
its architecture is SDXL's unless ``spatial_vae/config.json`` (a diffusers config) is present.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from videodit.errors import UserError
from videodit.models.stdit.temporal_vae import TemporalVAE, TemporalVAEConfig, clip_pieces, latent_frames
from videodit.models.vae_base import FrozenVAE, load_strict
from videodit.user_files import check_regular_file, read_user_json

# Open-Sora's VideoAutoencoderKL multiplies SD-VAE latents by this, whatever the SD-VAE's config says.
SD_SCALE = 0.18215

# The SD-VAE Open-Sora 1.2 was trained with (PixArt-alpha/pixart_sigma_sdxlvae_T5_diffusers, vae/).
SDXL_VAE_CONFIG = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "norm_num_groups": 32,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "sample_size": 1024,
}

SPATIAL_PREFIX, TEMPORAL_PREFIX = "spatial_vae.module.", "temporal_vae."


class OpenSoraVAE(FrozenVAE):
    """The adapter: SD-VAE per frame, temporal VAE per ``chunk`` frames, shift/scale.

    Memory is bounded by ``micro_batch`` frames per SD-VAE pass and ``temporal_micro_batch``
    pieces per temporal-VAE pass (pieces of all clips in the batch are folded together), not
    by the clip length. Measured in fp32 at 360p (activations): the SD-VAE needs 0.55 GiB per
    frame to encode (0.66 to decode), the temporal VAE 0.35 GiB per 17-frame piece.
    Any frame size of at least 8 pixels works: the SD-VAE floors it (426 -> 53 latents),
    so decoding returns multiples of 8 (424).
    """

    any_frame_size = True

    def __init__(self, spatial: nn.Module, temporal: TemporalVAE, shift: Tensor, scale: Tensor,
                 chunk: int | None = 17, micro_batch: int = 16, temporal_micro_batch: int = 4):
        super().__init__()
        self.spatial, self.temporal = spatial, temporal
        self.register_buffer("shift", _broadcastable(shift))
        self.register_buffer("scale", _broadcastable(scale))
        self.chunk = chunk
        self.micro_batch, self.temporal_micro_batch = max(1, micro_batch), max(1, temporal_micro_batch)
        self.latent_channels = temporal.cfg.embed_dim
        self.spatial_compression = 2 ** (len(spatial.config.block_out_channels) - 1)
        self.temporal_compression = temporal.time_factor
        self._freeze()

    def latent_size(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        s = self.spatial_compression
        return latent_frames(num_frames, self.chunk, self.temporal_compression), height // s, width // s

    @torch.no_grad()
    def encode(self, video: Tensor) -> Tensor:
        self._check_input(video)
        frames = _frames(video)
        sd = torch.cat([self.spatial.encode(part.to(self.device, self.dtype)).latent_dist.mode() * SD_SCALE
                        for part in frames.split(self.micro_batch)])
        sd = _clips(sd, video.shape[0])
        pieces = clip_pieces(sd.shape[2], self.chunk)
        z = _piecewise(sd, pieces, pieces, lambda x, _: self.temporal.encode(x), self.temporal_micro_batch)
        return (z.float() - self.shift.float()) / self.scale.float()

    @torch.no_grad()
    def decode(self, latents: Tensor, num_frames: int | None = None) -> Tensor:
        if num_frames is None:
            raise ValueError("Open-Sora 1.2's VAE needs num_frames to decode: several clip lengths give the "
                             f"same {latents.shape[2]} latent frames")
        self._check_num_frames(latents, num_frames)
        z = latents.to(self.device).float() * self.scale.float() + self.shift.float()
        pieces = clip_pieces(num_frames, self.chunk)
        sizes = [latent_frames(n, None, self.temporal_compression) for n in pieces]
        sd = _piecewise(z.to(self.dtype), sizes, pieces, self.temporal.decode, self.temporal_micro_batch)
        frames = [self.spatial.decode(part / SD_SCALE).sample for part in _frames(sd).split(self.micro_batch)]
        return _clips(torch.cat(frames).float().clamp(-1.0, 1.0), latents.shape[0])


def _broadcastable(stats: Tensor) -> Tensor:
    """Per-channel stats as [1, C, 1, 1, 1] (a scalar stays a scalar)."""
    stats = stats.detach().float()
    return stats.reshape(1, -1, 1, 1, 1) if stats.numel() > 1 else stats.reshape(())


def _frames(video: Tensor) -> Tensor:
    """[B, C, T, H, W] -> [B*T, C, H, W]."""
    b, c, t, h, w = video.shape
    return video.transpose(1, 2).reshape(b * t, c, h, w)


def _clips(frames: Tensor, batch: int) -> Tensor:
    """[B*T, C, H, W] -> [B, C, T, H, W]."""
    return frames.reshape(batch, -1, *frames.shape[1:]).transpose(1, 2).contiguous()


def _piecewise(x: Tensor, sizes: list[int], args: list[int], fn: Callable[[Tensor, int], Tensor],
               micro_batch: int) -> Tensor:
    """``fn(piece, arg)`` for each time piece of ``x`` [B, C, T, ...] (lengths ``sizes``), joined
    along time in order. Pieces with the same length and argument are folded into the batch
    (a 102-frame clip is six 17-frame pieces: one pass, not six), ``micro_batch`` at a time."""
    batch, pieces = x.shape[0], x.split(sizes, dim=2)
    groups: dict[tuple[int, int], list[int]] = {}
    for index, key in enumerate(zip(sizes, args)):
        groups.setdefault(key, []).append(index)
    out: list[Tensor] = [x] * len(pieces)
    for (_, arg), members in groups.items():
        folded = torch.cat([pieces[i] for i in members])
        result = torch.cat([fn(part, arg) for part in folded.split(micro_batch)])
        for k, i in enumerate(members):
            out[i] = result[k * batch:(k + 1) * batch]
    return torch.cat(out, dim=2)


# --------------------------------------------------------------------------- loading


def _read_json(path: Path, what: str) -> dict:
    try:
        data = read_user_json(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {what} {path} ({exc}); fix or replace it") from None
    if not isinstance(data, dict):
        raise UserError(f"{what} {path} is not a JSON object; fix or replace it")
    return data


def _temporal_config(entry: object, where: str) -> TemporalVAEConfig:
    """``vae_temporal`` of the pipeline config: ``VAE_Temporal_SD`` (the released architecture,
    which only lets num_groups / activation_fn change) or ``VAE_Temporal`` with its arguments."""
    entry = dict(entry) if isinstance(entry, dict) else {}
    kind = entry.pop("type", "VAE_Temporal_SD")
    entry.pop("from_pretrained", None)   # weights come from model.safetensors
    if kind == "VAE_Temporal_SD":
        base, allowed = TemporalVAEConfig(), {"num_groups", "activation_fn"}
    elif kind == "VAE_Temporal":   # its own defaults differ from _SD's in temporal_downsample
        base = TemporalVAEConfig(temporal_downsample=(True, True, False))
        allowed = set(TemporalVAEConfig.__annotations__)
    else:
        raise UserError(f"{where}: vae_temporal type {kind!r} is not VAE_Temporal_SD or VAE_Temporal")
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise UserError(f"{where}: vae_temporal ({kind}) has unsupported arguments {', '.join(unknown)}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in entry.items()}
    return TemporalVAEConfig(**{**base.__dict__, **values})


def _folder(path: str | None, subfolder: str | None) -> tuple[Path, str]:
    """The VAE folder and how error messages name it."""
    download = "point vae.path to the downloaded hpcai-tech/OpenSora-VAE-v1.2 folder (nothing is downloaded)"
    if not path or not str(path).strip():
        raise UserError(f"vae.path is required for vae.kind=opensora-v1.2: {download}")
    folder = Path(path).expanduser() / (subfolder or "")
    where = f"vae.path='{path}'" + (f" (vae.subfolder='{subfolder}')" if subfolder else "")
    if not folder.is_dir():
        raise UserError(f"{where} is not an existing folder: {download}")
    if not (folder / "config.json").is_file():
        raise UserError(f"{where} has no config.json: {download}")
    return folder, where


def _pipeline_config(folder: Path, where: str) -> tuple[int | None, TemporalVAEConfig]:
    """The piece length (``micro_frame_size``) and temporal VAE of Open-Sora's config.json."""
    config = _read_json(folder / "config.json", "the VAE config")
    if config.get("model_type") != "VideoAutoencoderPipeline":
        raise UserError(f"{where}: config.json has model_type={config.get('model_type')!r}, not "
                        "'VideoAutoencoderPipeline' (Open-Sora 1.2's VAE); for a diffusers VAE use vae.kind=diffusers")
    chunk = config.get("micro_frame_size")
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise UserError(f"{where}: config.json has micro_frame_size={chunk!r}; it must be a positive integer or null")
    return chunk, _temporal_config(config.get("vae_temporal"), where)


def _checkpoint(folder: Path, where: str) -> dict[str, Tensor]:
    weights = folder / "model.safetensors"
    if not weights.is_file():
        pickled = sorted(p.name for p in folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" ({', '.join(pickled)} is a pickle, which videodit does not load: convert it to safetensors)" \
            if pickled else ""
        raise UserError(f"{where} has no model.safetensors{hint}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(str(check_regular_file(weights)))
    except (OSError, SafetensorError) as exc:
        raise UserError(f"cannot read {weights} ({exc}); fix or replace it") from None


def _normalisation(tensors: dict[str, Tensor], channels: int, where: str) -> tuple[Tensor, Tensor]:
    """The checkpoint's ``shift`` and ``scale``: the only tensors besides the two VAEs."""
    others = {k for k in tensors if not k.startswith((SPATIAL_PREFIX, TEMPORAL_PREFIX))}
    extra, missing = sorted(others - {"scale", "shift"}), sorted({"scale", "shift"} - others)
    if extra or missing:
        problem = f"tensor {extra[0]} is not part of Open-Sora 1.2's VAE" if extra else \
            f"tensor {missing[0]} is missing"
        raise UserError(f"{where}: {problem} ({len(extra) + len(missing)} such tensors); is this "
                        "hpcai-tech/OpenSora-VAE-v1.2?")
    for name in ("scale", "shift"):
        if tensors[name].numel() not in (1, channels):
            raise UserError(f"{where}: tensor {name} has {tensors[name].numel()} values for {channels} latent channels")
    return tensors["shift"], tensors["scale"]


def load_opensora_vae(path: str | None, subfolder: str | None = None, *, micro_batch: int = 16,
                      temporal_micro_batch: int = 4, dtype: torch.dtype = torch.float32) -> OpenSoraVAE:
    """The Open-Sora 1.2 VAE folder at ``path`` (/``subfolder``) as an :class:`OpenSoraVAE`."""
    folder, where = _folder(path, subfolder)
    chunk, temporal_cfg = _pipeline_config(folder, where)
    spatial_file = folder / "spatial_vae" / "config.json"
    if spatial_file.is_file():
        spatial_cfg, spatial_fix = _read_json(spatial_file, "the SD-VAE config"), f"fix {spatial_file}"
    else:
        spatial_cfg = SDXL_VAE_CONFIG
        spatial_fix = f"the SD-VAE is not SDXL's: put its diffusers config.json in {spatial_file.parent}/"
    tensors = _checkpoint(folder, where)
    try:
        from diffusers import AutoencoderKL   # heavy optional import, only needed here
    except ImportError:
        raise UserError("vae.kind=opensora-v1.2 needs the diffusers package: pip install 'videodit[hf]'") from None

    with torch.device("meta"):   # no random initialisation: every tensor comes from the checkpoint
        spatial = AutoencoderKL.from_config(dict(spatial_cfg))
        temporal = TemporalVAE(temporal_cfg)
    if spatial.config.latent_channels != temporal_cfg.in_out_channels:
        raise UserError(f"{where}: the SD-VAE has {spatial.config.latent_channels} latent channels but the temporal "
                        f"VAE takes {temporal_cfg.in_out_channels}; {spatial_fix}")
    load_strict(spatial, tensors, prefix=SPATIAL_PREFIX, where=where, fix=spatial_fix)
    load_strict(temporal, tensors, prefix=TEMPORAL_PREFIX, where=where, fix="fix vae_temporal in config.json")
    shift, scale = _normalisation(tensors, temporal_cfg.embed_dim, where)
    vae = OpenSoraVAE(spatial, temporal, shift, scale, chunk=chunk, micro_batch=micro_batch,
                      temporal_micro_batch=temporal_micro_batch)
    return vae.to(dtype)


__all__ = ["OpenSoraVAE", "SDXL_VAE_CONFIG", "SD_SCALE", "load_opensora_vae"]
