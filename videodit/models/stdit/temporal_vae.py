"""Open-Sora 1.2's temporal VAE (``VAE_Temporal``): causal 3-D convolutions that compress the
frames of SD-VAE latents 4x (MAGVIT-v2 style), and the latent-frame rule that goes with it.

Written from the checkpoint's point of view: module names follow Open-Sora's state dict
(``encoder.block_res_blocks.1.0.conv1.conv.weight`` ...), so its ``temporal_vae.*`` tensors
load with ``strict=True``. Spatial sizes are never changed here; only time is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from videodit.models.vae_base import CHUNK_FRAMES, clip_pieces, latent_frames

# The released VAE (OpenSoraVAE_V1_2) encodes clips in chunks of 17 frames.
@dataclass(frozen=True)
class TemporalVAEConfig:
    """``VAE_Temporal``'s arguments; the defaults are the released ``VAE_Temporal_SD``."""
    in_out_channels: int = 4
    latent_embed_dim: int = 4
    embed_dim: int = 4
    filters: int = 128
    num_res_blocks: int = 4
    channel_multipliers: tuple[int, ...] = (1, 2, 2, 4)
    temporal_downsample: tuple[bool, ...] = (False, True, True)
    num_groups: int = 32
    activation_fn: str = "swish"

    @property
    def time_factor(self) -> int:
        return 2 ** sum(bool(d) for d in self.temporal_downsample)


