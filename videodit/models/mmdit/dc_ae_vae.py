"""``vae.kind=opensora-dc-ae``: Open-Sora 2.0's Video DC-AE (``dc-ae-f32t4c128``) as a frozen
VAE adapter, computing what Open-Sora's ``DC_AE`` does with its training and inference configs
(``configs/diffusion/train/high_compression.py``): latents = encoder output / 0.493, spatial
tiles of 256 px and temporal tiles of 32 frames, overlapping by a quarter and blended.

Frames: 1 (an image: no temporal compression) or a multiple of 4 from 8 (T' = T / 4). Open-Sora's
buckets use 1 and 16..128; 4 frames would encode to one latent frame, which decodes to a single
frame, so videodit refuses them. Sides: multiples of 32.

One difference from Open-Sora, kept on purpose: when a temporally tiled decode would end with a
tile of a single latent frame (T' = 13, 19, 25, 31 with 8-frame tiles), Open-Sora decodes that
frame as an image and returns 3 frames too few; videodit leaves that tile out, since the tile
before it already reaches the end, and returns 4 T' frames.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from videodit.errors import UserError
from videodit.models.mmdit.dc_ae import DCAE, config_from_tensors
from videodit.models.mmdit.tiling import tile_space, tile_time
from videodit.models.mmdit.vae_files import RELEASE_FILES, read_safetensors
from videodit.models.vae_base import FrozenVAE, load_strict

SCALING_FACTOR = 0.493   # Open-Sora divides by it (DCAE.encode_single)
SPATIAL_TILE = 256       # pixels (configs: spatial_tile_size)
TEMPORAL_TILE = 32       # frames (temporal_tile_size)
TILE_OVERLAP = 0.25      # tile_overlap_factor


class OpenSoraDCAE(FrozenVAE):
    """The adapter around a loaded :class:`DCAE`. ``micro_batch``: clips per pass are
    ``max(1, micro_batch // T)`` (the network treats clips independently)."""

    def __init__(self, net: DCAE, scaling_factor: float = SCALING_FACTOR, micro_batch: int = 16,
                 spatial_tile: int = SPATIAL_TILE, temporal_tile: int = TEMPORAL_TILE, overlap: float = TILE_OVERLAP):
        super().__init__()
        if not scaling_factor > 0:
            raise UserError(f"vae.scaling_factor must be positive, got {scaling_factor}")
        self.net = net
        cfg = net.cfg
        self.latent_channels = cfg.latent_channels
        self.spatial_compression = s = cfg.spatial_compression
        self.temporal_compression = r = cfg.temporal_compression
        self.scaling_factor = float(scaling_factor)
        self.micro_batch = max(1, int(micro_batch))
        self.spatial_tile, self.temporal_tile = spatial_tile, temporal_tile
        # Open-Sora's tile arithmetic (DCAE.spatial_tiled_encode etc.), in pixels and latents.
        lat_s, lat_t = spatial_tile // s, temporal_tile // r
        self.space_encode = dict(size=spatial_tile, stride=int(spatial_tile * (1 - overlap)),
                                 blend=int(lat_s * overlap), keep=lat_s - int(lat_s * overlap))
        self.space_decode = dict(size=lat_s, stride=int(lat_s * (1 - overlap)),
                                 blend=int(spatial_tile * overlap), keep=spatial_tile - int(spatial_tile * overlap))
        self.time_encode = dict(size=temporal_tile, stride=int(temporal_tile * (1 - overlap)),
                                blend=int(lat_t * overlap), keep=lat_t - int(lat_t * overlap))
        self.time_decode = dict(size=lat_t, stride=int(lat_t * (1 - overlap)),
                                blend=int(temporal_tile * overlap), keep=temporal_tile - int(temporal_tile * overlap))
        for name, (tiles, step, unit) in {"spatial": (self.space_encode, self.space_decode, s),
                                          "temporal": (self.time_encode, self.time_decode, r)}.items():
            # Tiles must start on latent boundaries and keep exactly one stride each, else
            # the pieces would not add up to the whole (Open-Sora assumes its defaults).
            if tiles["stride"] % unit or tiles["keep"] * unit != tiles["stride"] or step["keep"] != step["stride"] * unit:
                raise ValueError(f"{name} tile {tiles['size']} with overlap {overlap} does not tile evenly")
        self._freeze()

    # ------------------------------------------------------------------ sizes

    def latent_size(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        r, s = self.temporal_compression, self.spatial_compression
        if num_frames != 1 and (num_frames % r or num_frames < 2 * r):
            lower = max(2 * r, num_frames // r * r)
            nearest = f"{lower} or {lower + r}" if lower < num_frames else f"{lower}"
            raise UserError(f"num_frames={num_frames} does not fit Open-Sora's Video DC-AE, which takes 1 frame or a "
                            f"multiple of {r} from {2 * r} (nearest: {nearest}); change the clip length")
        return (1 if num_frames == 1 else num_frames // r), height // s, width // s

    def num_frames_for(self, latent_frames: int) -> int:
        """Pixel frames that ``decode`` returns for ``latent_frames`` latent frames."""
        return 1 if latent_frames == 1 else latent_frames * self.temporal_compression

    # ------------------------------------------------------------------ tiled passes

    def _encode_clip(self, x: Tensor) -> Tensor:
        def space(tile: Tensor) -> Tensor:
            big = max(tile.shape[-2:]) > self.spatial_tile
            return tile_space(tile, self.net.encoder, **self.space_encode) if big else self.net.encoder(tile)
        if x.shape[2] > self.temporal_tile:
            return tile_time(x, space, **self.time_encode)
        return space(x)

    def _decode_clip(self, z: Tensor) -> Tensor:
        lat_s, lat_t = self.space_decode["size"], self.time_decode["size"]

        def space(tile: Tensor) -> Tensor:
            big = max(tile.shape[-2:]) > lat_s
            return tile_space(tile, self.net.decoder, **self.space_decode) if big else self.net.decoder(tile)
        if z.shape[2] > lat_t:
            return tile_time(z, space, **self.time_decode, min_last=2)
        return space(z)

    # ------------------------------------------------------------------ interface

    @torch.no_grad()
    def encode(self, video: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Latents ``encoder(video) / scaling_factor`` (``generator`` is accepted for the shared
        interface and unused: the DC-AE is deterministic)."""
        del generator
        self._check_input(video)
        b, _, t, h, w = video.shape
        size = self.latent_size(t, h, w)
        video = video.to(device=self.device, dtype=self.dtype)
        per_pass = max(1, self.micro_batch // t)
        z = torch.cat([self._encode_clip(part) for part in video.split(per_pass)])
        latents = z.float() / self.scaling_factor
        if latents.shape != (b, self.latent_channels, *size):
            raise RuntimeError(f"the DC-AE encoded {tuple(video.shape)} to {tuple(latents.shape)}, not {size}")
        return latents

    @torch.no_grad()
    def decode(self, latents: Tensor, num_frames: int | None = None) -> Tensor:
        if latents.ndim != 5 or latents.shape[1] != self.latent_channels:
            raise ValueError(f"expected latents [B,{self.latent_channels},T',H',W'], got {tuple(latents.shape)}")
        if num_frames is not None and self.num_frames_for(latents.shape[2]) != num_frames:
            raise ValueError(f"{latents.shape[2]} latent frames decode to {self.num_frames_for(latents.shape[2])} "
                             f"frames, not {num_frames}")
        z = (latents.to(self.device).float() * self.scaling_factor).to(self.dtype)
        per_pass = max(1, self.micro_batch // self.num_frames_for(latents.shape[2]))
        video = torch.cat([self._decode_clip(part) for part in z.split(per_pass)])
        return video.float().clamp(-1.0, 1.0)


def build_dc_ae(target: Path, where: str, *, scaling_factor=None, micro_batch: int = 16,
                dtype: torch.dtype = torch.float32) -> OpenSoraDCAE:
    """The adapter from ``F32T4C128_AE.safetensors`` (its architecture read off the tensors)."""
    release = RELEASE_FILES["opensora-dc-ae"]
    if target.is_dir():
        found = sorted(p.name for p in target.glob("*.safetensors"))
        hint = f"it holds {found[0]}: point vae.path to that file" if found else f"point vae.path to {release}"
        raise UserError(f"{where} is a folder; the Video DC-AE is one file ({release}): {hint}")
    if not target.is_file():
        raise UserError(f"{where} does not exist: point vae.path to Open-Sora 2.0's {release} (nothing is downloaded)")
    state = read_safetensors(target, where, release)
    if "encoder.conv_in.conv.weight" in state or "encoder.down_blocks.0.resnets.0.conv1.conv.weight" in state:
        raise UserError(f"{where} holds HunyuanVideo's VAE, not the Video DC-AE; set vae.kind=hunyuan")
    try:
        cfg = config_from_tensors({k: tuple(v.shape) for k, v in state.items()})
    except (KeyError, ValueError, IndexError) as exc:
        raise UserError(f"{where} is not Open-Sora's Video DC-AE ({exc}); point vae.path to {release}") from None
    with torch.device("meta"):
        net = DCAE(cfg)
    load_strict(net, {k: v.to(dtype) for k, v in state.items()}, where=where,
                stranger="is not part of the Video DC-AE", fix=f"is this Open-Sora's {release}?")
    return OpenSoraDCAE(net, SCALING_FACTOR if scaling_factor is None else scaling_factor, micro_batch=micro_batch)


__all__ = ["OpenSoraDCAE", "SCALING_FACTOR", "build_dc_ae"]
