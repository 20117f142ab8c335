"""Wan2.1's samplers against fixtures written by Wan's own scheduler
(scripts/make_wan_sampler_fixtures.py); Wan itself is not needed."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tolerance import assert_close
from videodit.diffusion import flow_euler, flow_unipc
from videodit.errors import UserError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "wan_sampler"
META = json.loads((FIXTURES / "cases.json").read_text())
TENSORS = load_file(FIXTURES / "fixtures.safetensors")


def velocity(which: str, x: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """The fixtures' fake model (see the script); ``tau`` is the timestep the model is given."""
    tau = tau.to(torch.float32).view(-1, 1, 1, 1, 1)
    w, b = TENSORS[f"model.w_{which}"], TENSORS[f"model.b_{which}"].view(1, -1, 1, 1, 1)
    return (torch.einsum("oc,bcthw->bothw", w, x) + 0.3 * torch.tanh(x)
            + b * torch.cos(math.pi * tau / 1000) + 0.1 * torch.sin(3 * tau / 1000))


def cond(x, t):
    return velocity("cond", x, t * 1000)        # a model that scales t by 1000, as Wan's does


def uncond(x, t):
    return velocity("uncond", x, t * 1000)


@pytest.mark.parametrize("case", META["grids"], ids=lambda c: c["key"])
def test_grid_is_wans(case):
    sigmas, timesteps = flow_unipc.grid(case["steps"], case["shift"])
    assert torch.equal(timesteps, TENSORS[case["key"] + ".timesteps"])
    assert timesteps.dtype == torch.int64
    assert sigmas.dtype == torch.float32 and sigmas[-1] == 0
    assert_close(sigmas, TENSORS[case["key"] + ".sigmas"], 1e-7, "sigmas")
    assert torch.equal(flow_unipc.sigmas(case["steps"], case["shift"]), sigmas)
    assert torch.equal(flow_unipc.timesteps(case["steps"], case["shift"]), timesteps)


@pytest.mark.parametrize("case", META["unipc"], ids=lambda c: c["key"])
def test_unipc_sample_matches_wan(case):
    got = flow_unipc.sample(cond, TENSORS["noise"], case["steps"], case["shift"], case["guidance"], uncond)
    assert_close(got, TENSORS[case["key"]], 1e-5, 'got')        # measured <= 6e-7


@pytest.mark.parametrize("case", META["euler"], ids=lambda c: c["key"])
def test_euler_sample_matches_diffusers_euler_on_wans_grid(case):
    got = flow_euler.sample(cond, TENSORS["noise"], case["steps"], case["shift"], case["guidance"], uncond)
    assert_close(got, TENSORS[case["key"]], 1e-5, 'got')        # measured 0


@pytest.mark.parametrize("module", [flow_unipc, flow_euler], ids=["unipc", "euler"])
def test_the_model_sees_wans_timesteps(module):
    seen = []

    def spy(x, t):
        seen.append(t)
        return cond(x, t)

    module.sample(spy, TENSORS["noise"], 40, 12.0)
    wan = TENSORS["grid.40x12.timesteps"]
    t = torch.stack(seen)                                          # [steps, B]
    assert t.dtype == torch.float32 and t.shape == (40, TENSORS["noise"].shape[0])
    assert torch.equal((t * 1000).round().to(torch.int64), wan[:, None].expand_as(t))
    assert ((t.double() * 1000) - wan[:, None]).abs().max() < 1e-4


@pytest.mark.parametrize("steps,shift", [(40, 12.0), (10, 5.0), (50, 5.0), (50, 3.0)])
def test_diffusers_flow_unipc_grid_is_not_wans(steps, shift):
    """diffusers' UniPC with flow sigmas (what the Wan-Diffusers checkpoints ship) spaces
    linspace(1, 1/1000) instead of Wan's linspace(0.999, 0): a different sampler."""
    diffusers = pytest.importorskip("diffusers")
    theirs = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                               flow_shift=shift)
    theirs.set_timesteps(steps)
    sigmas, timesteps = flow_unipc.grid(steps, shift)
    gap = (theirs.sigmas - sigmas).abs().max().item()
    assert gap > 2e-3
    assert not torch.equal(theirs.timesteps, timesteps)
    assert abs(theirs.sigmas[0].item() - (1 - 1e-6)) < 1e-7 < 1 - 1e-6 - sigmas[0].item()
    if (steps, shift) == (40, 12.0):
        assert gap == pytest.approx(7.32e-3, abs=5e-5)              # at the last non-zero sigma
        assert (theirs.sigmas - sigmas).abs().argmax() == steps - 1