class CausalConv3d(nn.Module):
    """A Conv3d that sees only current and past frames: ``k_t - stride_t`` zero frames in front,
    none behind; H and W are zero-padded by ``k // 2`` on both sides (size kept)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, time_stride: int = 1,
                 bias: bool = True):
        super().__init__()
        self.front = kernel_size - time_stride
        # H/W padding inside the conv (no padded copy of the input); time padding is one-sided.
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size, stride=(time_stride, 1, 1),
                              padding=(0, kernel_size // 2, kernel_size // 2), bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.front:
            x = F.pad(x, (0, 0, 0, 0, self.front, 0))
        return self.conv(x)


class ResBlock(nn.Module):
    """GroupNorm -> SiLU -> conv, twice, plus the input (through a 1x1x1 conv when the width
    changes). No conv biases, as in MAGVIT."""

    def __init__(self, in_channels: int, out_channels: int, groups: int, act: type[nn.Module]):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_channels)
        self.conv1 = CausalConv3d(in_channels, out_channels, 3, bias=False)
        self.norm2 = nn.GroupNorm(groups, out_channels)
        self.conv2 = CausalConv3d(out_channels, out_channels, 3, bias=False)
        self.conv3 = CausalConv3d(in_channels, out_channels, 1, bias=False) if in_channels != out_channels else None
        self.act = act()

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(self.act(self.norm1(x)))
        h = self.conv2(self.act(self.norm2(h)))
        return h + (self.conv3(x) if self.conv3 is not None else x)


def _activation(name: str) -> type[nn.Module]:
    table = {"swish": nn.SiLU, "relu": nn.ReLU}
    if name not in table:
        raise ValueError(f"temporal VAE activation_fn={name!r} is not one of {', '.join(table)}")
    return table[name]


def _res_stack(in_channels: int, out_channels: int, count: int, groups: int, act) -> nn.ModuleList:
    """``count`` ResBlocks, the first one changing the width."""
    return nn.ModuleList(ResBlock(in_channels if i == 0 else out_channels, out_channels, groups, act)
                         for i in range(count))


class Encoder(nn.Module):
    """conv_in -> per level: ResBlocks, then a time-stride-2 conv where the level downsamples
    (an Identity placeholder where it does not, keeping the checkpoint's indices) -> ResBlocks
    -> norm, act, 1x1x1 conv to ``2 * latent_embed_dim`` (mean and log-variance)."""

    def __init__(self, cfg: TemporalVAEConfig):
        super().__init__()
        act, groups, n = _activation(cfg.activation_fn), cfg.num_groups, cfg.num_res_blocks
        widths = [cfg.filters * m for m in cfg.channel_multipliers]
        self.conv_in = CausalConv3d(cfg.in_out_channels, cfg.filters, 3, bias=False)
        self.block_res_blocks = nn.ModuleList()
        self.conv_blocks = nn.ModuleList()
        prev = cfg.filters
        for level, width in enumerate(widths):
            self.block_res_blocks.append(_res_stack(prev, width, n, groups, act))
            prev = width
            if level < len(widths) - 1:
                down = cfg.temporal_downsample[level]
                self.conv_blocks.append(CausalConv3d(width, width, 3, time_stride=2) if down else nn.Identity())
        self.res_blocks = _res_stack(prev, prev, n, groups, act)
        self.norm1 = nn.GroupNorm(groups, prev)
        self.conv2 = CausalConv3d(prev, 2 * cfg.latent_embed_dim, 1)
        self.act = act()

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_in(x)
        for level, blocks in enumerate(self.block_res_blocks):
            for block in blocks:
                x = block(x)
            if level < len(self.conv_blocks):
                x = self.conv_blocks[level](x)
        for block in self.res_blocks:
            x = block(x)
        return self.conv2(self.act(self.norm1(x)))


class Decoder(nn.Module):
    """The mirror of :class:`Encoder`: conv1 -> ResBlocks -> levels from the deepest up, each
    ResBlocks then, where the encoder downsampled, a conv to 2x the channels whose channel
    pairs become pairs of frames (depth to time) -> norm, act, conv_out."""

    def __init__(self, cfg: TemporalVAEConfig):
        super().__init__()
        act, groups, n = _activation(cfg.activation_fn), cfg.num_groups, cfg.num_res_blocks
        widths = [cfg.filters * m for m in cfg.channel_multipliers]
        self.time_strides = [2 if d else 1 for d in cfg.temporal_downsample[: len(widths) - 1]]
        self.conv1 = CausalConv3d(cfg.latent_embed_dim, widths[-1], 3)
        self.res_blocks = _res_stack(widths[-1], widths[-1], n, groups, act)
        # Stored shallow level first (checkpoint order), built deepest first (channel flow).
        levels, ups, prev = [], [], widths[-1]
        for level in reversed(range(len(widths))):
            levels.insert(0, _res_stack(prev, widths[level], n, groups, act))
            prev = widths[level]
            if level > 0:
                stride = self.time_strides[level - 1]
                ups.insert(0, CausalConv3d(prev, prev * stride, 3) if stride > 1 else nn.Identity())
        self.block_res_blocks = nn.ModuleList(levels)
        self.conv_blocks = nn.ModuleList(ups)
        self.norm1 = nn.GroupNorm(groups, prev)
        self.conv_out = CausalConv3d(prev, cfg.in_out_channels, 3)
        self.act = act()

    def forward(self, z: Tensor) -> Tensor:
        x = self.conv1(z)
        for block in self.res_blocks:
            x = block(x)
        for level in reversed(range(len(self.block_res_blocks))):
            for block in self.block_res_blocks[level]:
                x = block(x)
            if level > 0:
                x = _depth_to_time(self.conv_blocks[level - 1](x), self.time_strides[level - 1])
        return self.conv_out(self.act(self.norm1(x)))


def _depth_to_time(x: Tensor, stride: int) -> Tensor:
    """[B, C*s, T, H, W] -> [B, C, T*s, H, W]; channel c*s + i becomes frame t*s + i."""
    if stride == 1:
        return x
    b, cs, t, h, w = x.shape
    x = x.reshape(b, cs // stride, stride, t, h, w).transpose(2, 3)
    return x.reshape(b, cs // stride, t * stride, h, w)


class TemporalVAE(nn.Module):
    """Open-Sora's ``VAE_Temporal``: a clip of ``in_out_channels``-channel frames (SD-VAE latents)
    -> a Gaussian posterior over ``embed_dim`` channels at 1/``time_factor`` of the frames.

    ``encode`` front-pads the clip with zero frames to a multiple of the factor and returns the
    posterior mean (the deterministic mode); ``decode`` needs the clip's frame count to drop
    the frames that padding added.
    """

    def __init__(self, cfg: TemporalVAEConfig = TemporalVAEConfig()):
        super().__init__()
        self.cfg = cfg
        self.time_factor = cfg.time_factor
        self.encoder = Encoder(cfg)
        self.quant_conv = CausalConv3d(2 * cfg.latent_embed_dim, 2 * cfg.embed_dim, 1)
        self.post_quant_conv = CausalConv3d(cfg.embed_dim, cfg.latent_embed_dim, 1)
        self.decoder = Decoder(cfg)

    def _padding(self, num_frames: int) -> int:
        return -num_frames % self.time_factor

    def encode(self, x: Tensor) -> Tensor:
        """[B, C, T, H, W] -> posterior mean [B, embed_dim, ceil(T / factor), H, W]."""
        x = F.pad(x, (0, 0, 0, 0, self._padding(x.shape[2]), 0))
        moments = self.quant_conv(self.encoder(x))
        return moments[:, : self.cfg.embed_dim]

    def decode(self, z: Tensor, num_frames: int) -> Tensor:
        """[B, embed_dim, T', H, W] -> [B, C, num_frames, H, W] (``T' = ceil(num_frames / factor)``)."""
        x = self.decoder(self.post_quant_conv(z))
        return x[:, :, self._padding(num_frames):]


__all__ = ["CHUNK_FRAMES", "TemporalVAE", "TemporalVAEConfig", "clip_pieces", "latent_frames"]
