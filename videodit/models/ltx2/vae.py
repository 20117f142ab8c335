"""``vae.kind: ltx2``: LTX-2's video VAE through diffusers' ``AutoencoderKLLTX2Video``.

128 latent channels, 8 x 32 x 32 compression, a causal encoder: a clip of 8k + 1 frames (the first
alone, then 8 per latent frame) whose height and width are multiples of 32; any other clip is
refused in one line (ltx-core would crop frames, diffusers would mis-size them). ``encode`` gives
what ltx-core's ``VideoEncoder`` gives: the posterior MEANS normalised per channel,
(mean - mean-of-means) / std-of-means (diffusers' ``latents_mean`` / ``latents_std``; times
``vae.scaling_factor``, 1 unless set); ``decode`` un-normalises and decodes, clamped to [-1, 1].

``vae.path`` (joined with ``vae.subfolder``) is either

- a diffusers ``AutoencoderKLLTX2Video`` folder (config.json + weights), or a diffusers LTX-2
  folder with it in ``vae/``; or
- the single-file release (``ltx-2-19b-*.safetensors``, ``ltx-2.3-22b-*.safetensors``): its
  metadata ``config["vae"]`` (ltx-core's block lists) is translated into diffusers' config and
  its ``vae.*`` tensors renamed as diffusers' converter renames them, block by block, read
  lazily and loaded strictly (a missing or mis-shaped tensor is one line naming it). The DiT,
  the text side, the audio VAE and the vocoder in the file are never read.

Not built: a timestep-conditioned or noise-injecting decoder (LTX-Video 0.9's; the LTX-2
releases have none), LTX-2.5's diffusion decoder, group-norm VAEs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from videodit.errors import UserError
from videodit.models.vae_base import FrozenVAE, load_strict
from videodit.models.weight_files import ConfigValues, LazyTensors, build_bounded, open_safetensors, read_json

VAE_KINDS = ("ltx2",)
CLASS_NAME = "AutoencoderKLLTX2Video"
PREFIX = "vae."
# ltx-core's block names -> diffusers' down/upsample types
_DOWN = {"compress_space_res": "spatial", "compress_time_res": "temporal", "compress_all_res": "spatiotemporal"}
_UP = {"compress_space": "spatial", "compress_time": "temporal", "compress_all": "spatiotemporal"}
_IGNORED = ("per_channel_statistics.channel", "per_channel_statistics.mean-of-stds")   # diffusers drops them too
_STATS = {"per_channel_statistics.mean-of-means": "latents_mean", "per_channel_statistics.std-of-means": "latents_std"}


# ----------------------------------------------------------------------------- the release's config

def _blocks(config: dict, key: str, where: str, kinds: dict) -> list[tuple[str, dict]]:
    """An ltx-core block list [[name, params], ...] as res_x, (compress, res_x)*: (name, params) pairs."""
    value = config.get(key)
    fix = (f"{where}: vae.{key} is not a list of res_x blocks with one {'/'.join(kinds)} between each two, as "
           "the LTX-2 releases have; videodit builds no other VAE")
    if not isinstance(value, list) or len(value) % 2 == 0:
        raise UserError(fix)
    out = []
    for i, block in enumerate(value):
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and isinstance(block[0], str)):
            raise UserError(fix)
        name, params = block
        params = {"num_layers": params} if isinstance(params, int) else params
        if not isinstance(params, dict) or name != ("res_x" if i % 2 == 0 else name) or \
                (i % 2 and name not in kinds) or params.get("inject_noise", False):
            raise UserError(fix)
        out.append((name, params))
    return out


def _count(params: dict, key: str, default: int, where: str, high: int = 64) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise UserError(f"{where}: a VAE block's {key}={value!r} is not a whole number from 1 to {high}; restore "
                        "the release file")
    return value


def diffusers_config(vae: dict, where: str) -> dict:
    """diffusers' AutoencoderKLLTX2Video config for ltx-core's ``config["vae"]``, read with
    ltx-core's defaults (``video_vae/model_configurator.py``)."""
    if not isinstance(vae, dict) or vae.get("_class_name", "CausalVideoAutoencoder") != "CausalVideoAutoencoder" \
            or "encoder" in vae:
        raise UserError(f"{where}: the metadata config's vae is not LTX-2's CausalVideoAutoencoder (LTX-2.5's "
                        "diffusion decoder is not built by videodit); pass an LTX-2.0 or 2.3 release file")
    v = ConfigValues(vae, f"{where} (metadata config.vae)", "restore the release file")
    for key, expected, default in (("dims", 3, 3), ("norm_layer", "pixel_norm", "pixel_norm"),
                                   ("latent_log_var", "uniform", "uniform"), ("timestep_conditioning", False, True)):
        if vae.get(key, default) != expected:
            raise UserError(f"{where}: vae.{key}={vae.get(key, default)!r} is not {expected!r}, as LTX-2's VAE has "
                            "(diffusers' AutoencoderKLLTX2Video builds no other); pass an LTX-2 release file")
    latent, patch = v.int("latent_channels", 128, high=4096), v.int("patch_size", 4, high=64)
    enc = _blocks(vae, "encoder_blocks", where, _DOWN)
    dec = list(reversed(_blocks(vae, "decoder_blocks", where, _UP)))
    channels, block_out, down = latent, [], []
    for name, params in enc[1::2]:
        channels *= _count(params, "multiplier", 2, where)
        block_out.append(channels)
        down.append(_DOWN[name])
    channels = _count(vae, "decoder_base_channels", 128, where, high=1 << 16)
    for _, params in dec[1::2]:
        channels *= _count(params, "multiplier", 1, where)
    up_out, up, residual, factor = [], [], [], []
    for name, params in dec[1::2]:   # from the latent end: each upsampler divides by its multiplier
        m = _count(params, "multiplier", 1, where)
        up_out.append(channels)      # = its output channels x its multiplier, as diffusers counts them
        channels //= m
        up.append(_UP[name])
        residual.append(bool(params.get("residual", False)))
        factor.append(m)
    encoder_padding = vae.get("spatial_padding_mode", vae.get("encoder_spatial_padding_mode", "zeros"))
    n_enc, n_dec = len(enc[1::2]), len(dec[1::2])
    return {"_class_name": CLASS_NAME, "in_channels": v.int("in_channels", 3, high=16),
            "out_channels": v.int("out_channels", 3, high=16), "latent_channels": latent,
            "block_out_channels": block_out, "down_block_types": ["LTX2VideoDownBlock3D"] * n_enc,
            "decoder_block_out_channels": up_out[::-1],
            "layers_per_block": [_count(p, "num_layers", 1, where) for _, p in enc[0::2]],
            "decoder_layers_per_block": [_count(p, "num_layers", 1, where) for _, p in dec[0::2]][::-1],
            "spatio_temporal_scaling": [True] * n_enc, "decoder_spatio_temporal_scaling": [True] * n_dec,
            # upsample_type is the one list diffusers reads from the latent end (it reverses the others)
            "decoder_inject_noise": [False] * (n_dec + 1), "downsample_type": down, "upsample_type": up,
            "upsample_residual": residual[::-1], "upsample_factor": factor[::-1], "timestep_conditioning": False,
            "patch_size": patch, "patch_size_t": 1, "resnet_norm_eps": 1e-6, "scaling_factor": 1.0,
            "encoder_causal": True, "decoder_causal": v.bool("causal_decoder", False),
            "encoder_spatial_padding_mode": encoder_padding,
            # diffusers would count every down block as 2x in space and time: say what they compress
            "spatial_compression_ratio": patch * 2 ** sum(d != "temporal" for d in down),
            "temporal_compression_ratio": 2 ** sum(d != "spatial" for d in down),
            "decoder_spatial_padding_mode": vae.get("spatial_padding_mode", "reflect")}