@pytest.mark.parametrize("steps,shift", [(10, 12.0), (40, 12.0), (50, 5.0)])
def test_diffusers_default_euler_grid_is_not_wans(steps, shift):
    """FlowMatchEulerDiscreteScheduler(shift=k) shifts its smallest sigma twice, so its grid
    stops at shift(shift(1/1000)) before the jump to 0: why flow_euler uses Wan's grid."""
    diffusers = pytest.importorskip("diffusers")
    theirs = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)
    theirs.set_timesteps(steps)
    once = shift * 1e-3 / (1 + (shift - 1) * 1e-3)
    assert theirs.sigmas[-2].item() == pytest.approx(shift * once / (1 + (shift - 1) * once), rel=1e-5)
    assert (theirs.sigmas - flow_unipc.sigmas(steps, shift)).abs().max() > 0.05


@pytest.mark.parametrize("steps,shift", [(10, 1.0), (40, 3.0)])
def test_unipc_is_more_accurate_than_euler(steps, shift):
    """x0 ~ N(mu, sd^2) has a closed-form velocity, and in 1-D the flow's ODE maps the marginal
    at the first sigma to the target by the one increasing affine map: an exact answer."""
    mu, sd = 1.5, 0.4

    def exact(x, t):
        t = t.view(-1, 1).double()
        var = (1 - t) ** 2 * sd**2 + t**2
        return (t - (1 - t) * sd**2) / var * (x - (1 - t) * mu) - mu

    noise = torch.randn(256, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    s0 = flow_unipc.sigmas(steps, shift)[0].item()
    target = mu + sd * (noise - (1 - s0) * mu) / ((1 - s0) ** 2 * sd**2 + s0**2) ** 0.5
    err_unipc = (flow_unipc.sample(exact, noise, steps, shift) - target).abs().max().item()
    err_euler = (flow_euler.sample(exact, noise, steps, shift) - target).abs().max().item()
    assert err_unipc < err_euler / 10                    # measured 1.2e-2 vs 0.19, 2.5e-3 vs 0.10


@pytest.mark.parametrize("module", [flow_unipc, flow_euler], ids=["unipc", "euler"])
def test_guidance_one_skips_the_unconditional_model(module):
    def fail(x, t):
        raise AssertionError("called")

    plain = module.sample(cond, TENSORS["noise"], 3, 5.0)
    assert torch.equal(module.sample(cond, TENSORS["noise"], 3, 5.0, 1.0, fail), plain)


@pytest.mark.parametrize("module", [flow_unipc, flow_euler], ids=["unipc", "euler"])
def test_given_frames_are_kept_and_dtype_returned(module):
    noise = TENSORS["noise"].to(torch.bfloat16)
    first = torch.full_like(noise[:, :, :1], 0.25)

    def put(x):
        return torch.cat([first.to(x.dtype), x[:, :, 1:]], dim=2)

    out = module.sample(cond, noise, 4, 5.0, 5.0, uncond, given=put)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[:, :, :1], first)


@pytest.mark.parametrize("steps,shift", [(0, 5.0), (-3, 5.0), (2.5, 5.0), (True, 5.0), ("10", 5.0), (10, 0.0),
                                         (10, -1.0), (10, float("nan")), (10, float("inf")), (10, None)])
@pytest.mark.parametrize("call", ["sigmas", "timesteps", "unipc", "euler"])
def test_bad_inputs_are_user_errors(call, steps, shift):
    run = {"sigmas": lambda: flow_unipc.sigmas(steps, shift),
           "timesteps": lambda: flow_unipc.timesteps(steps, shift),
           "unipc": lambda: flow_unipc.sample(cond, TENSORS["noise"], steps, shift),
           "euler": lambda: flow_euler.sample(cond, TENSORS["noise"], steps, shift)}[call]
    with pytest.raises(UserError):
        run()


def test_a_shift_too_large_for_float32_is_a_user_error():
    with pytest.raises(UserError, match="smaller shift"):
        flow_unipc.sample(cond, TENSORS["noise"], 10, 1e9)


@pytest.mark.parametrize("case", META["experts"], ids=lambda c: c["key"])
def test_two_experts_switch_at_the_boundary_with_their_own_guidance(case):
    """Wan 2.2 A14B's loop: the high-noise expert while Wan's integer timestep >= boundary x 1000
    (videodit's rule, ``high_noise``), each expert guided by its own scale."""
    from videodit.models.wan.experts import expert_guidance, high_noise

    def routed(which):
        def v(x, t):
            suffix = "_high" if bool(high_noise(t[:1], case["boundary"])) else ""
            return velocity(which + suffix, x, t * 1000)
        return v

    want = TENSORS[case["key"]]
    got = flow_unipc.sample(routed("cond"), TENSORS["noise"], case["steps"], case["shift"],
                            expert_guidance(case["boundary"], tuple(case["guidance"])), routed("uncond"))
    assert_close(got, want, 1e-5, 'got')
