"""videodit's LTX-2 DiT against Lightricks' own ``LTXModel`` (ltx-core) and diffusers'
``LTX2VideoTransformer3DModel``, through the golden fixtures of tests/fixtures/ltx2 (written by
scripts/make_ltx2_fixtures.py with both libraries; these tests never need them): fp32 forward and
gradient parity for LTX-2.0 and 2.3, video alone and with the audio stream, the parameter counts
of the released configurations, the FLOP model.

Tolerances (``tests/tolerance.py``): forward 1e-5 of the output's largest value, gradients 1e-4 of
each gradient's. Measured (x86, torch 2.14, diffusers 0.42): forward at most 4.4e-7 against either
library (a factor 23 below), gradients at most 1.7e-6 (a factor 59 below)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tolerance import assert_close, relative
from videodit.config.schema import ModelConfig
from videodit.models.families import get_spec
from videodit.models.ltx2.flops import grid_flops
from videodit.models.ltx2.layouts import load_ltx2, release_name
from videodit.models.spec import count_parameters

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ltx2"
VERSIONS = ("ltx2.0", "ltx2.3")
CASES = ("t2v", "i2v", "batch", "odd", "one_frame", "av", "av_i2v", "av_same")
DIFFUSERS_CASES = ("t2v", "i2v", "batch", "odd", "one_frame", "av_same")   # where diffusers computes the same
FORWARD, GRADIENT = 1e-5, 1e-4


@pytest.fixture(scope="module")
def cases() -> dict[str, dict[str, torch.Tensor]]:
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(FIXTURE / "cases.safetensors")).items():
        version, case, name = key.split("/", 2)
        grouped.setdefault(f"{version}/{case}", {})[name] = tensor
    return grouped


@pytest.fixture(scope="module")
def record() -> dict:
    return json.loads((FIXTURE / "cases.json").read_text())


@pytest.fixture(scope="module")
def models():
    return {version: load_ltx2(FIXTURE / version / "ltx-2-tiny.safetensors").eval() for version in VERSIONS}


def run(model, case: dict, **leaves):
    inputs = {**case, **leaves}
    optional = {k: inputs[k] for k in ("fps", "x_mask", "context_mask", "audio", "audio_t", "audio_context")
                if k in inputs}
    result = model(inputs["x"], inputs["t"], inputs["context"], **optional)
    return result if isinstance(result, tuple) else (result, None)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", CASES)
def test_forward_matches_ltx_core(models, cases, version, name):
    case = cases[f"{version}/{name}"]
    with torch.no_grad():
        video, audio = run(models[version], case)
    assert video.shape == case["out"].shape and video.dtype == torch.float32
    assert_close(video, case["out"], FORWARD, f"{version} {name} video vs ltx-core")
    assert (audio is None) == ("audio_out" not in case)
    if audio is not None:
        assert_close(audio, case["audio_out"], FORWARD, f"{version} {name} audio vs ltx-core")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", DIFFUSERS_CASES)
def test_forward_matches_diffusers(models, cases, version, name):
    case = cases[f"{version}/{name}"]
    with torch.no_grad():
        video, audio = run(models[version], case)
    assert_close(video, case["diffusers_out"], FORWARD, f"{version} {name} video vs diffusers")
    if audio is not None:
        assert_close(audio, case["diffusers_audio_out"], FORWARD, f"{version} {name} audio vs diffusers")


def test_the_streams_meet_only_with_audio(models, cases):
    """The video stream alone is ltx-core's AV model called with audio=None; with audio, the
    cross-modal attentions change the video (and the audio's sigma reaches it through the gates)."""
    case = cases["ltx2.3/av"]
    with torch.no_grad():
        alone, _ = run(models["ltx2.3"], {k: v for k, v in case.items() if not k.startswith("audio")})
        other_sigma, _ = run(models["ltx2.3"], case, audio_t=case["audio_t"].flip(0))
    assert relative(alone, case["out"]) > 1e-3
    assert relative(other_sigma, case["out"]) > 1e-4


@pytest.mark.parametrize("version", VERSIONS)
def test_gradients_match_ltx_core_and_diffusers(cases, version):
    case = cases[f"{version}/grad"]
    model = load_ltx2(FIXTURE / version / "ltx-2-tiny.safetensors")
    leaves = {k: case[k].clone().requires_grad_() for k in ("x", "context", "audio", "audio_context")}
    video, audio = run(model, case, **leaves)
    loss = F.mse_loss(video, case["target"]) + F.mse_loss(audio, case["audio_target"])
    loss.backward()
    params = dict(model.named_parameters())
    for library in ("", "diffusers_"):
        assert_close(loss.detach(), case[f"{library}loss"], FORWARD, f"{version} {library}loss")
        for k, leaf in leaves.items():
            assert_close(leaf.grad, case[f"{library}d{k}"], GRADIENT, f"{version} {library}d{k}")
        checked = [k[len(f"{library}param."):] for k in case if k.startswith(f"{library}param.")]
        assert len(checked) >= (len(params) if not library else 20)
        for name in checked:
            assert_close(params[release_name(name)].grad, case[f"{library}param.{name}"], GRADIENT,
                         f"{version} {library}param.{name}")


# ----------------------------------------------------------------------------- sizes

@pytest.mark.parametrize("preset", ["ltx2-19b", "ltx2.3-22b"])
def test_preset_parameters_equal_ltx_cores_meta_build(record, preset):
    """ltx-core's own meta-device build of each release (18,876,174,592 and 18,988,838,144: the
    transformer with both streams and LTX-2.0's caption projections; not the connectors)."""
    spec = get_spec("ltx2")
    m = ModelConfig(preset=preset).resolved()
    latent, caption, _ = spec.released_encoders_of(m)
    with torch.device("meta"):
        model = spec.build(spec.geometry(m, latent, caption, 1024))
    assert count_parameters(model) == record["released_parameters"][preset]
    assert record["released_parameters"] == {"ltx2-19b": 18_876_174_592, "ltx2.3-22b": 18_988_838_144}


@pytest.mark.parametrize("version", VERSIONS)
def test_fixture_model_has_ltx_cores_parameter_count(models, record, version):
    assert count_parameters(models[version]) == record[version]["parameters"]


@pytest.mark.parametrize("version", VERSIONS)
def test_flops_equal_flop_counter(models, version):
    """The video stream's FLOP model against FlopCounterMode (text-to-video: one time per sample)."""
    model = models[version]
    g = model.geometry
    x, frames, positions, text = torch.randn(1, g.in_channels, 2, 3, 4), 2, 12, 5
    context = torch.randn(1, text, g.caption_channels or g.dim)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, torch.tensor([0.4]), context)   # (the math kernel: CPU's fused one is not counted)
    assert grid_flops(g, frames * positions, text).total == counter.get_total_flops()
    assert get_spec("ltx2").forward_flops(g, frames, positions, text).total == counter.get_total_flops()
