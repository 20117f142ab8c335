"""Open-Sora 2.0's sampler (``opensora/utils/sampling.py`` ``I2VDenoiser``): Euler steps over
its shifted grid with three-way classifier-free guidance.

Each step evaluates the model on three branches: ``c`` (prompt and given frames), ``u`` (the
unconditional prompt, given frames kept) and ``u2`` (the unconditional prompt, given frames zeroed)
and steps along

    v = u2 + g_image (u - u2) + g_text (c - u)

so g_image pulls towards the given frames and g_text towards the prompt (Open-Sora: 3.0 and 7.5).
Options of its release (its inference configs turn all three on):

* text / image oscillation: after the first 10 steps, every odd step uses scale 1;
* the image ramp (``scale_temporal_osci``, i2v only): at step i the image scale rises along the
  latent frames from 1 to a ceiling that falls from g_image (step 0) towards 1, so frames far from
  the given one are pulled towards it more, and less as the sample settles. Only where the
  (oscillated) image scale is above 1.

Given frames enter only through the model's condition channels: x is not overwritten between
steps (unlike Open-Sora 1.2's frame masks); the caller puts the given latents back at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from videodit.diffusion.opensora2_schedule import schedule

STEADY_STEPS = 10   # oscillation starts after this many steps (Open-Sora's force_num)

# (x, t [B]) -> the velocities of the three branches (c, u, u2)
Branches = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ThreeWayGuidance:
    text: float = 7.5
    image: float = 3.0
    text_oscillation: bool = False
    image_oscillation: bool = False
    image_ramp: bool = False        # the temporal ramp; callers set it only for i2v modes


def oscillated(scale: float, step: int) -> float:
    """``scale`` on the first ``STEADY_STEPS`` steps and on even steps after, else 1."""
    return scale if step < STEADY_STEPS or step % 2 == 0 else 1.0


def image_scale(guidance: ThreeWayGuidance, step: int, steps: int, latent_frames: int) -> float | torch.Tensor:
    """The image scale of ``step`` (of ``steps``): a float, or with the ramp [T] per latent frame."""
    scale = oscillated(guidance.image, step) if guidance.image_oscillation else guidance.image
    if not (guidance.image_ramp and scale > 1.0):
        return scale
    ceiling = torch.linspace(scale, 1.0, steps + 1)[step]     # Open-Sora: over len(timesteps) = steps + 1
    return torch.linspace(1.0, ceiling, latent_frames)


def combine(c: torch.Tensor, u: torch.Tensor, u2: torch.Tensor, text: float,
            image: float | torch.Tensor) -> torch.Tensor:
    """``u2 + image (u - u2) + text (c - u)`` on latents [B, C, T, H, W]; ``image`` float or [T]."""
    if isinstance(image, torch.Tensor):
        image = image.to(c.device, c.dtype)[None, None, :, None, None]
    return u2 + image * (u - u2) + text * (c - u)


def sample(branches: Branches, noise: torch.Tensor, steps: int, alpha: float | None,
           guidance: ThreeWayGuidance) -> torch.Tensor:
    """x0 from ``noise`` [B, C, T, H, W] by ``steps`` Euler steps over Open-Sora 2.0's grid
    (shifted by ``alpha``; None: unshifted), three-way guided."""
    times = schedule(steps, alpha)
    x = noise
    for i, (t_now, t_next) in enumerate(zip(times[:-1], times[1:])):
        t = torch.full((x.shape[0],), t_now, dtype=x.dtype, device=x.device)
        c, u, u2 = branches(x, t)
        text = oscillated(guidance.text, i) if guidance.text_oscillation else guidance.text
        v = combine(c, u, u2, text, image_scale(guidance, i, steps, x.shape[2]))
        x = x + (t_next - t_now) * v
    return x
