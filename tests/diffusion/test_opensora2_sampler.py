"""Open-Sora 2.0's sampling loop (``prepare_api``: get_schedule, I2VDenoiser's three-way CFG, the
i2v frame put back) with its tiny MMDiTModel against videodit's sampler with videodit's MMDiT on the
same weights (fixtures from scripts/make_opensora2_sampler_fixtures.py)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tolerance import assert_close
from videodit.config import DiffusionConfig
from videodit.diffusion import opensora2_sampler as sampler
from videodit.diffusion.rectified_flow import RectifiedFlow
from videodit.diffusion.visual_condition import ReferenceCondition
from videodit.models.mmdit.model import MMDiT, MMDiTGeometry
from videodit.sample import denoise

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "opensora2"
CASES = json.loads((FIXTURES / "sampler_cases.json").read_text())
# Open-Sora's float32 time grid: a torch elementwise shift whose last bit depends on the CPU's kernels
# (1 ulp, 1.2e-7, with scalar kernels against the fixture): ten times that, rounded up.
SCHEDULE = 2e-6


@pytest.fixture(scope="module")
def tensors():
    return load_file(FIXTURES / "sampler_tensors.safetensors")


@pytest.fixture(scope="module")
def model():
    m = CASES["model"]
    patch = int((m["in_channels"] // 4) ** 0.5)
    geometry = MMDiTGeometry(hidden_size=m["hidden_size"], num_heads=m["num_heads"], depth=m["depth"],
                             depth_single_blocks=m["depth_single_blocks"], latent_channels=4,
                             mlp_ratio=m["mlp_ratio"], patch_size=(1, patch, patch), vec_in_dim=m["vec_in_dim"],
                             context_in_dim=m["context_in_dim"], axes_dim=tuple(m["axes_dim"]), theta=m["theta"],
                             qkv_bias=m["qkv_bias"], cond_embed=m["cond_embed"])
    net = MMDiT(geometry).eval()
    net.load_state_dict(load_file(FIXTURES / "sampler_model.safetensors"), strict=True)
    return net


def reference(case, tensors) -> ReferenceCondition | None:
    """cond [1, 5, T, H, W] as prepare_inference_condition places the encoded reference(s)."""
    mode = case["mode"]
    if mode == "t2v":
        return None
    refs = [tensors[f"loop.{case['name']}.ref{i}"] for i in range(2) if f"loop.{case['name']}.ref{i}" in tensors]
    cond = torch.zeros(1, 5, case["latent_frames"], *refs[0].shape[-2:])
    places = {"i2v_head": [slice(0, 1)], "i2v_tail": [slice(-1, None)], "i2v_loop": [slice(0, 1), slice(-1, None)],
              "v2v_tail": [slice(-refs[0].shape[1], None)]}[mode]
    for frames, ref in zip(places, refs):
        cond[0, 0, frames], cond[0, 1:, frames] = 1.0, ref
    return ReferenceCondition(mode, cond)


@pytest.mark.parametrize("case", CASES["loops"], ids=lambda c: c["name"])
def test_three_way_cfg_loop_matches_open_sora(case, model, tensors):
    name = case["name"]
    noise = tensors[f"loop.{name}.noise"]
    flow = RectifiedFlow(DiffusionConfig(shift_rule="opensora2", sigma_min=1e-5))
    alpha = flow.shift_ratio(0, 0, noise.shape[2], noise.shape[-2:], patch=2)
    assert_close(torch.tensor(sampler.schedule(case["steps"], alpha)), torch.tensor(case["times"]), SCHEDULE, "times")
    guidance = sampler.ThreeWayGuidance(7.5, 3.0, case["oscillation"], case["oscillation"], case["ramp"])
    negative = (tensors["loop.text.empty"][None], None, tensors["loop.pooled.empty"][None])
    with torch.no_grad():
        x = denoise(model, flow, noise, tensors["loop.text.prompt"][None], None,
                    steps=case["steps"], guidance=7.5, ratio=alpha, negative=negative,
                    pooled=tensors["loop.pooled.prompt"][None], three_way=guidance,
                    condition=reference(case, tensors))
    expected = tensors[f"loop.{name}.x"]
    assert_close(x, expected, 1e-4, f"the {name} loop's x")


def test_oscillation_and_ramp_follow_open_sora():
    g = sampler.ThreeWayGuidance(7.5, 3.0, True, True, True)
    assert [sampler.oscillated(7.5, i) for i in (0, 9, 10, 11, 12, 13)] == [7.5, 7.5, 7.5, 1.0, 7.5, 1.0]
    assert sampler.image_scale(g, 11, 20, 5) == 1.0                      # oscillated to 1: no ramp
    ramp = sampler.image_scale(g, 0, 20, 5)
    assert ramp[0] == 1.0 and ramp[-1] == 3.0 and torch.all(ramp[1:] >= ramp[:-1])
    later = sampler.image_scale(g, 10, 20, 5)
    assert later[-1] == torch.linspace(3.0, 1.0, 21)[10]


def test_nothing_given_is_two_way_cfg():
    c, u = torch.randn(2, 4, 3, 2, 2), torch.randn(2, 4, 3, 2, 2)
    assert torch.equal(sampler.combine(c, u, u, 7.5, 3.0), u + 7.5 * (c - u))
