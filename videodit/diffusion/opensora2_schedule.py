"""Open-Sora 2.0's flow-matching objective and timestep shift (``scripts/diffusion/train.py``,
``opensora/utils/sampling.py``).

Conventions are videodit's: t in [0, 1], t=1 is noise, and the model sees t itself. Open-Sora 2.0
keeps a floor ``sigma_min`` on the noise, as MovieGen does:

    x_t    = (1 - t) x0 + (1 - (1 - sigma_min)(1 - t)) noise
    target = (1 - sigma_min) noise - x0          (= d x_t / d t)

so x_t at t=0 is x0 + sigma_min noise; with sigma_min=0 both reduce to plain rectified flow.

The shift: t' = alpha t / (1 + (alpha - 1) t) (Open-Sora 1.2's transform), with alpha a line
through (256 tokens, 1) and (4096 tokens, 3) at the image tokens of one latent frame, times
sqrt(latent frames). The line is not clamped: below 256 tokens alpha < 1, and it never reaches
0 (its value at 0 tokens is 0.867). How the tokens are counted differs between Open-Sora's two
scripts, and both are kept: training takes ``latent H x W // 4`` (its literal 4, the tokens at a
2x2 patch, whatever the model's patch), sampling ``latent H x W // patch^2``. They agree for the
Hunyuan-VAE models (patch 2); for the DC-AE model (patch 1) sampling shifts 4x more tokens.
"""

from __future__ import annotations

import math

import torch

# The line through (tokens, alpha) = (256, 1) and (4096, 3): SD3's shift, 1 at 256px, 3 at 1024px.
LOW_TOKENS, LOW_ALPHA = 256, 1.0
HIGH_TOKENS, HIGH_ALPHA = 4096, 3.0
TRAINING_PATCH = 2   # training counts tokens as latent H*W // 4 whatever the model's patch


def resolution_alpha(tokens_per_frame: int) -> float:
    """alpha of one frame of ``tokens_per_frame`` image tokens (computed in Open-Sora's order, so
    the float is the same)."""
    slope = (HIGH_ALPHA - LOW_ALPHA) / (HIGH_TOKENS - LOW_TOKENS)
    offset = LOW_ALPHA - slope * LOW_TOKENS
    return slope * tokens_per_frame + offset


def shift_alpha(latent_height: int, latent_width: int, latent_frames: int, patch: int = TRAINING_PATCH) -> float:
    """Open-Sora 2.0's shift of a latent clip: tokens per frame ``H*W // patch^2`` on the line,
    times sqrt(latent frames). ``patch``: 2 as its training counts, the model's patch as its
    sampler counts."""
    alpha = resolution_alpha((latent_height * latent_width) // (patch * patch))
    alpha *= math.sqrt(latent_frames)
    return alpha


def time_shift(alpha: float, t: torch.Tensor) -> torch.Tensor:
    """alpha > 1 moves t towards 1 (noise)."""
    return alpha * t / (1 + (alpha - 1) * t)


def schedule(steps: int, alpha: float | None) -> list[float]:
    """The sampler's ``steps + 1`` times from 1 to 0: ``linspace(1, 0)`` in float32, shifted by
    ``alpha`` (None: not shifted), as Python floats (``get_schedule``)."""
    times = torch.linspace(1, 0, steps + 1)
    if alpha is not None:
        times = time_shift(alpha, times)
    return times.tolist()


def _per_sample(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.view(-1, *([1] * (like.dim() - 1))).to(like.dtype)


def interpolate(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, sigma_min: float) -> torch.Tensor:
    """x_t with the noise floor ``sigma_min`` (operations in Open-Sora's order)."""
    t_rev = 1 - _per_sample(t, x0)
    return t_rev * x0 + (1 - (1 - sigma_min) * t_rev) * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor, sigma_min: float) -> torch.Tensor:
    """d x_t / d t: ``(1 - sigma_min) noise - x0``."""
    return (1 - sigma_min) * noise - x0
