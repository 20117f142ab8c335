"""LTX-2's training objective (videodit/diffusion/ltx2_schedule.py) against fixtures written by
ltx-trainer's own sampler and ``flexible`` strategy (scripts/make_ltx2_schedule_fixtures.py); LTX-2
itself is not needed.

What is compared exactly and what within a tolerance: values made of uniform draws (torch's rand
is integer bits times 2^-24) and the four basic operations on them are the same on every CPU, so
the sigma's branch choice, the uniform-branch sigmas, the i2v choice and the loss mask are compared
bit for bit. Values through a normal draw or a sigmoid go through libm or vectorised exp/log/sin,
which may differ by ulps between CPUs and torch builds: those get tolerances. On the machine that
wrote the fixtures (torch 2.14.1, x86-64, AVX-512 kernels) every one of them is bit-exact except the
loss, whose reduction runs in another order (measured 1.8e-7 relative). Switching that machine to
AVX2 kernels already moves the sigmas by 1.8e-7; with torch's scalar kernels
(``ATEN_CPU_CAPABILITY=default``, as on a CPU without AVX2) the sigmas moved by up to 5.1 ulps of 1
times the stretch's magnification, x_t by 3.6e-7: the tolerances below leave a margin over these.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from videodit.diffusion import ltx2_schedule as ltx

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ltx2_schedule"
CASES = json.loads((FIXTURES / "cases.json").read_text())
TENSORS = load_file(FIXTURES / "tensors.safetensors")
ULP1 = 2.0 ** -24          # half the float32 spacing below 1


def stretch_range(tokens: int) -> float:
    mu = ltx.shift_mu(tokens)
    high, low = (torch.sigmoid(torch.tensor(mu + z)) for z in (ltx.HIGH_PERCENTILE, ltx.LOW_PERCENTILE))
    return (high - low).item()


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-12)


def test_mu_is_ltxs_line():
    for case in CASES["sigmas"]:
        assert ltx.shift_mu(case["tokens"]) == case["mu"]          # the same float64
    assert ltx.shift_mu(1024) == pytest.approx(0.95) and ltx.shift_mu(4096) == pytest.approx(2.05)
    assert ltx.shift_mu(3570) == pytest.approx(1.8616, abs=1e-4)   # 960x544x49


@pytest.mark.parametrize("case", CASES["sigmas"], ids=lambda c: c["key"])
def test_sigmas_match_ltx_trainer(case):
    batch, seed = case["batch"], case["seed"]
    got = ltx.sample_sigmas(batch, case["tokens"], torch.Generator().manual_seed(seed))
    want = TENSORS[case["key"]]
    assert got.dtype == torch.float32 and got.shape == (batch,)
    draws = torch.Generator().manual_seed(seed)
    torch.randn(batch, generator=draws)
    uniform = (1 - ltx.EPS) * torch.rand(batch, generator=draws) + ltx.EPS
    is_uniform = torch.rand(batch, generator=draws) <= ltx.UNIFORM_P
    assert torch.equal(want[is_uniform], uniform[is_uniform])          # exact on every CPU
    assert torch.equal(got[is_uniform], uniform[is_uniform])
    # The logit-normal ones: ulps of the normal and the sigmoid, magnified by the stretch (1 / 0.006 at
    # 20000 tokens). Measured 0 where the fixtures were written, 5.1 ulps with scalar kernels.
    tolerance = 16 * ULP1 / stretch_range(case["tokens"])
    assert (got - want).abs().max() <= tolerance
    assert got.min() >= 0 and got.max() <= 1


@pytest.mark.parametrize("case", CASES["objective"], ids=lambda c: c["name"])
def test_training_inputs_match_flexible_strategy(case):
    p = f"objective.{case['name']}"
    x0 = TENSORS[f"{p}.x0"]
    got = ltx.noised(x0, torch.Generator().manual_seed(case["seed"]), case["first_frame_p"] or 0.0)
    # the i2v choice and so the loss mask: uniform draws, exact everywhere
    assert torch.equal(got.loss_mask, TENSORS[f"{p}.loss_mask"].bool())
    assert torch.equal(got.sigma_tokens == 0, ~TENSORS[f"{p}.loss_mask"].bool())
    # through normal draws and the sigmoid: measured 0, with scalar kernels 1.5e-7 (sigma), 3.6e-7 (x_t)
    assert (got.sigma - TENSORS[f"{p}.sigma"]).abs().max() <= 1e-6
    assert (got.sigma_tokens - TENSORS[f"{p}.timesteps"]).abs().max() <= 1e-6
    assert relative(ltx.to_tokens(got.x_t), TENSORS[f"{p}.x_t"]) <= 1e-6
    assert relative(ltx.to_tokens(got.target), TENSORS[f"{p}.target"]) <= 1e-6
    # the loss: another summation order; measured 1.8e-7 relative
    pred = ltx.from_tokens(TENSORS[f"{p}.pred"], x0.shape)
    assert relative(ltx.masked_mse(pred, got.target, got.loss_mask), TENSORS[f"{p}.loss"]) <= 2e-6


def test_given_first_frames_are_clean_at_sigma_zero_and_out_of_the_loss():
    x0 = torch.randn(6, 4, 3, 2, 5, generator=torch.Generator().manual_seed(0))
    got = ltx.noised(x0, torch.Generator().manual_seed(0), first_frame_p=0.5)   # 3 of 6 given
    assert got.given.any() and not got.given.all()
    frame = 2 * 5
    for i, given in enumerate(got.given.tolist()):
        assert torch.equal(got.x_t[i, :, 0], x0[i, :, 0]) == given
        assert torch.equal(got.sigma_tokens[i, :frame] == 0, torch.full((frame,), given))
        assert torch.equal(got.sigma_tokens[i, frame:], got.sigma[i].expand(2 * frame))
        assert torch.equal(got.loss_mask[i, :frame], torch.full((frame,), not given))
        assert got.loss_mask[i, frame:].all()
        assert torch.equal(got.generated_frames[i], torch.tensor([not given, True, True]))
    s = got.sigma.view(-1, 1, 1, 1, 1)
    assert torch.allclose(got.x_t[~got.given], (x0 + s * got.target)[~got.given], atol=1e-5)   # (1-s) x0 + s noise


def test_without_first_frame_conditioning_nothing_more_is_drawn():
    x0 = torch.randn(3, 4, 2, 2, 2)
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    got = ltx.noised(x0, a)
    ltx.sample_sigmas(3, 8, b)
    ltx.draw_noise(x0.shape, b)
    assert torch.equal(a.get_state(), b.get_state())
    assert not got.given.any() and got.loss_mask.all()


def test_a_one_frame_clip_given_its_frame_has_loss_zero_not_nan():
    x0 = torch.randn(2, 4, 1, 2, 2)
    got = ltx.noised(x0, torch.Generator().manual_seed(0), first_frame_p=1.0)
    assert not got.loss_mask.any()
    assert torch.equal(ltx.masked_mse(torch.randn_like(x0), got.target, got.loss_mask), torch.zeros(2))


def test_masked_mse_is_the_mean_over_the_tokens_in_the_loss():
    out, target = torch.randn(2, 3, 2, 2, 2), torch.randn(2, 3, 2, 2, 2)
    everywhere = torch.ones(2, 8, dtype=torch.bool)
    assert torch.allclose(ltx.masked_mse(out, target, everywhere), (out - target).square().mean(dim=(1, 2, 3, 4)))
    later = everywhere.clone()
    later[:, :4] = False                                     # frame 0 out
    want = (out - target)[:, :, 1:].square().mean(dim=(1, 2, 3, 4))
    assert torch.allclose(ltx.masked_mse(out, target, later), want)


def test_training_noise_is_ltxs_not_a_contiguous_randn():
    """ltx-trainer's randn_like of a permuted view takes torch's element-wise sampler: other numbers."""
    shape = (2, 4, 3, 2, 2)
    noise = ltx.draw_noise(shape, torch.Generator().manual_seed(0))
    assert noise.shape == shape and noise.is_contiguous()
    assert not torch.equal(noise, torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    view = torch.zeros(shape).flatten(2).transpose(1, 2)     # LTX's token view of contiguous latents
    with torch.random.fork_rng():
        torch.manual_seed(0)
        assert torch.equal(ltx.to_tokens(noise), torch.randn_like(view))


def test_token_layout_round_trips():
    x = torch.randn(2, 5, 3, 4, 6)
    tokens = ltx.to_tokens(x)
    assert tokens.shape == (2, 72, 5)
    assert torch.equal(tokens[1, 4 * 6 + 2 * 6 + 3], x[1, :, 1, 2, 3])     # (frame, row, column) order
    assert torch.equal(ltx.from_tokens(tokens, x.shape), x)
