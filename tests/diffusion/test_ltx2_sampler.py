"""LTX-2's dev sampler (videodit/diffusion/ltx2_sampler.py) against ltx-pipelines' one-stage loop
(``LTX2Scheduler``, ``GaussianNoiser``, ``VideoConditionByLatentIndex``, ``FactoryGuidedDenoiser``
with CFG, STG and rescale, ``EulerDiffusionStep``) run with a stand-in transformer
(scripts/make_ltx2_schedule_fixtures.py); LTX-2 itself is not needed.

Where the fixtures were written (torch 2.14.1, x86-64, AVX-512 kernels) the schedules and every loop
are bit-exact. Elsewhere exp, tanh, sin and the matmul may round differently by an ulp, and the
loops compound it over up to 40 steps. With torch's scalar kernels (``ATEN_CPU_CAPABILITY=default``)
the schedules moved by 1.8e-7 and the loops by up to 5.1e-7 of the output's largest value; allowed:
1e-6 and 1e-5 (the bound the Wan sampler tests use).
"""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from videodit.diffusion import ltx2_sampler as sampler
from videodit.diffusion.ltx2_schedule import from_tokens, to_tokens

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ltx2_schedule"
CASES = json.loads((FIXTURES / "cases.json").read_text())
TENSORS = load_file(FIXTURES / "tensors.safetensors")
LATENT = tuple(CASES["loop_model"]["latent"])


def velocity(context: torch.Tensor, keep: float):
    """The fixtures' stand-in transformer (see the script) on one branch: ``context`` the prompt's or
    the negative prompt's text, ``keep`` 0 for the STG branch (its "self-attention" skipped)."""
    w = {k: TENSORS[f"loop.model.{k}"] for k in "WPM"}

    def v(x, sigma_tokens, sigma):
        b = x.shape[0]
        tokens, ts = to_tokens(x), sigma_tokens.reshape(b, -1, 1)
        text = (context.mean(dim=1) * w["P"])[:, None, :]
        mix = tokens.mean(dim=1, keepdim=True) * w["M"]
        out = (tokens @ w["W"].T + 0.3 * torch.tanh(tokens) + text * torch.cos(math.pi / 2 * ts)
               + 0.1 * torch.sin(3 * ts) + 0.05 * sigma.view(b, 1, 1) + keep * mix)
        return from_tokens(out, x.shape)
    return v


COND, UNCOND, PERTURBED = (velocity(TENSORS["loop.prompt"], 1.0), velocity(TENSORS["loop.negative"], 1.0),
                           velocity(TENSORS["loop.prompt"], 0.0))


def run(case, noise=None, first_frame=None):
    noise = sampler.initial_noise(LATENT, torch.Generator().manual_seed(case["seed"])) if noise is None else noise
    if first_frame is None and case["strength"] is not None:
        first_frame = sampler.FirstFrame(TENSORS["loop.image"], case["strength"])
    return sampler.sample(COND, noise, sampler.sigmas(case["steps"], case["tokens"]),
                          sampler.Guidance(case["cfg"], case["stg"], case["rescale"]),
                          uncond=UNCOND, perturbed=PERTURBED, first_frame=first_frame)


@pytest.mark.parametrize("case", CASES["schedules"], ids=lambda c: c["key"])
def test_schedule_is_ltx2schedulers(case):
    got = sampler.sigmas(case["steps"], case["tokens"], stretch=case["stretch"])
    want = TENSORS[case["key"]]
    assert got.dtype == torch.float32 and got.shape == (case["steps"] + 1,)
    assert (got - want).abs().max() <= 1e-6                   # measured 0
    assert got[-1] == 0 and torch.all(got[1:] < got[:-1])
    if case["stretch"]:
        assert got[-2] == pytest.approx(sampler.TERMINAL, abs=1e-6)
    if case["steps"] > 1 or not case["stretch"]:
        assert got[0] == pytest.approx(1, abs=1e-6)
    else:                                  # one step: its only sigma is stretched to the terminal, as LTX's
        assert got[0] == pytest.approx(sampler.TERMINAL, abs=1e-6)