def diffusers_name(name: str, enc_blocks: int, dec_blocks: int) -> str | None:
    """A release's VAE tensor name (without ``vae.``) -> diffusers' (None: not read). Block ``j`` of
    ltx-core's flat lists is diffusers' block ``j // 2`` (its resnets for even ``j``, its
    down/upsampler for odd ``j``); the last encoder block and the first decoder one are the mid blocks."""
    if name in _STATS:
        return _STATS[name]
    if name.startswith(_IGNORED):
        return None
    part, rest = name.split(".", 1) if "." in name else (name, "")
    if part not in ("encoder", "decoder") or not rest.startswith(("down_blocks.", "up_blocks.")):
        return name
    _, index, tail = rest.split(".", 2)
    j, tail = int(index), tail.replace("res_blocks.", "resnets.", 1)
    if part == "encoder":
        if j == enc_blocks - 1:
            return f"encoder.mid_block.{tail}"
        return f"encoder.down_blocks.{j // 2}." + (tail if j % 2 == 0 else f"downsamplers.0.{tail}")
    if j == 0:
        return f"decoder.mid_block.{tail}"
    return f"decoder.up_blocks.{(j - 1) // 2}." + (f"upsamplers.0.{tail}" if j % 2 else tail)


def release_vae_config(file: Path) -> dict:
    metadata = open_safetensors(file).metadata() or {}
    try:
        return json.loads(metadata["config"])["vae"]
    except (KeyError, TypeError, ValueError, RecursionError):
        raise UserError(f"{file} has no vae config in its safetensors metadata; pass the LTX-2 release file as "
                        "downloaded, or a diffusers AutoencoderKLLTX2Video folder") from None


