"""LTX-2's rotary position embedding (ltx-core ``rope.py``, "split" type), our own code.

What sets it apart from Wan's or Flux's RoPE:

- **Positions are physical.** A video token sits at the middle of the pixels and seconds its latent
  voxel covers: frame i spans pixel frames [8i - 7, 8i + 1) (clamped at 0: the causal VAE's first
  latent frame holds one pixel frame) divided by the fps, rows [32r, 32r + 32) and columns likewise.
  An audio token spans its mel frames [4i - 3, 4i + 1) (clamped) times hop / sample rate.
  Positions are divided by ``max_pos`` (20 s, 2048 px, 2048 px) and mapped to [-1, 1].
- **Frequencies span the whole width.** A grid of ``width // (2 * axes)`` frequencies
  theta^linspace(0, 1) * pi/2 (computed in fp64 for the releases, then fp32) multiplies each axis;
  the angles, interleaved (frequency-major, axis-minor) and padded in front with angle 0 to
  ``width / 2``, are cut into one band per head: **each head rotates with its own frequencies**.
- **Split rotation.** Within a head, channel j turns with channel j + head_dim/2.
- The cross-modal attentions rotate by time only, on the audio width, at the larger of the two
  streams' time scales.

Tables are (cos, sin) of shape [B or 1, heads, tokens, head_dim / 2]: tensor parallelism splits
them with the heads, sequence parallelism along the tokens.
"""

from __future__ import annotations

import math

import torch

from videodit.models.ltx2.geometry import (AUDIO_DOWNSAMPLE, AUDIO_HOP, AUDIO_SAMPLE_RATE, CAUSAL_OFFSET,
                                           VIDEO_SCALE)

Table = tuple[torch.Tensor, torch.Tensor]


# ----------------------------------------------------------------------------- positions

def video_positions(frames: int, height: int, width: int, fps: torch.Tensor, device=None) -> torch.Tensor:
    """[B, 3, frames*height*width, 2] (start, end) of each token in seconds, pixels, pixels, in the
    tokens' (frame, row, column) order; ``fps`` [B] (fp32) sets the time axis per sample.

    Computed as ltx-trainer does: integer pixel bounds, the causal shift, fp32, then / fps."""
    starts = torch.stack(torch.meshgrid(torch.arange(frames, device=device), torch.arange(height, device=device),
                                        torch.arange(width, device=device), indexing="ij"))
    bounds = torch.stack([starts, starts + 1], dim=-1).flatten(1, 3)            # [3, T, 2] latent voxels
    pixels = bounds * torch.tensor(VIDEO_SCALE, device=device).view(3, 1, 1)
    pixels[0] = (pixels[0] + CAUSAL_OFFSET - VIDEO_SCALE[0]).clamp(min=0)
    pixels = pixels.float().unsqueeze(0).repeat(fps.shape[0], 1, 1, 1)
    pixels[:, 0] = pixels[:, 0] / fps.float().view(-1, 1, 1)
    return pixels


def audio_positions(tokens: int, batch: int, device=None) -> torch.Tensor:
    """[B, 1, tokens, 2] (start, end) of each audio token in seconds (ltx-core's AudioPatchifier)."""
    def seconds(first: int) -> torch.Tensor:
        mel = torch.arange(first, first + tokens, dtype=torch.float32, device=device) * AUDIO_DOWNSAMPLE
        mel = (mel + CAUSAL_OFFSET - AUDIO_DOWNSAMPLE).clip(min=0)
        return mel * AUDIO_HOP / AUDIO_SAMPLE_RATE
    bounds = torch.stack([seconds(0), seconds(1)], dim=-1)                       # [T, 2]
    return bounds.expand(batch, 1, -1, -1)


# ----------------------------------------------------------------------------- tables

def frequency_grid(theta: float, axes: int, width: int, double_precision: bool, device=None) -> torch.Tensor:
    """[width // (2 * axes)] angular frequencies theta^linspace(0, 1) * pi/2 (fp32)."""
    count = width // (2 * axes)
    if double_precision:   # the releases: the exponentials in fp64, rounded once
        exponent = torch.linspace(0.0, 1.0, count, dtype=torch.float64, device=device)
        return (theta ** exponent * math.pi / 2).float()
    exponent = torch.linspace(math.log(1, theta), math.log(theta, theta), count, dtype=torch.float32, device=device)
    return theta ** exponent * math.pi / 2


def rope_table(bounds: torch.Tensor, max_pos, width: int, heads: int, theta: float,
               double_precision: bool) -> Table:
    """(cos, sin) [B, heads, T, width / (2 heads)] of positions ``bounds`` [B, axes, T, 2] (start, end):
    each token at its middle, divided by ``max_pos`` per axis, mapped to [-1, 1]."""
    axes = bounds.shape[1]
    middle = (bounds[..., 0] + bounds[..., 1]) / 2.0                              # [B, axes, T]
    fraction = torch.stack([middle[:, i] / max_pos[i] for i in range(axes)], dim=-1)   # [B, T, axes]
    grid = frequency_grid(theta, axes, width, double_precision, bounds.device)
    angles = (grid * (fraction.unsqueeze(-1) * 2 - 1)).transpose(-1, -2).flatten(2)  # [B, T, F*axes]
    cos, sin = angles.cos(), angles.sin()
    pad = width // 2 - angles.shape[-1]
    if pad:   # the leftover lowest channels do not turn (angle 0)
        cos = torch.cat([torch.ones_like(cos[..., :pad]), cos], dim=-1)
        sin = torch.cat([torch.zeros_like(sin[..., :pad]), sin], dim=-1)
    b, t = cos.shape[:2]
    return cos.reshape(b, t, heads, -1).transpose(1, 2), sin.reshape(b, t, heads, -1).transpose(1, 2)


def rotate(x: torch.Tensor, table: Table) -> torch.Tensor:
    """Rotate x [B, H, T, head_dim] by (cos, sin) [B or 1, H, T, head_dim / 2]: channel j with
    channel j + head_dim / 2 (the tables in x's dtype, as ltx-core casts them)."""
    cos, sin = (t.to(x.dtype) for t in table)
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
