"""Open-Sora 2.0's objective and timestep shift against its own code (fixtures written by
scripts/make_opensora2_sampler_fixtures.py from train.py's lines and get_schedule)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tolerance import assert_close
from videodit.config import DiffusionConfig
from videodit.config.load import load_config
from videodit.diffusion import opensora2_schedule
from videodit.diffusion.rectified_flow import RectifiedFlow
from videodit.errors import UserError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "opensora2"
CASES = json.loads((FIXTURES / "sampler_cases.json").read_text())
# Open-Sora's float32 time grid: a torch elementwise shift whose last bit depends on the CPU's kernels
# (1 ulp, 1.2e-7, with scalar kernels against the fixture): ten times that, rounded up.
SCHEDULE = 2e-6


@pytest.fixture(scope="module")
def tensors():
    return load_file(FIXTURES / "sampler_tensors.safetensors")


def opensora2_flow() -> RectifiedFlow:
    return RectifiedFlow(DiffusionConfig(shift_rule="opensora2", sigma_min=1e-5))


@pytest.mark.parametrize("case", CASES["alpha"], ids=lambda c: "x".join(map(str, c["shape"])))
def test_training_shift_alpha_is_open_soras(case):
    *_, frames, height, width = case["shape"]
    pixels = (height * 8, width * 8)   # the 1.2 rule's arguments, unused by the 2.0 rule
    assert opensora2_flow().shift_ratio(*pixels, frames, (height, width)) == case["alpha"]


@pytest.mark.parametrize("case", CASES["schedules"], ids=lambda c: f"{c['steps']}x{c['frames']}p{c['patch']}")
def test_sampling_grid_is_get_schedule(case):
    alpha = opensora2_flow().shift_ratio(0, 0, case["frames"], case["latent_hw"], case["patch"])
    assert_close(torch.tensor(opensora2_schedule.schedule(case["steps"], alpha)), torch.tensor(case["times"]), SCHEDULE,
                 "times")


def test_timesteps_noisy_latents_and_target_match_train_py(tensors):
    case = CASES["objective"]
    x0, noise = tensors["objective.x0"], tensors["objective.noise"]
    flow = opensora2_flow()
    ratio = flow.shift_ratio(0, 0, x0.shape[2], x0.shape[-2:])
    assert ratio == case["alpha"]
    t = flow.sample_timesteps(x0.shape[0], ratio, torch.Generator().manual_seed(case["seed"]))
    assert_close(t, tensors["objective.t"], 1e-6, "t")     # the same normal draws give the same t
    x_t = flow.interpolate(x0, noise, t, case["sigma_min"])
    target = flow.velocity_target(x0, noise, case["sigma_min"])
    assert_close(x_t, tensors["objective.x_t"], 1e-6, "x_t")
    assert_close(target, tensors["objective.target"], 1e-6, "target")
    # the target is d x_t / d t
    dt = 1e-3
    slope = (flow.interpolate(x0, noise, t + dt, 1e-5) - flow.interpolate(x0, noise, t - dt, 1e-5)) / (2 * dt)
    assert torch.allclose(slope, target, atol=1e-3)


def test_sigma_min_zero_keeps_plain_rectified_flow_bitwise():
    g = torch.Generator().manual_seed(0)
    x0, noise, t = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g), torch.rand(2, generator=g)
    expected = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * noise
    assert torch.equal(RectifiedFlow.interpolate(x0, noise, t), expected)
    assert torch.equal(RectifiedFlow.velocity_target(x0, noise), noise - x0)


def test_opensora2_rule_needs_no_pixel_bases_and_ignores_them():
    rule = RectifiedFlow(DiffusionConfig(shift_rule="opensora2", shift_base_pixels=7, shift_scale=9.0))
    assert rule.shift_ratio(256, 256, 1, (32, 32)) == 1.0          # 256 tokens per frame at patch 2
    assert RectifiedFlow(DiffusionConfig(shift_rule="opensora2", shift=False)).shift_ratio(256, 256, 9, (64, 64)) == 1.0


@pytest.mark.parametrize("overrides, words", [
    (["diffusion.shift_rule=opensora2", "diffusion.constant_shift=5"], "constant_shift"),
    (["diffusion.sigma_min=1e-5", "diffusion.prediction=data"], "sigma_min"),
    (["diffusion.sigma_min=1e-5", "diffusion.loss_space=data"], "sigma_min"),
    (["diffusion.shift_rule=opensora3"], "shift_rule"),
])
def test_inconsistent_objective_settings_are_refused_in_one_line(overrides, words):
    with pytest.raises(UserError) as err:
        load_config("tiny", overrides)
    assert words in str(err.value) and "\n" not in str(err.value)
