"""videodit's few-step distillation math against the public reference code, through the fixture that
scripts/make_distill_fixtures.py wrote from Self-Forcing, FastVideo and lightx2v themselves (their
functions run in float64 on stand-in score networks; tests/fixtures/distill/cases.json says which
commits, files and settings). fp64 throughout, so the bound is 1e-10.

Conventions mapped here: Self-Forcing writes guidance in the DMD2 form ``cond + w (cond - uncond)``
(w = 3), FastVideo and videodit in Ho-Salimans form (``dmd2_form`` maps ours onto theirs);
lightx2v's timesteps are on the 1000-grid where videodit's are sigmas; its velocity is
``noise - x0`` as ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tolerance import assert_close
from videodit.distill.dmd import dmd2_form, dmd_gradient, generator_loss, guided
from videodit.distill.schedule import step, warp

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "distill"
BOUND = 1e-10
STEPS = [1000, 750, 500, 250]
SHIFT = 5
CASES = json.loads((FIXTURE / "cases.json").read_text())


@pytest.fixture(scope="module")
def ref() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "reference.safetensors"))


def _our_scale(reference: str) -> float:
    """Our (Ho-Salimans) guidance scale equal to the reference's."""
    case = CASES[reference]
    if case["guidance_form"].startswith("dmd2"):
        ours = case["guidance_scale"] + 1
        assert dmd2_form(ours) == case["guidance_scale"]
        return ours
    assert case["guidance_form"].startswith("ho-salimans")
    return case["guidance_scale"]


@pytest.mark.parametrize("reference, normaliser", [("self_forcing", "sample"), ("fastvideo", "batch")])
def test_dmd_gradient_and_loss_equal_reference(ref, reference, normaliser):
    x0, fake = ref["inputs.x0"], ref["inputs.x0_fake"]
    real = guided(ref["inputs.x0_real_cond"], ref["inputs.x0_real_uncond"], _our_scale(reference))
    gradient = dmd_gradient(x0, fake, real, normaliser)
    assert_close(gradient, ref[f"{reference}.grad"], BOUND, f"{reference} DMD gradient")

    x = x0.clone().requires_grad_(True)
    loss = generator_loss(x, gradient)
    assert loss.dtype == torch.float64
    assert_close(loss.detach(), ref[f"{reference}.loss"], BOUND, f"{reference} generator loss")
    loss.backward()
    assert_close(x.grad, ref[f"{reference}.loss_grad"], BOUND, f"{reference} d loss / d x0")
    assert_close(x.grad * x.numel(), gradient, BOUND, f"{reference} d loss / d x0 = g / numel")

    other = next(n for n in ("sample", "batch") if n != normaliser)      # the fixture tells them apart
    wrong = dmd_gradient(x0, fake, real, other)
    assert (wrong - ref[f"{reference}.grad"]).abs().max() > 1e-3 * ref[f"{reference}.grad"].abs().max()


def test_warp_equals_lightx2v_and_self_forcing(ref):
    assert CASES["lightx2v"]["denoising_step_list"] == STEPS and CASES["lightx2v"]["sample_shift"] == SHIFT
    sigmas = warp(STEPS, SHIFT)
    assert sigmas.dtype == torch.float64
    assert_close(sigmas, torch.tensor([1, 0.9375, 5 / 6, 0.625], dtype=torch.float64), BOUND, "warp, closed form")
    assert_close(sigmas, ref["lightx2v.sigmas"], BOUND, "warp = lightx2v sigmas")
    assert_close(1000 * sigmas, ref["lightx2v.timesteps"], BOUND, "warp = lightx2v timesteps / 1000")
    assert CASES["self_forcing"]["denoising_step_list"] == STEPS and CASES["self_forcing"]["timestep_shift"] == SHIFT
    assert_close(1000 * sigmas, ref["self_forcing.denoising_steps"], BOUND, "warp = Self-Forcing warped steps / 1000")


@pytest.mark.parametrize("index", range(len(STEPS)))
def test_step_equals_lightx2v_step_post(ref, index):
    levels = ref["lightx2v.sigmas"].tolist() + [0.0]
    x, v, noise = (ref[f"lightx2v.{k}"][index] for k in ("latents", "velocity", "noise"))
    got = step(x, v, levels[index], levels[index + 1], noise)
    assert_close(got, ref["lightx2v.step_post"][index], BOUND, f"step {index} = lightx2v step_post")
    if index == len(STEPS) - 1:                                           # the last step returns x0
        assert not CASES["lightx2v"]["noise_drawn_at_index"][index]
        assert_close(got, x - levels[index] * v, BOUND, "last step = x0")


def test_ho_salimans_equals_dmd2_form():
    gen = torch.Generator().manual_seed(0)
    cond, uncond = (torch.randn(3, 5, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    for w in (1.0, 1.5, 3.5, 4.0, 6.0, 8.0):
        dmd2 = cond + dmd2_form(w) * (cond - uncond)
        assert_close(guided(cond, uncond, w), dmd2, BOUND, f"guided({w}) = DMD2 form({dmd2_form(w)})")
    assert dmd2_form(4.0) == 3.0 and torch.equal(guided(cond, uncond, 1.0), cond)
