"""``vae.kind=hunyuan``: the HunyuanVideo causal VAE that Open-Sora 2.0 trains its 11B model
on, as a frozen VAE adapter around diffusers' ``AutoencoderKLHunyuanVideo``.

Open-Sora's ``AutoencoderKLCausal3D`` (``opensora/models/hunyuan_vae``) and diffusers' class
hold the same tensors under the same names, so ``vae.path`` is either

* Open-Sora's ``hunyuan_vae.safetensors`` (one file; its architecture is read off the tensors,
  with the release's 32 norm groups, 8x space and 4x time, which the tensors do not show), or
* a diffusers folder (``hunyuanvideo-community/HunyuanVideo`` with ``vae.subfolder=vae``):
  ``config.json`` plus ``diffusion_pytorch_model.safetensors``.

Both load strictly. What Open-Sora's configs do, videodit does (``configs/diffusion/train/*.py``,
``inference/256px.py``): latents = 0.476986 * (z - 0); frames 4k+1, sides multiples of 8;
spatial tiles of 256 px every 192 px, blended over 64 px (Open-Sora's ``use_spatial_tiling``,
which equals diffusers' tiling at these sizes); no temporal tiling (diffusers' framewise
encoding is switched off). Open-Sora's training samples the posterior (``encode`` defaults to
``sample_posterior=True``); videodit takes the mode unless ``vae.sample_posterior`` is set.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor, nn

from videodit.errors import UserError
from videodit.models.mmdit.vae_files import RELEASE_FILES, read_safetensors
from videodit.models.vae_base import FrozenVAE, load_strict
from videodit.user_files import read_user_json

SCALE_FACTOR = 0.476986   # AutoEncoder3DConfig.scale_factor; shift_factor is 0
SPATIAL_TILE = 256        # sample_size: tiles of 256 px ...
TILE_OVERLAP = 0.25       # ... overlapping by a quarter (tile_overlap_factor)
WEIGHTS_FILE = "diffusion_pytorch_model.safetensors"


class HunyuanVAE(FrozenVAE):
    """The adapter around a loaded ``AutoencoderKLHunyuanVideo``.

    ``micro_batch`` bounds memory as the other video adapters do (``max(1, micro_batch // T)``
    clips per pass). ``sample_posterior``: ``encode`` draws ``mean + std * noise`` from the
    ``generator`` it is given (the trainer's, seeded by the batch), one draw for the whole batch, so
    the latents do not depend on ``micro_batch``; without a generator (validation, ``cache build``,
    sampling's references) it gives the mode.
    """

    def __init__(self, vae: nn.Module, scaling_factor: float = SCALE_FACTOR, micro_batch: int = 16,
                 sample_posterior: bool = False, spatial_tile: int = SPATIAL_TILE, overlap: float = TILE_OVERLAP):
        super().__init__()
        if not scaling_factor > 0:
            raise UserError(f"vae.scaling_factor must be positive, got {scaling_factor}")
        self.vae = vae
        cfg = vae.config
        self.latent_channels = int(cfg.latent_channels)
        self.spatial_compression = int(cfg.spatial_compression_ratio)
        self.temporal_compression = int(cfg.temporal_compression_ratio)
        self.scaling_factor = float(scaling_factor)
        self.micro_batch = max(1, int(micro_batch))
        self.sample_posterior = bool(sample_posterior)
        # Open-Sora tiles space only; diffusers would also cut clips over 16 frames in time.
        vae.use_framewise_encoding = vae.use_framewise_decoding = False
        stride = int(spatial_tile * (1 - overlap))
        if stride % self.spatial_compression:
            raise ValueError(f"spatial tile {spatial_tile} with overlap {overlap} does not start tiles on latents")
        vae.enable_tiling(tile_sample_min_height=spatial_tile, tile_sample_min_width=spatial_tile,
                          tile_sample_stride_height=stride, tile_sample_stride_width=stride)
        self._freeze()

    def latent_size(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        r, s = self.temporal_compression, self.spatial_compression
        if num_frames < 1 or (num_frames - 1) % r:
            lower = max(1, (num_frames - 1) // r * r + 1)
            nearest = f"{lower} or {lower + r}" if lower < num_frames else f"{lower}"
            raise UserError(f"num_frames={num_frames} does not fit HunyuanVideo's causal VAE, which needs {r}k+1 "
                            f"frames (nearest: {nearest}); change the clip length")
        return (num_frames - 1) // r + 1, height // s, width // s

    def num_frames_for(self, latent_frames: int) -> int:
        """Pixel frames that ``decode`` returns for ``latent_frames`` latent frames."""
        return 1 + (latent_frames - 1) * self.temporal_compression

    @torch.no_grad()
    def posterior(self, video: Tensor) -> tuple[Tensor, Tensor]:
        """The posterior's mean and standard deviation (unscaled, in the VAE's dtype)."""
        per_pass = max(1, self.micro_batch // video.shape[2])
        parts = [self.vae.encode(clips).latent_dist for clips in video.split(per_pass)]
        return torch.cat([p.mean for p in parts]), torch.cat([p.std for p in parts])

    @torch.no_grad()
    def encode(self, video: Tensor, generator: torch.Generator | None = None) -> Tensor:
        self._check_input(video)
        b, _, t, h, w = video.shape
        size = self.latent_size(t, h, w)
        mean, std = self.posterior(video.to(device=self.device, dtype=self.dtype))
        z = mean
        if self.sample_posterior and generator is not None:   # training's encode; validation, caches: the mode
            noise = torch.randn(mean.shape, generator=generator, device=generator.device, dtype=mean.dtype)
            z = mean + std * noise.to(mean.device)
        latents = self.scaling_factor * z.float()   # Open-Sora: scale * (z - shift), shift 0
        if latents.shape != (b, self.latent_channels, *size):   # a misread config would mis-size the model
            raise RuntimeError(f"the Hunyuan VAE encoded {tuple(video.shape)} to {tuple(latents.shape)}, not {size}")
        return latents

    @torch.no_grad()
    def decode(self, latents: Tensor, num_frames: int | None = None) -> Tensor:
        if latents.ndim != 5 or latents.shape[1] != self.latent_channels:
            raise ValueError(f"expected latents [B,{self.latent_channels},T',H',W'], got {tuple(latents.shape)}")
        self._check_num_frames(latents, num_frames)
        z = (latents.to(self.device).float() / self.scaling_factor).to(self.dtype)
        per_pass = max(1, self.micro_batch // self.num_frames_for(latents.shape[2]))
        video = torch.cat([self.vae.decode(part).sample for part in z.split(per_pass)])
        return video.float().clamp(-1.0, 1.0)


# --------------------------------------------------------------------------- loading


def hunyuan_config_from_tensors(shapes: dict[str, tuple[int, ...]]) -> dict:
    """``AutoencoderKLHunyuanVideo``'s arguments read off Open-Sora's tensors; norm groups,
    activation and compression are the release's (the tensors do not show them)."""
    blocks = sorted({int(m.group(1)) for n in shapes for m in [re.match(r"encoder\.down_blocks\.(\d+)\.", n)] if m})
    if not blocks or blocks != list(range(len(blocks))):
        raise KeyError("encoder.down_blocks.0.*")
    layers = len({m.group(1) for n in shapes for m in [re.match(r"encoder\.down_blocks\.0\.resnets\.(\d+)\.", n)] if m})
    widths = [shapes[f"encoder.down_blocks.{i}.resnets.0.conv2.conv.weight"][0] for i in blocks]
    return {"in_channels": shapes["encoder.conv_in.conv.weight"][1],
            "out_channels": shapes["decoder.conv_out.conv.weight"][0],
            "latent_channels": shapes["post_quant_conv.weight"][0],
            "block_out_channels": list(widths), "layers_per_block": layers, "norm_num_groups": 32,
            "act_fn": "silu", "scaling_factor": SCALE_FACTOR, "spatial_compression_ratio": 8,
            "temporal_compression_ratio": 4,
            "mid_block_add_attention": any(n.startswith("encoder.mid_block.attentions.") for n in shapes)}


def _load_file(file: Path, where: str, dtype: torch.dtype) -> nn.Module:
    from diffusers import AutoencoderKLHunyuanVideo

    release = RELEASE_FILES["hunyuan"]
    state = read_safetensors(file, where, release)
    if any(n.startswith("encoder.project_in.") for n in state):
        raise UserError(f"{where} holds Open-Sora's Video DC-AE, not the Hunyuan VAE; set vae.kind=opensora-dc-ae")
    try:
        config = hunyuan_config_from_tensors({k: tuple(v.shape) for k, v in state.items()})
    except (KeyError, IndexError) as exc:
        raise UserError(f"{where}: tensor {exc} is missing; is this Open-Sora's {release}?") from None
    with torch.device("meta"):
        model = AutoencoderKLHunyuanVideo(**config)
    load_strict(model, {k: v.to(dtype) for k, v in state.items()}, where=where,
                stranger="is not part of the Hunyuan VAE", fix=f"is this Open-Sora's {release}?")
    return model


def _load_folder(folder: Path, where: str, dtype: torch.dtype) -> tuple[nn.Module, dict]:
    from diffusers import AutoencoderKLHunyuanVideo

    if not (folder / "config.json").is_file():
        hint = ("it has a vae/ folder: set vae.subfolder=vae" if (folder / "vae" / "config.json").is_file()
                else f"point vae.path to {RELEASE_FILES['hunyuan']} or to a diffusers VAE folder")
        raise UserError(f"{where} has no config.json; {hint}")
    try:
        config = read_user_json(folder / "config.json")
    except (OSError, ValueError) as exc:
        raise UserError(f"{where}: cannot read config.json ({exc}); fix or replace it") from None
    name = config.get("_class_name") if isinstance(config, dict) else None
    if name != "AutoencoderKLHunyuanVideo":
        raise UserError(f"{where} holds _class_name={name!r}, not AutoencoderKLHunyuanVideo; point vae.path to "
                        f"HunyuanVideo's VAE folder or to {RELEASE_FILES['hunyuan']}")
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise UserError(f"{where} has no {WEIGHTS_FILE}; save the VAE with save_pretrained (safetensors)")
    try:
        with torch.device("meta"):
            model = AutoencoderKLHunyuanVideo.from_config(config)
    except (TypeError, ValueError) as exc:
        raise UserError(f"{where}: config.json does not build AutoencoderKLHunyuanVideo ({exc}); fix it") from None
    state = read_safetensors(weights, f"{where} ({WEIGHTS_FILE})", RELEASE_FILES["hunyuan"])
    load_strict(model, {k: v.to(dtype) for k, v in state.items()}, where=f"{where} ({WEIGHTS_FILE})",
                stranger="is not part of the Hunyuan VAE", fix="is this HunyuanVideo's VAE?")
    return model, config


def build_hunyuan_vae(target: Path, where: str, *, scaling_factor=None, micro_batch: int = 16,
                      dtype: torch.dtype = torch.float32, sample_posterior: bool = False) -> HunyuanVAE:
    """The adapter from Open-Sora's ``hunyuan_vae.safetensors`` or a diffusers folder."""
    if target.is_file():
        model, config = _load_file(target, where, dtype), {}
    elif target.is_dir():
        model, config = _load_folder(target, where, dtype)
    else:
        raise UserError(f"{where} does not exist: point vae.path to Open-Sora 2.0's {RELEASE_FILES['hunyuan']} or "
                        "to a diffusers AutoencoderKLHunyuanVideo folder (nothing is downloaded)")
    scale = scaling_factor if scaling_factor is not None else config.get("scaling_factor", SCALE_FACTOR)
    return HunyuanVAE(model, float(scale), micro_batch=micro_batch, sample_posterior=sample_posterior)


__all__ = ["HunyuanVAE", "SCALE_FACTOR", "build_hunyuan_vae", "hunyuan_config_from_tensors"]