@pytest.mark.parametrize("case", CASES["loops"], ids=lambda c: c["name"])
def test_loop_matches_ltx_pipelines(case):
    with torch.no_grad():
        x = run(case)
    want = TENSORS[f"loop.{case['name']}.x"]
    assert x.shape == want.shape == LATENT
    assert (x - want).abs().max() <= 1e-5 * want.abs().max()   # measured 0
    if case["strength"] == 1.0:
        assert torch.equal(x[:, :, :1], TENSORS["loop.image"])   # the given frame comes out as given


def test_the_model_sees_sigma_zero_on_the_given_frame():
    seen = []

    def spy(x, sigma_tokens, sigma):
        seen.append((sigma_tokens.clone(), sigma.clone()))
        return COND(x, sigma_tokens, sigma)

    noise = sampler.initial_noise(LATENT, torch.Generator().manual_seed(0))
    schedule = sampler.sigmas(4)
    sampler.sample(spy, noise, schedule, sampler.Guidance(1.0, 0.0, 0.0),
                   first_frame=sampler.FirstFrame(TENSORS["loop.image"]))
    frame = LATENT[3] * LATENT[4]
    assert len(seen) == 4
    for (tokens, sigma), s in zip(seen, schedule[:-1]):
        assert tokens.shape == (1, LATENT[2] * frame) and torch.equal(sigma, s.expand(1))
        assert torch.all(tokens[:, :frame] == 0) and torch.all(tokens[:, frame:] == s)


def test_a_batch_samples_as_its_samples_alone():
    """The rescale's deviations are per sample: a sample's result does not depend on its batch."""
    case = next(c for c in CASES["loops"] if c["name"] == "t2v_dev")
    noise = torch.cat([sampler.initial_noise(LATENT, torch.Generator().manual_seed(s)) for s in (1, 2)])
    with torch.no_grad():
        both = run(case, noise)
        alone = torch.cat([run(case, noise[i:i + 1]) for i in range(2)])
    assert (both - alone).abs().max() <= 1e-6 * alone.abs().max()


def test_guidance_combines_in_ltxs_order():
    c, u, p = (torch.randn(2, 3, 2, 2, 2, generator=torch.Generator().manual_seed(i)) for i in range(3))
    plain = sampler.guide(c, u, p, sampler.Guidance(3.0, 1.0, 0.0))
    assert torch.equal(plain, c + 2.0 * (c - u) + 1.0 * (c - p))
    rescaled = sampler.guide(c, u, p, sampler.Guidance(3.0, 1.0, 0.7))
    for i in range(2):
        factor = 0.7 * c[i].std() / plain[i].std() + 0.3
        assert torch.allclose(rescaled[i], plain[i] * factor, rtol=1e-6, atol=1e-7)
    assert torch.equal(sampler.guide(c, None, None, sampler.Guidance(1.0, 0.0, 0.0)), c)


def test_missing_branches_are_named():
    noise = torch.zeros(LATENT)
    with pytest.raises(ValueError, match="uncond"):
        sampler.sample(COND, noise, sampler.sigmas(2), sampler.Guidance(3.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="perturbed"):
        sampler.sample(COND, noise, sampler.sigmas(2), sampler.Guidance(1.0, 1.0, 0.0))


def test_dev_defaults():
    assert sampler.Guidance() == sampler.Guidance(cfg=3.0, stg=1.0, rescale=0.7)
    assert sampler.STEPS == {"2.0": 40, "2.3": 30} and sampler.STG_BLOCK == {"2.0": 29, "2.3": 28}
    assert torch.equal(sampler.sigmas(30), sampler.sigmas(30, 4096))       # pipelines: no latent = 4096
