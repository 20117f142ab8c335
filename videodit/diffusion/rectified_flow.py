"""Rectified flow as Open-Sora 1.2 trains it.

Convention: t in [0, 1], t=0 is data and t=1 is noise,
``x_t = (1 - t) * x0 + t * noise``, and the model predicts the velocity
``v = dx_t/dt = noise - x0``. (Open-Sora predicts ``x0 - noise`` with t counted the same
way; the two differ only in sign.) Sampling integrates from t=1 to t=0 with Euler steps.

Timesteps are drawn logit-normal and then shifted towards noise for larger and longer
inputs (Open-Sora 1.2's ``timestep_transform``): more tokens carry more redundant signal,
so the same t destroys relatively less of it.
"""

from __future__ import annotations

from typing import Callable

import torch

from videodit.config import DiffusionConfig
import videodit.diffusion.opensora2_schedule as opensora2_schedule
from videodit.diffusion.flow_unipc import guided

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class RectifiedFlow:
    def __init__(self, cfg: DiffusionConfig):
        self.cfg = cfg

    def shift_ratio(self, height: int, width: int, latent_frames: int, latent_hw: tuple[int, int] | None = None,
                    patch: int = opensora2_schedule.TRAINING_PATCH) -> float:
        """sqrt(pixels / base pixels) * sqrt(latent frames / base frames) * scale, or
        ``diffusion.constant_shift`` for every clip (Wan), or with ``shift_rule=opensora2`` Open-Sora
        2.0's alpha of the latent clip (``latent_hw``; tokens counted at ``patch``: 2 in training,
        the model's patch when sampling, as its two scripts count them)."""
        if self.cfg.constant_shift is not None:
            return self.cfg.constant_shift
        if not self.cfg.shift:
            return 1.0
        if self.cfg.shift_rule == "opensora2":
            if latent_hw is None:
                raise ValueError("shift_rule=opensora2 needs the latent height and width (latent_hw)")
            return opensora2_schedule.shift_alpha(*latent_hw, latent_frames, patch)
        space = (height * width / self.cfg.shift_base_pixels) ** 0.5
        time = (latent_frames / self.cfg.shift_base_frames) ** 0.5
        return space * time * self.cfg.shift_scale

    @staticmethod
    def shift(t: torch.Tensor, ratio: float) -> torch.Tensor:
        """Open-Sora's timestep transform: ratio > 1 moves t towards 1 (noise)."""
        return ratio * t / (1 + (ratio - 1) * t)

    @staticmethod
    def unshift(t: torch.Tensor, ratio: float) -> torch.Tensor:
        """The inverse of :meth:`shift`: the unshifted time that shifts to ``t``."""
        return t / (ratio - (ratio - 1) * t)

    def sample_timesteps(self, batch: int, ratio: float, generator: torch.Generator | None = None,
                         device=None, time_range: tuple[float, float] | None = None) -> torch.Tensor:
        """``batch`` shifted timesteps; within [lo, hi] (``time_range``, else
        ``diffusion.timestep_range``), drawn from the same distribution restricted to
        lo <= t <= hi (by its inverse CDF: no rejection, so one draw per sample), as an expert
        of a two-expert model trains (Wan 2.2 A14B)."""
        time_range = time_range or self.cfg.timestep_range
        if time_range is None:
            if self.cfg.timestep_sampling == "logit_normal":
                normal = torch.randn(batch, generator=generator)
                t = torch.sigmoid(normal * self.cfg.logit_std + self.cfg.logit_mean)
            else:
                t = torch.rand(batch, generator=generator)
            return self.shift(t, ratio).to(device)
        lo, hi = (self.unshift(torch.tensor(float(edge), dtype=torch.float64), ratio) for edge in time_range)
        u = torch.rand(batch, generator=generator, dtype=torch.float64)
        a, b = self._cdf(lo), self._cdf(hi)
        t = self._quantile(a + (b - a) * u)
        return self.shift(t.clamp(lo, hi), ratio).float().to(device)

    def share(self, lo: float, hi: float, ratio: float) -> float:
        """The probability that a training timestep (shifted by ``ratio``) lies in [lo, hi]."""
        edges = (self.unshift(torch.tensor(float(edge), dtype=torch.float64), ratio) for edge in (lo, hi))
        a, b = map(self._cdf, edges)
        return float(b - a)

    def _cdf(self, t: torch.Tensor) -> torch.Tensor:
        """The unshifted timestep distribution's CDF at ``t`` (float64)."""
        if self.cfg.timestep_sampling == "logit_normal":   # a normal over the logits
            mean, std = self.cfg.logit_mean, max(self.cfg.logit_std, 1e-12)
            return torch.special.ndtr((torch.logit(t) - mean) / std)
        return t

    def _quantile(self, p: torch.Tensor) -> torch.Tensor:
        if self.cfg.timestep_sampling == "logit_normal":
            mean, std = self.cfg.logit_mean, max(self.cfg.logit_std, 1e-12)
            return torch.sigmoid(torch.special.ndtri(p) * std + mean)
        return p

    def noised(self, x0: torch.Tensor, size, generator: torch.Generator, device=None,
               time_range: tuple[float, float] | None = None):
        """The flow-matching objective's step (``diffusion/objectives.py``): (x_t, t, velocity target,
        None) of clean latents ``x0`` of a clip of ``size`` pixels (frames, height, width): t (within
        ``time_range`` if given), then the noise, drawn from ``generator``."""
        ratio = self.shift_ratio(size[-2], size[-1], x0.shape[2], x0.shape[-2:])
        t = self.sample_timesteps(x0.shape[0], ratio, generator, device, time_range)
        noise = torch.randn(x0.shape, generator=generator).to(device)
        sigma_min = self.cfg.sigma_min
        return self.interpolate(x0, noise, t, sigma_min), t, self.velocity_target(x0, noise, sigma_min), None

    @staticmethod
    def interpolate(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, sigma_min: float = 0.0) -> torch.Tensor:
        """x_t; with ``sigma_min`` > 0 (``diffusion.sigma_min``) Open-Sora 2.0's noise floor."""
        if sigma_min:
            return opensora2_schedule.interpolate(x0, noise, t, sigma_min)
        t = t.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
        return (1 - t) * x0 + t * noise

    @staticmethod
    def velocity_target(x0: torch.Tensor, noise: torch.Tensor, sigma_min: float = 0.0) -> torch.Tensor:
        if sigma_min:
            return opensora2_schedule.velocity_target(x0, noise, sigma_min)
        return noise - x0

    def model_velocity(self, output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The velocity a model output stands for.

        With ``prediction="data"`` the model predicts x0 and ``v = (x_t - x0) / t``
        (t clamped away from 0); the loss stays a velocity loss. Predicting data is easier
        than predicting velocity when tokens are high-dimensional pixel patches and the
        network is narrow, because the model need not carry the noise through.
        """
        if self.cfg.prediction == "velocity":
            return output
        t = t.view(-1, *([1] * (output.dim() - 1))).to(output.dtype).clamp(min=0.05)
        return (x_t - output) / t

    def loss(self, output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
             target_velocity: torch.Tensor, frame_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The training loss in fp32: the mean squared error of the output's velocity, or with
        ``loss_space="data"`` of the clean sample it implies, ``x0 = x_t - t * v``. The two differ
        by a factor t^2 per sample; with data prediction the velocity loss weighs a sample at
        t=0.1 81 times more than one at t=0.9. ``frame_mask`` [B, T'] (True = generated): the
        error of each sample is averaged over its generated frames only, as Open-Sora does."""
        error = self.model_velocity(output.float(), x_t, t) - target_velocity.float()
        if self.cfg.loss_space == "data":
            error = error * t.view(-1, *([1] * (error.dim() - 1))).float()
        if frame_mask is None:
            return error.square().mean()
        weight = frame_mask.to(error.dtype)[:, None, :, None, None]           # [B, 1, T', 1, 1]
        per_sample = (error.square() * weight).flatten(1).sum(1)
        counted = weight.flatten(1).sum(1) * error[:, :, 0].numel() / error.shape[0]   # frames x C*H*W
        return (per_sample / counted).mean()

    def sample(self, velocity: VelocityFn, noise: torch.Tensor, steps: int, ratio: float = 1.0,
               guidance: float | Callable[[torch.Tensor], float] = 1.0, uncond_velocity: VelocityFn | None = None,
               given: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Euler integration from t=1 (``noise``) to t=0.

        With ``uncond_velocity`` and ``guidance`` != 1, classifier-free guidance:
        ``v = v_uncond + guidance * (v_cond - v_uncond)`` (``guidance`` may be a function of t: two
        experts, each with its own scale). ``given(x)`` puts conditioning frames back into ``x`` at
        the start and after every step (Open-Sora re-inserts them so).
        """
        v_at = guided(velocity, guidance, uncond_velocity)
        given = given or (lambda x: x)
        times = self.shift(torch.linspace(1.0, 0.0, steps + 1), ratio)
        x = given(noise)
        for t_now, t_next in zip(times[:-1], times[1:]):
            t_batch = torch.full((x.shape[0],), float(t_now), device=x.device)
            x = given(x + (t_next - t_now).item() * v_at(x, t_batch))
        return x
