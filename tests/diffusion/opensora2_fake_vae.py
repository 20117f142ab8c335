"""A deterministic stand-in for Open-Sora 2.0's VAEs, shared by ``scripts/make_opensora2_sampler_fixtures.py``
(which hands it to Open-Sora's ``prepare_visual_condition_*``) and the tests (which hand it to
videodit's ``visual_condition``): 4x temporal and 8x spatial compression, causal (Hunyuan-like,
T' = (T - 1)/4 + 1) or not (DC-AE-like: one frame, or T' = T / 4). Every latent also carries a quarter of
the clip's mean, so frames encoded on their own differ from the same frames inside a clip, as
with the real VAEs' group norms ("information leakage")."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from videodit.errors import UserError

RATIO, SIDE, CHANNELS = 4, 8, 4


class FakeVAE(nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        mix = torch.Generator().manual_seed(4242)
        self.mix = nn.Parameter(torch.randn(CHANNELS, 3, generator=mix), requires_grad=False)
        # the attribute names both codes read
        self.cfg = types.SimpleNamespace(latent_channels=CHANNELS)
        self.time_compression_ratio = self.temporal_compression = RATIO
        self.spatial_compression = SIDE
        self.latent_channels = CHANNELS

    def get_latent_size(self, size):                        # Open-Sora's: (T, H, W) of pixels
        return list(self.latent_size(*size))

    def latent_size(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        if self.causal:
            return (frames - 1) // RATIO + 1, height // SIDE, width // SIDE
        if frames != 1 and frames % RATIO:      # as the DC-AE: one frame, or whole groups
            raise UserError(f"{frames} frames are not a multiple of {RATIO}")
        return max(1, frames // RATIO), height // SIDE, width // SIDE

    def _groups(self, frames: int) -> list[range]:
        self.latent_size(frames, SIDE, SIDE)
        if self.causal:
            return [range(0, 1)] + [range(s, s + RATIO) for s in range(1, frames, RATIO)]
        return [range(s, min(s + RATIO, frames)) for s in range(0, frames, RATIO)]

    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        pooled = F.avg_pool3d(video.float(), (1, SIDE, SIDE))                       # [B, 3, T, h, w]
        per_frame = torch.einsum("oc,bcthw->bothw", self.mix, pooled)
        frames = torch.stack([per_frame[:, :, list(g)].mean(2) for g in self._groups(video.shape[2])], dim=2)
        return torch.tanh(frames) + 0.25 * per_frame.mean(2, keepdim=True)
