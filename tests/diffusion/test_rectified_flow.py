import math

import torch

from videodit.config import DiffusionConfig
from videodit.diffusion.rectified_flow import RectifiedFlow


def gaussian_velocity(mu: float, sigma: float):
    """The exact rectified-flow velocity E[noise - x0 | x_t] when x0 ~ N(mu, sigma^2)."""

    def velocity(x, t):
        t = t.view(-1, *([1] * (x.dim() - 1)))
        var = (1 - t) ** 2 * sigma**2 + t**2
        centred = x - (1 - t) * mu
        e_x0 = mu + (1 - t) * sigma**2 / var * centred
        e_noise = t / var * centred
        return e_noise - e_x0

    return velocity


def test_euler_sampler_recovers_a_gaussian_target():
    flow = RectifiedFlow(DiffusionConfig(shift=False))
    noise = torch.randn(200_000, 1, generator=torch.Generator().manual_seed(0))
    samples = flow.sample(gaussian_velocity(2.0, 0.5), noise, steps=100)
    assert abs(samples.mean().item() - 2.0) < 0.02
    assert abs(samples.std().item() - 0.5) < 0.02


def test_shifted_schedule_also_recovers_the_target():
    flow = RectifiedFlow(DiffusionConfig())
    noise = torch.randn(100_000, 1, generator=torch.Generator().manual_seed(1))
    samples = flow.sample(gaussian_velocity(-1.0, 0.3), noise, steps=100, ratio=3.0)
    assert abs(samples.mean().item() + 1.0) < 0.02
    assert abs(samples.std().item() - 0.3) < 0.02


def test_classifier_free_guidance_extrapolates_from_unconditional():
    flow = RectifiedFlow(DiffusionConfig(shift=False))
    noise = torch.zeros(4, 1)
    cond = lambda x, t: torch.full_like(x, -1.0)      # noqa: E731  pushes x up to +1 over t: 1 -> 0
    uncond = lambda x, t: torch.zeros_like(x)         # noqa: E731
    out = flow.sample(cond, noise, steps=10, guidance=3.0, uncond_velocity=uncond)
    assert torch.allclose(out, torch.full_like(out, 3.0))


def test_interpolation_and_target_are_consistent():
    x0, noise = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    t = torch.tensor([0.0, 0.5, 1.0])
    x_t = RectifiedFlow.interpolate(x0, noise, t)
    assert torch.allclose(x_t[0], x0[0]) and torch.allclose(x_t[2], noise[2])
    # Moving along the target velocity from x_t for time t lands on the data.
    assert torch.allclose(x_t[1] - 0.5 * RectifiedFlow.velocity_target(x0, noise)[1], x0[1], atol=1e-6)


def test_shift_ratio_follows_open_sora():
    flow = RectifiedFlow(DiffusionConfig(shift_base_pixels=512 * 512, shift_base_frames=1))
    assert flow.shift_ratio(512, 512, 1) == 1.0
    assert math.isclose(flow.shift_ratio(1024, 1024, 4), 2.0 * 2.0)
    t = torch.tensor([0.0, 0.5, 1.0])
    shifted = RectifiedFlow.shift(t, 3.0)
    assert shifted[0] == 0 and shifted[2] == 1 and math.isclose(shifted[1].item(), 0.75)
    assert RectifiedFlow(DiffusionConfig(shift=False)).shift_ratio(1024, 1024, 9) == 1.0


def test_logit_normal_timesteps_are_centred_and_bounded():
    flow = RectifiedFlow(DiffusionConfig())
    t = flow.sample_timesteps(50_000, 1.0, torch.Generator().manual_seed(0))
    assert 0 < t.min() and t.max() < 1
    assert abs(t.median().item() - 0.5) < 0.01
    # A larger ratio moves the distribution towards noise.
    assert flow.sample_timesteps(50_000, 4.0, torch.Generator().manual_seed(0)).median() > 0.75