def load_release_vae(file: Path, dtype: torch.dtype):
    """diffusers' AutoencoderKLLTX2Video holding the release file's ``vae.*`` tensors."""
    from diffusers import AutoencoderKLLTX2Video

    vae = release_vae_config(file)
    config = diffusers_config(vae, str(file))
    enc, dec = len(vae["encoder_blocks"]), len(vae["decoder_blocks"])
    sources = {}
    for key in open_safetensors(file).keys():
        if key.startswith(PREFIX):
            name = diffusers_name(key[len(PREFIX):], enc, dec)
            if name is not None:
                sources[name] = (file, key)
    if not sources:
        raise UserError(f"{file} holds no vae.* tensors; pass a release file with its VAE, or a diffusers "
                        "AutoencoderKLLTX2Video folder")
    config = {k: v for k, v in config.items() if k != "_class_name"}
    model = build_bounded(lambda: AutoencoderKLLTX2Video(**config), len(sources),
                          f"{file}: its metadata vae config describes a VAE far larger than its {len(sources)} vae.* "
                          "tensors; restore the release file")
    tensors = LazyTensors(sources)
    load_strict(model, {k: tensors[k].to(dtype) for k in tensors}, where=str(file),
                fix="pass an LTX-2 release file as downloaded", stranger="is not part of the VAE its config describes")
    return model


# ----------------------------------------------------------------------------- the adapter

