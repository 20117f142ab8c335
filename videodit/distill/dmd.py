"""Distribution matching (DMD2): the generator's gradient and the surrogate loss that carries it.

The frozen teacher scores the student's noised sample (the real score, with guidance), the
critic scores it too (the fake score: trained on the student's own samples), and the student
moves along their difference, ``g = (x0_fake - x0_real) / mean|x0 - x0_real|``. The
normaliser is taken per sample (Self-Forcing's ``_compute_kl_grad``, DMD2) or over the whole
batch (FastVideo's ``_dmd_loss``). The loss ``0.5 * mean((x0 - sg(x0 - g))^2)`` has exactly
``g / numel`` as its gradient with respect to x0; it is formed in float64, as Self-Forcing does.

Guidance is written two ways in the literature: Ho-Salimans ``uncond + w (cond - uncond)`` (ours,
``distill.teacher_cfg``) and DMD2/CausVid/Self-Forcing's ``cond + w' (cond - uncond)``; the two
agree when w = w' + 1 (Self-Forcing's ``guidance_scale 3`` is our 4).
"""

from __future__ import annotations

import math

import torch

NORMALISERS = ("sample", "batch")


def dmd_gradient(x0: torch.Tensor, x0_fake: torch.Tensor, x0_real: torch.Tensor,
                 normaliser: str = "sample") -> torch.Tensor:
    """The distribution-matching gradient at the student's sample ``x0`` (no grad flows)."""
    with torch.no_grad():
        distance = (x0 - x0_real).abs()
        if normaliser == "sample":
            scale = distance.mean(dim=tuple(range(1, x0.dim())), keepdim=True)
        elif normaliser == "batch":
            scale = distance.mean()
        else:
            raise ValueError(f"normaliser {normaliser!r} (one of {', '.join(NORMALISERS)})")
        return torch.nan_to_num((x0_fake - x0_real) / scale)


def generator_loss(x0: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """The surrogate whose gradient with respect to ``x0`` is ``gradient / x0.numel()``."""
    x = x0.double()
    return 0.5 * torch.nn.functional.mse_loss(x, (x - gradient.double()).detach())


def guided(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Ho-Salimans guidance, ``uncond + scale * (cond - uncond)`` (``scale`` 1: the conditional)."""
    return cond if scale == 1 else uncond + scale * (cond - uncond)


def dmd2_form(scale: float) -> float:
    """The DMD2/CausVid/Self-Forcing guidance scale equal to Ho-Salimans ``scale``."""
    return scale - 1


def score_timesteps(n: int, t_range: tuple[float, float], shift: float, generator: torch.Generator,
                    within: tuple[float, float] | None = None) -> torch.Tensor:
    """The timesteps at which both scores see the student's sample: uniform on [0, 1), warped by
    ``shift``, clamped into ``t_range`` (Self-Forcing's draw on the 1000-grid, ``timestep_shift``,
    then the clamp to [min_step, max_step]). ``within`` (lo, hi): the same draw conditioned on
    lo <= t < hi, one expert's side of a two-expert model: uniform between the bounds' preimages
    under the warp, then warped and clamped (into [lo, hi) too)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    if within is not None:
        lo, hi = (t / (shift - (shift - 1) * t) for t in within)   # the warp's inverse
        u = lo + (hi - lo) * u
    t = (shift * u / (1 + (shift - 1) * u)).clamp(*t_range)
    if within is not None:
        t = t.clamp(within[0], math.nextafter(within[1], 0.0))
    return t.float()
