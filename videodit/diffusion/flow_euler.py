"""Euler sampling on Wan's grid: the same sigmas and int64 timesteps as ``flow_unipc``, one
first-order step ``x += (sigma_next - sigma) * v`` per model call.

Why Wan's grid and not diffusers' ``FlowMatchEulerDiscreteScheduler(shift=k)`` default:
that scheduler shifts its smallest sigma twice (once when built, again in ``set_timesteps``),
so at shift 12 its last non-zero sigma is 0.126 (Wan's at 40 steps: 0.235, at 10: 0.571)
and the gap to Wan's grid reaches 0.45 at 10 steps. Diffusers' WanPipeline is typed for that
scheduler but the published Wan checkpoints ship diffusers' flow UniPC instead. Euler on
Wan's grid is what the diffusers Euler scheduler computes when handed Wan's sigmas and
timesteps; this module matches that.
"""

from __future__ import annotations

import torch

from videodit.diffusion.flow_unipc import Given, VelocityFn, grid, guided, model_time


def sample(velocity: VelocityFn, noise: torch.Tensor, steps: int, shift: float, guidance: float = 1.0,
           uncond_velocity: VelocityFn | None = None, *, given: Given | None = None) -> torch.Tensor:
    """x0 from ``noise`` by Euler steps on Wan's grid; arguments as ``flow_unipc.sample``."""
    sig, ts = grid(steps, shift)
    s = sig.tolist()
    v = guided(velocity, guidance, uncond_velocity)
    put = given or (lambda x: x)
    work = torch.promote_types(noise.dtype, torch.float32)
    x = put(noise.to(work))
    for i, timestep in enumerate(ts):
        x = put(x + (s[i + 1] - s[i]) * v(x, model_time(timestep, x)).to(work))
    return x.to(noise.dtype)