class LTX2VAE(FrozenVAE):
    """A frozen AutoencoderKLLTX2Video: normalised posterior means, 8k+1 frames, 32-pixel multiples."""

    def __init__(self, vae, scaling_factor: float | None = None, micro_batch: int = 16):
        super().__init__()
        self.vae = vae
        self.latent_channels = int(vae.config.latent_channels)
        self.spatial_compression = int(vae.spatial_compression_ratio)
        self.temporal_compression = int(vae.temporal_compression_ratio)
        self.scaling_factor = float(scaling_factor if scaling_factor is not None else vae.config.scaling_factor)
        self.micro_batch = max(1, int(micro_batch))
        self._freeze()

    def latent_size(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        s = self.spatial_compression
        return (num_frames - 1) // self.temporal_compression + 1, height // s, width // s

    def _stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        shape = (1, -1, 1, 1, 1)
        return (self.vae.latents_mean.float().view(shape).to(like.device),
                self.vae.latents_std.float().view(shape).to(like.device))

    @torch.no_grad()
    def encode(self, video: Tensor) -> Tensor:
        self._check_input(video)
        frames, r = video.shape[2], self.temporal_compression
        if (frames - 1) % r:
            raise UserError(f"a clip of {frames} frames does not fit LTX-2's VAE, which takes {r}k + 1 frames (1, "
                            f"{r + 1}, {2 * r + 1}, ..., {6 * r + 1}, ...); change the clip length")
        video = video.to(device=self.device, dtype=self.dtype)
        per_chunk = max(1, self.micro_batch // frames)
        means = torch.cat([self.vae.encode(c).latent_dist.mode() for c in video.split(per_chunk)]).float()
        mean, std = self._stats(means)
        return (means - mean) / std * self.scaling_factor

    @torch.no_grad()
    def decode(self, latents: Tensor, num_frames: int | None = None) -> Tensor:
        self._check_num_frames(latents, num_frames)
        return self.decode_unclamped(latents).clamp(-1.0, 1.0)

    @torch.no_grad()
    def decode_unclamped(self, latents: Tensor) -> Tensor:
        """What the decoder gives (ltx-core's ``VideoDecoder`` output), before the clamp."""
        latents = latents.float().to(self.device)
        mean, std = self._stats(latents)
        z = (latents / self.scaling_factor * std + mean).to(self.dtype)
        per_chunk = max(1, self.micro_batch // (1 + (latents.shape[2] - 1) * self.temporal_compression))
        return torch.cat([self.vae.decode(c).sample for c in z.split(per_chunk)]).float()


def build_ltx2_vae(path, subfolder=None, *, scaling_factor=None, micro_batch: int = 16,
                   dtype: torch.dtype = torch.float32) -> LTX2VAE:
    """The ``vae.kind=ltx2`` adapter of ``path`` (+ ``subfolder``): module docstring."""
    if path is None or not str(path).strip():
        raise UserError("vae.path is required for vae.kind=ltx2: point it to the LTX-2 release file "
                        "(ltx-2-19b-*.safetensors / ltx-2.3-22b-*.safetensors) or a diffusers AutoencoderKLLTX2Video "
                        "folder (nothing is downloaded)")
    target = Path(path).expanduser() / (subfolder or "")
    where = f"vae.path='{path}'" + (f" (vae.subfolder='{subfolder}')" if subfolder else "")
    try:
        import diffusers  # noqa: F401
    except ImportError:
        raise UserError("vae.kind=ltx2 needs the diffusers package: pip install 'videodit[hf]'") from None
    if target.is_file():
        return LTX2VAE(load_release_vae(target, dtype), scaling_factor, micro_batch)
    if target.is_dir() and not (target / "config.json").is_file() and (target / "vae" / "config.json").is_file():
        target = target / "vae"
    if not (target / "config.json").is_file():
        raise UserError(f"{where} is neither an LTX-2 release file nor a folder with a diffusers VAE config.json; "
                        "point vae.path to one")
    config = read_json(target / "config.json")
    class_name = config.get("_class_name") if isinstance(config, dict) else None
    if class_name != CLASS_NAME:
        raise UserError(f"{where} holds _class_name={class_name!r}, not {CLASS_NAME}: vae.kind=ltx2 takes LTX-2's "
                        "video VAE")
    from diffusers import AutoencoderKLLTX2Video
    try:
        model = AutoencoderKLLTX2Video.from_pretrained(str(target), local_files_only=True, torch_dtype=dtype)
    except (OSError, ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"cannot load the VAE from {where}: {first}") from None
    return LTX2VAE(model, scaling_factor, micro_batch)


__all__ = ["VAE_KINDS", "LTX2VAE", "build_ltx2_vae", "diffusers_config", "diffusers_name"]
