"""The few-step student's schedule and sampler.

Students are trained and sampled on a short list of timesteps on the 1000-grid (lightx2v's and
Self-Forcing's ``denoising_step_list``, e.g. [1000, 750, 500, 250]), each warped by the shift
(``warp_shift``) as the timestep transform warps the training grid: t/1000 -> shift*s / (1 + (shift-1)*s).
At shift 5 the four become sigmas [1, 0.9375, 0.8333, 0.625].

A step turns the model's velocity into the clean sample it implies, x0 = x - sigma * v, and starts
the next step from it: with fresh noise at the next sigma (``renoise``: the LCM-style sampler of
lightx2v's ``WanStepDistillScheduler`` and of DMD2's training rollouts), or along the ODE
(x + (sigma_next - sigma) * v, an Euler step). Guidance is off (cfg 1): the student learnt it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def warp(steps: Sequence[float], shift: float, grid: int = 1000) -> torch.Tensor:
    """The sigmas (float64) of timesteps ``steps`` on the ``grid``, warped by ``shift``."""
    s = torch.tensor([float(t) / grid for t in steps], dtype=torch.float64)
    return shift * s / (1 + (shift - 1) * s)


def step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float, noise: torch.Tensor | None) -> torch.Tensor:
    """One student step from ``x`` at ``sigma`` given the velocity ``v``: the implied x0 noised
    again to ``sigma_next`` with ``noise`` (None: the ODE step). ``sigma_next`` 0 returns x0."""
    if noise is None:
        return x + (sigma_next - sigma) * v
    x0 = x - sigma * v
    return x0 if sigma_next == 0 else (1 - sigma_next) * x0 + sigma_next * noise


def sample(velocity: VelocityFn, noise: torch.Tensor, sigmas: torch.Tensor,
           fresh: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
    """x0 from ``noise`` by one model call per sigma; ``fresh(i)``: the noise that starts step i + 1
    (re-noising), None for Euler steps along the ODE."""
    work = torch.promote_types(noise.dtype, torch.float32)
    x = noise.to(work)
    levels = [float(s) for s in sigmas] + [0.0]
    for i, (sigma, sigma_next) in enumerate(zip(levels[:-1], levels[1:])):
        t = torch.full((x.shape[0],), sigma, device=x.device)
        v = velocity(x, t).to(work)
        renoise = fresh is not None and sigma_next > 0
        x = step(x, v, sigma, sigma_next, fresh(i).to(x.device, work) if renoise else None)
    return x.to(noise.dtype)


@dataclass(frozen=True)
class StudentSchedule:
    """How a distilled model samples (``distill.*`` of its run): its sigmas, re-noising or not;
    guidance off. Validation, the run's samples, ``videodit sample --ckpt`` and exports read it
    from the run's config, so a student is never sampled with the teacher's 30-step CFG loop."""

    steps: tuple[int, ...]
    shift: float
    renoise: bool

    @classmethod
    def of(cls, cfg) -> "StudentSchedule | None":
        """The schedule of a run's config, None where the run distils nothing."""
        distill = getattr(cfg, "distill", None)
        if distill is None or distill.method is None:
            return None
        return cls(tuple(distill.steps), distill.shift, distill.renoise)

    @property
    def sigmas(self) -> torch.Tensor:
        return warp(self.steps, self.shift)

    def sample(self, velocity: VelocityFn, noise: torch.Tensor,
               fresh: Callable[[int], torch.Tensor] | None) -> torch.Tensor:
        return sample(velocity, noise, self.sigmas, fresh if self.renoise else None)

    def describe(self) -> str:
        """What a user must set to sample it elsewhere (ComfyUI, diffusers): the export's note."""
        sigmas = ", ".join(f"{s:.4f}" for s in self.sigmas.tolist())
        return (f"{len(self.steps)} steps, timesteps {list(self.steps)} warped by shift {self.shift:g} "
                f"(sigmas {sigmas}), cfg 1, " + ("an LCM-style sampler (x0, then fresh noise)" if self.renoise
                                                 else "Euler"))
