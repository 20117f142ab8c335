"""videodit's Wan 2.1 DiT against Wan's own code and diffusers' WanTransformer3DModel, through the
golden fixtures of tests/fixtures/wan (written by scripts/make_wan_fixtures.py with Wan's code; these
tests never need Wan): forward and gradient parity, both weight layouts, export, strict loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tolerance import assert_close, relative
from videodit.errors import UserError
from videodit.models.wan import RMSNormAcrossHeads, WanDiT, WanGeometry, is_wan_folder, load_wan, write_wan_folder
from videodit.models.wan.layouts import from_diffusers, read_wan_folder, to_diffusers

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "wan"
CASES = ["t2v", "padded", "nonsquare", "one_frame", "batch2"]
# Bounds on the deviation relative to the expected output's max: ten times the worst measured across
# CPUs (AVX-512, AVX2, scalar kernels), thread counts and torch/transformers releases (docs/testing.md).
FORWARD = 1e-4      # worst 5.2e-6
WEIGHTS = "diffusion_pytorch_model.safetensors"

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def cases() -> dict[str, dict[str, torch.Tensor]]:
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(FIXTURE / "cases.safetensors")).items():
        case, name = key.split(".", 1)
        grouped.setdefault(case, {})[name] = tensor
    return grouped


@pytest.fixture(scope="module")
def model() -> WanDiT:
    return load_wan(FIXTURE / "wan").eval()


@pytest.fixture(scope="module")
def reference():
    """diffusers' own model, from the folder diffusers' converter and save_pretrained wrote."""
    return diffusers.WanTransformer3DModel.from_pretrained(FIXTURE / "diffusers").eval()


def run_diffusers(reference, case) -> torch.Tensor:
    # diffusers' model does not pad the captions (its pipeline does): pad as Wan does.
    context = F.pad(case["context"], (0, 0, 0, 512 - case["context"].shape[1]))
    with torch.no_grad():
        return reference(case["x"], case["t"] * 1000, context).sample


@pytest.mark.parametrize("name", CASES)
def test_forward_matches_wan_and_diffusers(model, reference, cases, name):
    case = cases[name]
    with torch.no_grad():
        ours = model(case["x"], case["t"], case["context"])
    assert ours.shape == case["out"].shape and ours.dtype == torch.float32
    assert_close(ours, case["out"], FORWARD, "ours against Wan's")
    theirs = run_diffusers(reference, case)
    assert_close(ours, theirs, FORWARD, "ours against diffusers'")
    assert_close(theirs, case["out"], FORWARD, "diffusers' against Wan's")   # the two references agree too


def test_gradients_match_wan(cases):
    model = load_wan(FIXTURE / "wan")
    case = cases["grad"]
    s = case["t"].view(-1, 1, 1, 1, 1)
    loss = F.mse_loss(model((1 - s) * case["x"] + s * case["noise"], case["t"], case["context"]),
                      case["noise"] - case["x"])
    loss.backward()
    assert abs(loss.item() - case["loss"].item()) <= 1e-5 * case["loss"].item()
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(k[len("param."):] for k in case if k.startswith("param."))
    worst = max(relative(p.grad, case[f"param.{n}"]) for n, p in model.named_parameters())
    assert worst <= 1e-4


def test_per_token_modulation_matches_shared(model, cases):
    case = cases["t2v"]
    tokens, e0, e, context, rope = model.embed(case["x"], case["t"], case["context"])
    assert rope.shape == (tokens.shape[1], model.geometry.head_dim // 2, 2) and rope.dtype == torch.float32
    assert e0.dtype == e.dtype == tokens.dtype == torch.float32
    per_token = e0[:, None].expand(-1, tokens.shape[1], -1, -1)
    block = model.blocks[0]
    with torch.no_grad():
        assert torch.equal(block(tokens, e0, context, rope), block(tokens, per_token, context, rope))
        head = model.head(tokens, e)
        assert torch.equal(head, model.head(tokens, e[:, None].expand(-1, tokens.shape[1], -1)))


def test_rms_norm_hook_spans_all_heads():
    # Tensor parallelism: each rank holds half the channels and averages the mean of squares.
    torch.manual_seed(0)
    full = RMSNormAcrossHeads(8, 1e-6)
    full.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 8)
    halves = [RMSNormAcrossHeads(4, 1e-6) for _ in range(2)]
    for i, norm in enumerate(halves):
        norm.weight.data.copy_(full.weight.data[4 * i: 4 * i + 4])
        other = x[..., 4 * (1 - i): 4 * (2 - i)]
        norm.reduce_mean_square = lambda ms, other=other: (ms + other.pow(2).mean(-1, keepdim=True)) / 2
    sharded = torch.cat([norm(x[..., 4 * i: 4 * i + 4]) for i, norm in enumerate(halves)], dim=-1)
    assert torch.allclose(sharded, full(x), atol=1e-6)


# ---------------------------------------------------------------------------- layouts

def test_both_layouts_load_the_same_weights(model):
    from_diffusers_folder = load_wan(FIXTURE / "diffusers")
    assert from_diffusers_folder.geometry == model.geometry
    ours, theirs = model.state_dict(), from_diffusers_folder.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_renames_agree_with_diffusers_converter():
    wan, dif = load_file(str(FIXTURE / "wan" / WEIGHTS)), load_file(str(FIXTURE / "diffusers" / WEIGHTS))
    converted = to_diffusers(wan)
    assert converted.keys() == dif.keys() and all(torch.equal(converted[k], dif[k]) for k in dif)
    assert from_diffusers(dif).keys() == wan.keys()


def test_geometry_read_off_wan_config_and_weights(model):
    # Wan's config.json has no text_dim/patch_size/qk_norm/cross_attn_norm: they come from the weights.
    assert "text_dim" not in json.loads((FIXTURE / "wan" / "config.json").read_text())
    assert model.geometry == WanGeometry(dim=64, ffn_dim=128, num_heads=2, num_layers=2, text_dim=32)
    assert model.geometry.rope_split == (12, 10, 10)


def test_pipeline_folder_and_detection(tmp_path, model):
    pipeline = tmp_path / "pipeline"
    shutil.copytree(FIXTURE / "diffusers", pipeline / "transformer")
    (pipeline / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    geometry, tensors = read_wan_folder(pipeline)
    assert geometry == model.geometry and set(tensors) == set(model.state_dict())
    assert all(is_wan_folder(p) for p in (FIXTURE / "wan", FIXTURE / "diffusers", pipeline))
    assert not is_wan_folder(tmp_path) and not is_wan_folder(FIXTURE.parent / "opensora" / "stdit3")


def test_export_diffusers_loads_in_diffusers(tmp_path, model, reference, cases):
    write_wan_folder(model.state_dict(), model.geometry, tmp_path, layout="diffusers")
    loaded, info = diffusers.WanTransformer3DModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
    ours_config = json.loads((tmp_path / "config.json").read_text())
    their_config = json.loads((FIXTURE / "diffusers" / "config.json").read_text())
    assert {k: v for k, v in ours_config.items() if k != "_diffusers_version"} == \
        {k: v for k, v in their_config.items() if k != "_diffusers_version"}
    case = cases["nonsquare"]
    assert torch.equal(run_diffusers(loaded.eval(), case), run_diffusers(reference, case))


def test_export_wan_round_trip(tmp_path, model):
    write_wan_folder(model.state_dict(), model.geometry, tmp_path, layout="wan")
    written, original = load_file(str(tmp_path / WEIGHTS)), load_file(str(FIXTURE / "wan" / WEIGHTS))
    assert written.keys() == original.keys() and all(torch.equal(written[k], original[k]) for k in original)
    config, wan_config = (json.loads((p / "config.json").read_text()) for p in (tmp_path, FIXTURE / "wan"))
    assert {k: v for k, v in config.items() if k != "_diffusers_version"} == \
        {k: v for k, v in wan_config.items() if k != "_diffusers_version"}
    again = load_wan(tmp_path)
    assert again.geometry == model.geometry
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("layout", ["wan", "diffusers"])
def test_sharded_round_trip(tmp_path, model, layout):
    write_wan_folder(model.state_dict(), model.geometry, tmp_path, layout=layout, max_shard_bytes=100_000,
                     dtype=torch.bfloat16)
    index = json.loads((tmp_path / f"{WEIGHTS}.index.json").read_text())
    shards = sorted(p.name for p in tmp_path.glob("diffusion_pytorch_model-*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert not (tmp_path / WEIGHTS).exists()
    again = load_wan(tmp_path, dtype=torch.float32)
    state = model.state_dict()
    assert all(torch.equal(t, state[k].bfloat16().float()) for k, t in again.state_dict().items())
    # Writing again unsharded removes the shards, so no stale index wins.
    write_wan_folder(state, model.geometry, tmp_path, layout=layout)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", WEIGHTS]


# ---------------------------------------------------------------------------- strict loading

def broken_copy(tmp_path: Path, edit) -> Path:
    folder = tmp_path / "wan"
    shutil.copytree(FIXTURE / "wan", folder)
    state = load_file(str(folder / WEIGHTS))
    edit(state)
    save_file(state, str(folder / WEIGHTS))
    return folder


@pytest.mark.parametrize("edit, words", [
    (lambda s: s.update({"blocks.1.ffn.0.weight": torch.zeros(96, 64)}), ["blocks.1.ffn.0.weight", "[96, 64]"]),
    (lambda s: s.update({"img_emb.proj.1.weight": torch.zeros(2, 2)}), ["unexpected", "img_emb.proj.1.weight"]),
    (lambda s: s.pop("head.modulation"), ["lacks", "head.modulation"]),
])
def test_bad_weights_fail_in_one_line(tmp_path, edit, words):
    with pytest.raises(UserError) as error:
        load_wan(broken_copy(tmp_path, edit))
    message = str(error.value)
    assert "\n" not in message and all(w in message for w in words)


@pytest.mark.parametrize("config_edit, words", [
    ({"model_type": "i2v"}, ["i2v", "in_channels must be 36, not 16"]),
    ({"model_type": "flf2v"}, ["'flf2v'", "t2v, i2v, ti2v"]),
    ({"ffn_dim": 256}, ["ffn_dim=256", "hold 128", "config.json"]),
    ({"_class_name": "UNet"}, ["neither"]),
    # Crafted sizes are checked against the weights' headers before anything is built.
    ({"num_layers": 10**6}, ["num_layers=1000000", "hold 2"]),
    ({"dim": "64"}, ["dim='64' is not a whole number"]),
    ({"num_heads": 0}, ["num_heads=0 is out of range"]),
    ({"num_heads": 10**9}, ["num_heads=1000000000"]),
])
def test_bad_config_fails_in_one_line(tmp_path, config_edit, words):
    folder = broken_copy(tmp_path, lambda s: None)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_edit}))
    with pytest.raises(UserError) as error:
        load_wan(folder)
    assert "\n" not in str(error.value) and all(w in str(error.value) for w in words)


def test_bad_inputs_fail_in_one_line(model, cases):
    case = cases["t2v"]
    with pytest.raises(UserError, match="text_len=512"):
        model(case["x"], case["t"], torch.zeros(1, 513, 32))
    with pytest.raises(UserError, match="not divisible"):
        model(case["x"][..., :7], case["t"], case["context"])


# ---------------------------------------------------------------------------- sizes

@pytest.mark.parametrize("dim, ffn_dim, heads, layers, count", [
    (1536, 8960, 12, 30, 1_418_996_800),      # Wan 2.1 T2V 1.3B
    (5120, 13824, 40, 40, 14_288_491_584),    # Wan 2.1 T2V 14B
])
def test_parameter_counts_match_diffusers(dim, ffn_dim, heads, layers, count):
    with torch.device("meta"):
        ours = WanDiT(WanGeometry(dim=dim, ffn_dim=ffn_dim, num_heads=heads, num_layers=layers))
        theirs = diffusers.WanTransformer3DModel(num_attention_heads=heads, attention_head_dim=dim // heads,
                                                 ffn_dim=ffn_dim, num_layers=layers, text_dim=4096, freq_dim=256,
                                                 in_channels=16, out_channels=16)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters()) == count
