"""Wan's image-conditioned DiTs against Wan's own code and diffusers, through the golden fixtures of
tests/fixtures/wan_variants (scripts/make_wan_variant_fixtures.py): Wan 2.1 I2V with CLIP features,
a Wan 2.2 I2V-A14B expert, and Wan 2.2 TI2V-5B with a time per sample and per token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tolerance import assert_close
from videodit.models.wan import load_wan, write_wan_folder

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "wan_variants"
META = json.loads((FIXTURE / "cases.json").read_text())
# Bounds on the deviation relative to the expected output's max: ten times the worst measured across
# CPUs (AVX-512, AVX2, scalar kernels), thread counts and torch/transformers releases (docs/testing.md).
FORWARD = 1e-4      # worst 6.4e-6
CASES = [(variant, case) for variant, info in META["variants"].items() for case in info["cases"]]

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def cases() -> dict[str, dict[str, torch.Tensor]]:
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(FIXTURE / "cases.safetensors")).items():
        variant, case, name = key.split(".", 2)
        grouped.setdefault(f"{variant}.{case}", {})[name] = tensor
    return grouped


def run(model, case: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(case["x"], case["t"], case["context"], image=case.get("image"))


@pytest.mark.parametrize("layout", ["wan", "diffusers"])
@pytest.mark.parametrize("variant, name", CASES)
def test_forward_matches_wan_from_either_layout(cases, variant, name, layout):
    model = load_wan(FIXTURE / variant / layout).eval()
    assert model.geometry.task == META["variants"][variant]["config"]["model_type"]
    assert (model.geometry.image_dim is not None) == (variant == "i2v21")
    case = cases[f"{variant}.{name}"]
    assert_close(run(model, case), case["out"], FORWARD, "against Wan's")


@pytest.mark.parametrize("variant, name", CASES)
def test_forward_matches_diffusers(cases, variant, name):
    model = load_wan(FIXTURE / variant / "wan").eval()
    reference = diffusers.WanTransformer3DModel.from_pretrained(FIXTURE / variant / "diffusers").eval()
    case = cases[f"{variant}.{name}"]
    context = F.pad(case["context"], (0, 0, 0, 512 - case["context"].shape[1]))
    with torch.no_grad():
        theirs = reference(case["x"], case["t"] * 1000, context, encoder_hidden_states_image=case.get("image")).sample
    assert_close(run(model, case), theirs, FORWARD, "against diffusers'")


@pytest.mark.parametrize("layout", ["wan", "diffusers"])
@pytest.mark.parametrize("variant", list(META["variants"]))
def test_export_round_trips_each_variant(tmp_path, cases, variant, layout):
    """Written in either layout and read back: the same geometry and the same tensors; Wan's own
    config.json fields (model_type, in_dim) as Wan wrote them."""
    model = load_wan(FIXTURE / variant / "wan").eval()
    write_wan_folder(model.state_dict(), model.geometry, tmp_path, layout=layout)
    again = load_wan(tmp_path)
    assert again.geometry == model.geometry
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    if layout == "wan":
        ours, wans = (json.loads(p.read_text()) for p in (tmp_path / "config.json", FIXTURE / variant / "wan" / "config.json"))
        assert {k: ours[k] for k in ("model_type", "in_dim", "out_dim")} == {k: wans[k] for k in ("model_type", "in_dim", "out_dim")}


def test_per_token_time_equal_everywhere_is_the_time_per_sample(cases):
    """TI2V's per-token path computes what the per-sample path does when every token has one time."""
    model = load_wan(FIXTURE / "ti2v" / "wan").eval()
    case = cases["ti2v.t2v"]
    tokens = case["x"].shape[2] * (case["x"].shape[3] // 2) * (case["x"].shape[4] // 2)
    per_token = dict(case, t=case["t"][:, None].expand(-1, tokens))
    assert_close(run(model, per_token), run(model, case), 1e-5, "per token")   # summation order differs, nothing else (4.6e-7)


def test_two_experts_route_each_sample_by_its_time(cases):
    """WanExperts: a batch across the boundary gives each sample its own expert's output."""
    from videodit.models.wan.experts import WanExperts

    high = load_wan(FIXTURE / "i2v22" / "wan").eval()
    low = load_wan(FIXTURE / "i2v22" / "diffusers").eval()
    with torch.no_grad():
        for p in low.parameters():   # another expert of the same geometry
            p.mul_(0.9)
    experts = WanExperts(high, low, boundary=0.875)
    case = cases["i2v22.batch2"]   # t = (0.3, 0.95): one sample each side
    with torch.no_grad():
        mixed = experts(case["x"], case["t"], case["context"])
        alone = [(high if t >= 0.875 else low)(case["x"][i:i + 1], case["t"][i:i + 1], case["context"][i:i + 1])
                 for i, t in enumerate(case["t"].tolist())]
    assert torch.equal(mixed, torch.cat(alone))
    assert not torch.allclose(alone[0], high(case["x"][:1], case["t"][:1], case["context"][:1]))


@pytest.mark.parametrize("folders", [("high_noise_model", "low_noise_model"), ("transformer", "transformer_2")])
def test_a_two_expert_folder_is_refused_whole_and_each_expert_reads(tmp_path, folders):
    """Wan 2.2 A14B's download or diffusers pipeline: one line naming the experts' folders (never
    its first expert taken for the model); each expert folder loads on its own."""
    import shutil

    from videodit.errors import UserError

    for name in folders:
        shutil.copytree(FIXTURE / "i2v22" / "wan", tmp_path / name)
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(UserError, match=f"two experts .*{folders[0]}/ high-noise, {folders[1]}/ low-noise"):
        load_wan(tmp_path)
    assert load_wan(tmp_path / folders[1]).geometry.task == "i2v"
