"""Wan2.1's default sampler: flow-matching UniPC (bh2, order 2) on Wan's shifted sigma grid.

Same conventions as ``RectifiedFlow``: sigma (= t) is 1 at noise and 0 at data,
``x_t = (1 - t) x0 + t noise``, the model predicts the velocity ``noise - x0``.

The grid is Wan's own (``FlowUniPCMultistepScheduler(shift=1)`` then
``set_timesteps(steps, shift=shift)``): ``linspace(sigma_max, 0, steps + 1)[:-1]`` with
``sigma_max = float32(0.999)``, shifted by ``shift*s / (1 + (shift-1)*s)`` in float64, a final 0
appended, stored as float32. The model sees ``int64(sigma * 1000)`` (truncated), not sigma.
Diffusers' flow UniPC (``use_flow_sigmas``) starts from ``linspace(1, 1/1000)`` instead: a
different grid (up to 7.3e-3 in sigma at shift 12, 40 steps) and different timesteps.

The solver works on data predictions ``x0 = x - sigma * v``. Each step first corrects the
current sample with the new prediction (UniC, no extra model call), then predicts the next one
(UniP). Orders as Wan's defaults give them: the predictor is first order at the first step
(no history) and at the last (``lower_order_final``), second order in between; the corrector
uses the order of the predictor it corrects. First-order UniP is exactly an Euler step.
Steps go by index: Wan's scheduler finds its first step by timestep value and fails where the
int timesteps repeat at the start (100 steps at shift 16: 999, 999, ...); this one does not.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from videodit.errors import UserError

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Given = Callable[[torch.Tensor], torch.Tensor]

NUM_TRAIN_TIMESTEPS = 1000
# Wan's training sigmas are 1 - linspace(1, 1/1000, 1000) reversed, held in float32: the
# largest is float32(0.999), not 1, so log((1 - sigma) / sigma) stays finite at the first step.
SIGMA_MAX = float(np.float32(1.0 - 1.0 / NUM_TRAIN_TIMESTEPS))


def check(steps, shift) -> int:
    """``steps`` as an int, or a UserError for a count below 1 or a shift that is not > 0."""
    try:
        steps_ok = not isinstance(steps, bool) and float(steps).is_integer() and steps >= 1
    except (TypeError, ValueError):
        steps_ok = False
    if not steps_ok:
        raise UserError(f"steps={steps!r} must be a whole number of sampling steps >= 1")
    try:
        shift_ok = math.isfinite(float(shift)) and float(shift) > 0
    except (TypeError, ValueError):
        shift_ok = False
    if not shift_ok:
        raise UserError(f"shift={shift!r} must be a number > 0 (Wan uses 5 for text-to-video, 3 for 480p "
                        "image-to-video)")
    return int(steps)


def grid(steps: int, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's ``(sigmas, timesteps)``: float32 [steps + 1] ending in 0, int64 [steps]."""
    steps, shift = check(steps, shift), float(shift)
    # numpy, not torch: numpy's linspace is what Wan rounds from, and a 1-ulp difference
    # before the int64 cast can move a timestep by one.
    s = np.linspace(SIGMA_MAX, 0.0, steps + 1)[:-1]
    s = shift * s / (1 + (shift - 1) * s)
    timesteps = torch.from_numpy(s * NUM_TRAIN_TIMESTEPS).to(torch.int64)   # truncates, as Wan's cast does
    sigmas = torch.from_numpy(np.concatenate([s, [0.0]]).astype(np.float32))
    return sigmas, timesteps


def sigmas(steps: int, shift: float) -> torch.Tensor:
    """Wan's sigma grid: float32 [steps + 1], from shift(0.999) down to a final 0."""
    return grid(steps, shift)[0]


def timesteps(steps: int, shift: float) -> torch.Tensor:
    """The int64 timesteps [steps] Wan feeds its model: ``int64(sigma * 1000)`` of the grid."""
    return grid(steps, shift)[1]


def guided(velocity: VelocityFn, guidance: float | Callable[[torch.Tensor], float],
           uncond_velocity: VelocityFn | None) -> VelocityFn:
    """Classifier-free guidance as Wan combines it: ``v_u + guidance * (v_c - v_u)``; ``guidance``
    may be a function of t (Wan 2.2's two experts, each with its own scale)."""
    scale_at = guidance if callable(guidance) else (lambda t: guidance)
    if uncond_velocity is None or (not callable(guidance) and guidance == 1.0):
        return velocity

    def v(x, t):
        scale = scale_at(t)
        if scale == 1.0:
            return velocity(x, t)
        v_uncond = uncond_velocity(x, t)
        return v_uncond + scale * (velocity(x, t) - v_uncond)

    return v


