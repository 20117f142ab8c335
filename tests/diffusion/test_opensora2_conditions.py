"""Open-Sora 2.0's conditioning modes against its ``prepare_visual_condition_causal`` /
``_uncausal`` and ``prepare_inference_condition`` (fixtures from
scripts/make_opensora2_sampler_fixtures.py, with the fake VAE of opensora2_fake_vae.py)."""

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from opensora2_fake_vae import FakeVAE
from tolerance import assert_close
from videodit.diffusion import visual_condition as vc
from videodit.errors import UserError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "opensora2"
CASES = json.loads((FIXTURES / "sampler_cases.json").read_text())


@pytest.fixture(scope="module")
def tensors():
    return load_file(FIXTURES / "sampler_tensors.safetensors")


@pytest.mark.parametrize("case", CASES["conditions"], ids=lambda c: f"{c['vae']}-{c['mode']}")
def test_training_condition_equals_open_soras(case, tensors):
    vae = FakeVAE(case["vae"] == "causal")
    rule = vc.FrameRule.of(vae)
    assert rule.causal == vae.causal and rule.ratio == 4
    video = tensors[f"cond.{case['vae']}.video"]
    x0 = vae.encode(video)
    assert_close(x0, tensors[f"cond.{case['vae']}.x0"], 1e-6, "x0")
    weights = vc.check_condition_config(case["weights"])
    modes = [vc.pick(vc.usable(weights, x0.shape[2], rule), u) for u in case["uniforms"]]
    cond = vc.build_condition(modes, x0, rule, video, vae.encode)
    assert_close(cond, tensors[f"cond.{case['vae']}.{case['mode']}"], 1e-6, "cond")


def test_pick_is_random_choices_given_its_uniform():
    weights = {"t2v": 1.0, "i2v_head": 5.0, "i2v_loop": 1.0, "i2v_tail": 1.0}
    rng = random.Random(3)
    for _ in range(200):
        state = rng.getstate()
        expected = rng.choices(list(weights), weights=list(weights.values()), k=1)[0]
        rng.setstate(state)
        assert vc.pick(weights, rng.random()) == expected


def test_draws_follow_the_weights_and_skip_images_and_short_clips():
    rule = vc.FrameRule(ratio=4, causal=True)
    weights = vc.check_condition_config({"t2v": 1, "i2v_head": 5, "v2v_head": 2})
    modes = vc.draw_modes(weights, 4000, 10, rule, torch.Generator().manual_seed(0))
    share = {m: modes.count(m) / len(modes) for m in weights}
    assert abs(share["i2v_head"] - 5 / 8) < 0.03 and abs(share["v2v_head"] - 2 / 8) < 0.03
    assert vc.draw_modes(weights, 5, 1, rule, torch.Generator()) == ["t2v"] * 5            # an image
    short = vc.draw_modes(weights, 500, 9, rule, torch.Generator().manual_seed(1))     # 9 latent frames: no v2v
    assert "v2v_head" not in short and "i2v_head" in short


def test_from_latents_alone_non_causal_v2v_is_exact_and_i2v_takes_the_clips_frames(tensors):
    vae = FakeVAE(causal=False)
    rule = vc.FrameRule.of(vae)
    video = tensors["cond.uncausal.video"]
    x0 = vae.encode(video)
    cached = vc.build_condition(["v2v_tail_easy", "v2v_tail_easy"], x0, rule)
    assert_close(cached, tensors["cond.uncausal.v2v_tail_easy"], 1e-6, "cond")
    i2v = vc.build_condition(["i2v_loop", "t2v"], x0, rule)
    assert torch.equal(i2v[0, 1:, [0, -1]], x0[0, :, [0, -1]]) and not i2v[1].any()


def test_loss_frames_drop_the_given_i2v_frames_only():
    keep = vc.loss_frames(["t2v", "i2v_head", "i2v_tail", "i2v_loop", "v2v_head"], 5)
    assert keep.tolist() == [[True] * 5, [False] + [True] * 4, [True] * 4 + [False],
                             [False, True, True, True, False], [True] * 5]


@pytest.mark.parametrize("vae_kind", ["causal", "uncausal"])
@pytest.mark.parametrize("mode", vc.MODES[1:])
def test_sampling_reference_condition_equals_open_soras(mode, vae_kind, tensors):
    vae = FakeVAE(vae_kind == "causal")
    reference = tensors[f"ref.{vae_kind}.video"]
    ref = vc.reference_condition(mode, 20, vc.FrameRule.of(vae), vae.encode, reference)
    assert_close(ref.cond, tensors[f"ref.{vae_kind}.{mode}"], 1e-6, "cond")
    x = torch.full((1, 4, 20, 1, 1), 7.0)
    restored = ref.restore(x)
    given = ref.cond[:, :1].bool().expand_as(x)
    if mode.startswith("i2v"):   # Open-Sora puts the given frame back before decoding; v2v keeps its own
        assert torch.equal(restored[given], ref.cond[:, 1:][given]) and (restored[~given] == 7).all()
    else:
        assert torch.equal(restored, x)


@pytest.mark.parametrize("weights, words", [
    ({"i2v_hed": 1}, "unknown mode"), ({"t2v": -1}, ">= 0"), ({"t2v": 0}, "not all 0"), ([1, 2], "mapping"),
    ({"t2v": True}, ">= 0"),
])
def test_bad_condition_config_is_one_line(weights, words):
    with pytest.raises(UserError) as err:
        vc.check_condition_config(weights)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_reference_errors_name_the_fix():
    rule = vc.FrameRule(ratio=4, causal=True)
    vae = FakeVAE(True)
    with pytest.raises(UserError, match="at least 33 reference frames"):
        vc.reference_condition("v2v_head", 20, rule, vae.encode, torch.zeros(3, 20, 8, 8))
    with pytest.raises(UserError, match="nothing is left to generate"):
        vc.reference_condition("v2v_head", 9, rule, vae.encode, torch.zeros(3, 40, 8, 8))


@pytest.mark.parametrize("module, name, causal", [("hunyuan_vae", "HunyuanVAE", True),
                                                  ("dc_ae_vae", "OpenSoraDCAE", False)])
def test_frame_rule_of_open_soras_autoencoders(module, name, causal):
    """The rule read off the adapters' own size rules (no weights needed): the Hunyuan VAE is causal
    (33 frames -> 9), the Video DC-AE is not (32 -> 8)."""
    import importlib
    import types

    vae = types.SimpleNamespace(temporal_compression=4, spatial_compression=8)
    vae.latent_size = types.MethodType(getattr(importlib.import_module(f"videodit.models.mmdit.{module}"),
                                               name).latent_size, vae)
    rule = vc.FrameRule.of(vae)
    assert rule == vc.FrameRule(4, causal)
    assert rule.given_frames("v2v_head") == (9 if causal else 8) and rule.given_frames("v2v_tail_easy") == 16 + causal