def model_time(timestep: int, x: torch.Tensor) -> torch.Tensor:
    """[B] float32 t = Wan's int timestep / 1000. ``t * 1000`` is within 3.1e-5 of the int
    (float32 cannot hold every k/1000); ``round(t * 1000)`` gives it exactly."""
    return torch.full((x.shape[0],), int(timestep) / NUM_TRAIN_TIMESTEPS, dtype=torch.float32, device=x.device)


def _lam(sigma: float) -> float:
    """Log signal-to-noise ratio log(alpha / sigma) with alpha = 1 - sigma."""
    return math.log((1.0 - sigma) / sigma)


def _predict(x, s0: float, t: float, d0, d1=None, s1: float | None = None):
    """UniP from ``x`` at ``s0`` to ``t``, given the data prediction ``d0`` at ``s0`` and, for
    second order, ``d1`` at the previous (noisier) ``s1``. bh2 with Wan's fixed rho = 1/2."""
    ratio = t / s0
    out = ratio * x + (1 - ratio) * d0                  # the first-order (DDIM = Euler) step
    if d1 is not None:
        r = (_lam(s1) - _lam(s0)) / (_lam(t) - _lam(s0))
        out = out + (0.5 * (1 - ratio) / r) * (d1 - d0)
    return out


def _correct(x_prev, s0: float, t: float, d0, d_t, d1=None, s1: float | None = None):
    """UniC: redo the step ``x_prev`` (at ``s0``) -> ``t`` with the data prediction ``d_t`` made
    at the predicted sample, next to ``d0`` at ``s0`` and (order 2) ``d1`` at ``s1``."""
    ratio = t / s0
    out = ratio * x_prev + (1 - ratio) * d0
    if d1 is None:
        return out + (0.5 * (1 - ratio)) * (d_t - d0)
    h = _lam(t) - _lam(s0)
    r = (_lam(s1) - _lam(s0)) / h
    # rho solves [[1, 1], [r, 1]] rho = b, b_k = k! * g_k / B(h): g_k are the phi-function
    # remainders of the exponential integrator at -h, and B(h) = expm1(-h) (the bh2 choice).
    b_h = math.expm1(-h)
    g1 = b_h / -h - 1
    g2 = g1 / -h - 0.5
    b1, b2 = g1 / b_h, 2 * g2 / b_h
    rho_1 = (b1 - b2) / (1 - r)
    rho_t = b1 - rho_1
    return out + (1 - ratio) * ((rho_1 / r) * (d1 - d0) + rho_t * (d_t - d0))


def sample(velocity: VelocityFn, noise: torch.Tensor, steps: int, shift: float,
           guidance: float | Callable[[torch.Tensor], float] = 1.0,
           uncond_velocity: VelocityFn | None = None, *, given: Given | None = None) -> torch.Tensor:
    """x0 from ``noise`` by Wan's UniPC, one (guided) velocity evaluation per step.

    ``velocity(x, t)``: t is [B] float32 = Wan's int64 timestep / 1000. With ``uncond_velocity``
    and ``guidance`` != 1, classifier-free guidance as Wan does it. ``given(x)`` puts
    conditioning frames back after every update of x, as ``RectifiedFlow.sample`` does (Wan's own
    loop has no such hook). Returns ``noise``'s dtype; the solver state is at least float32.
    """
    sig, ts = grid(steps, shift)
    s = sig.tolist()
    if not all(a > b for a, b in zip(s, s[1:])) or s[0] >= 1.0:
        raise UserError(f"shift={shift} with steps={steps} leaves sigmas that float32 cannot tell apart "
                        "(or that round to 1); use a smaller shift")
    v = guided(velocity, guidance, uncond_velocity)
    put = given or (lambda x: x)
    work = torch.promote_types(noise.dtype, torch.float32)
    n = len(ts)
    x = put(noise.to(work))
    data: list[torch.Tensor] = []          # data predictions, newest last
    x_prev, order_prev = None, 0
    for i in range(n):
        d = x - s[i] * v(x, model_time(ts[i], x)).to(work)
        if x_prev is not None:
            two = order_prev == 2
            x = put(_correct(x_prev, s[i - 1], s[i], data[-1], d,
                             data[-2] if two else None, s[i - 2] if two else None))
        data = (data + [d])[-2:]
        order = 1 if i == 0 or i == n - 1 else 2
        x_prev, order_prev = x, order
        x = put(_predict(x, s[i], s[i + 1], d, data[0] if order == 2 else None, s[i - 1] if order == 2 else None))
    return x.to(noise.dtype)
