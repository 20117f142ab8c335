"""videodit against Open-Sora 1.2's own STDiT3, through the golden fixtures of
tests/fixtures/opensora/stdit3 (written by scripts/make_opensora_fixtures.py with Open-Sora's code;
these tests never need Open-Sora): forward parity, the CFG sampling loop, weight import/export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tolerance import assert_close
from videodit.config import DiffusionConfig
from videodit.diffusion.rectified_flow import RectifiedFlow
from videodit.errors import UserError
from videodit.models import load_pretrained
from videodit.models.stdit.opensora_stdit import geometry_from_opensora
from videodit.sample import denoise

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "opensora" / "stdit3"
FORWARD_CASES = ["square", "nonsquare", "padded", "240p", "image", "x_mask", "null_caption"]


@pytest.fixture(scope="module")
def cases() -> dict[str, dict[str, torch.Tensor]]:
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(FIXTURE / "cases.safetensors")).items():
        case, name = key.split(".", 1)
        grouped.setdefault(case, {})[name] = tensor
    return grouped


@pytest.fixture(scope="module")
def model():
    return load_pretrained(FIXTURE).eval()


def run(model, case: dict[str, torch.Tensor], null_caption: bool = False) -> torch.Tensor:
    """videodit's prediction for Open-Sora's inputs, in Open-Sora's convention (x0 - noise)."""
    y = case["y"][:, 0]   # Open-Sora's captions are [B, 1, L, C]
    drop = torch.ones(y.shape[0], dtype=torch.bool) if null_caption else None
    with torch.no_grad():
        out = model(case["x"], case["timestep"] / 1000, y, case["mask"].bool(), case["fps"], drop,
                    height=case["height"], width=case["width"], x_mask=case.get("x_mask"))
    return -out


@pytest.mark.parametrize("name", FORWARD_CASES)
def test_forward_matches_opensora(model, cases, name):
    case = cases[name]
    expected = case["out"][:, : case["x"].shape[1]]   # pred_sigma: the first C channels are the prediction
    assert_close(run(model, case, null_caption=name == "null_caption"), expected, 1e-5, name)


def test_null_caption_attends_under_the_prompt_mask(model, cases):
    # videodit's own semantics (all null-caption tokens) differ: the option is what matches Open-Sora.
    full = load_pretrained(FIXTURE).eval()
    full.caption_embedder.null_mask = "full"
    case = cases["null_caption"]
    assert (run(full, case, null_caption=True) - run(model, case, null_caption=True)).abs().max() > 1e-2


def test_temporal_rope_needs_the_pair_permutation(cases):
    # Open-Sora rotates interleaved pairs, videodit half-split ones: undo the converter's permutation of
    # the temporal q/k rows and the outputs move far off.
    from videodit.models.stdit.opensora_stdit import rope_half_split

    unpermuted = load_pretrained(FIXTURE).eval()
    head_dim = unpermuted.geometry.hidden_size // unpermuted.geometry.num_heads
    with torch.no_grad():
        for block in unpermuted.temporal_blocks:
            for layer in (block.attn.q, block.attn.k, block.attn.q_norm, block.attn.k_norm):
                for p in layer.parameters():
                    p.copy_(rope_half_split(p, head_dim, inverse=True))
    case = cases["square"]
    assert (run(unpermuted, case) - case["out"][:, :4]).abs().max() > 1e-2


def test_cfg_sampling_loop_matches_rflow_sample(model, cases):
    case = cases["sample"]
    flow = RectifiedFlow(DiffusionConfig())   # Open-Sora's timestep transform: 512x512 pixels, 1 latent frame
    # RFLOW counts latent frames as num_frames // 17 * 5; the fixture's latents have exactly that many.
    assert int(case["num_frames"][0]) // 17 * 5 == case["z"].shape[2]
    ratio = flow.shift_ratio(float(case["height"][0]), float(case["width"][0]), case["z"].shape[2])
    with torch.no_grad():
        out = denoise(model, flow, case["z"], case["y"][:, 0], case["mask"].bool(), steps=int(case["steps"]),
                      guidance=float(case["guidance"]), ratio=ratio, fps=case["fps"], height=case["height"],
                      width=case["width"])
    assert_close(out, case["out"], 1e-3, "sampled")


def test_import_export_round_trip(tmp_path):
    from videodit.checkpoint import export_released, import_released

    imported = import_released(FIXTURE, tmp_path / "imported", "name: imported\n")
    ours = load_pretrained(imported).state_dict()
    direct = load_pretrained(FIXTURE).state_dict()
    assert ours.keys() == direct.keys() and all(torch.equal(ours[k], direct[k]) for k in ours)
    assert json.loads((imported / "export.json").read_text())["format"] == "opensora-stdit3"

    exported = export_released(imported, tmp_path / "exported", "opensora")
    original, again = load_file(str(FIXTURE / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    assert again.keys() == original.keys()
    for name, tensor in original.items():
        if name.startswith("final_layer.linear."):   # per patch position: C predicted channels, C sigma ones
            theirs, mine = tensor.view(4, 8, -1), again[name].view(4, 8, -1)
            assert torch.equal(mine[:, :4], theirs[:, :4]) and not mine[:, 4:].any()
        else:
            assert torch.equal(again[name], tensor), name
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "STDiT3" and config["pred_sigma"] is True
    assert geometry_from_opensora(config) == geometry_from_opensora(json.loads((FIXTURE / "config.json").read_text()))
    reimported = load_pretrained(exported).state_dict()
    assert all(torch.equal(reimported[k], ours[k]) for k in ours)


def test_training_checkpoint_layout(tmp_path):
    # Open-Sora's save(): epochN-global_stepM/ with model/ (ColossalAI's sharded state dict) and ema.pt.
    state = load_file(str(FIXTURE / "model.safetensors"))
    ckpt = tmp_path / "epoch0-global_step10"
    (ckpt / "model").mkdir(parents=True)
    names = sorted(state)
    shards = {"pytorch_model-00001.bin": names[:40], "pytorch_model-00002.bin": names[40:]}
    for shard, keys in shards.items():
        torch.save({k: state[k].to(torch.bfloat16) for k in keys}, ckpt / "model" / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (ckpt / "model" / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    torch.save({k: v if k == "rope.freqs" else 2 * v for k, v in state.items()}, ckpt / "ema.pt")
    (ckpt / "running_states.json").write_text("{}")

    direct = load_pretrained(FIXTURE)
    from_model = load_pretrained(ckpt)   # the geometry is read off the weights
    assert from_model.geometry == direct.geometry
    assert all(torch.equal(v, direct.state_dict()[k].to(torch.bfloat16).float())
               for k, v in from_model.state_dict().items())
    ema = load_pretrained(ckpt, ema=True).state_dict()
    assert torch.equal(ema["patch_embed.weight"], 2 * direct.state_dict()["patch_embed.weight"])
    assert torch.equal(load_pretrained(ckpt / "ema.pt").state_dict()["patch_embed.weight"], ema["patch_embed.weight"])


def _copy_fixture(tmp_path: Path) -> Path:
    folder = tmp_path / "stdit3"
    shutil.copytree(FIXTURE, folder)
    return folder


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("change, message", [
    (dict(caption_channels=8), "config.json gives caption_channels=8 but the weights hold 16"),
    (dict(depth=3), "config.json gives depth=3 but the weights hold 2"),
    (dict(depth=1), "config.json gives depth=1 but the weights hold 2"),
    # Checked against the weights before anything is built: no hang, no traceback.
    (dict(depth=10**6), "config.json gives depth=1000000 but the weights hold 2"),
    (dict(hidden_size="32"), "config.json gives hidden_size='32' but the weights hold 32"),
    (dict(mlp_ratio=float("nan")), "config.json gives mlp_ratio=nan"),
    (dict(model_type="SomethingElse", architectures=["SomethingElse"]), "'SomethingElse' model"),
])
def test_mismatched_config_is_one_line_naming_the_size(tmp_path, change, message):
    folder = _copy_fixture(tmp_path)
    _edit_config(folder, **change)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_pretrained(folder)
    assert "\n" not in str(err.value)


def test_missing_tensor_and_unknown_layouts(tmp_path):
    folder = _copy_fixture(tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    del state["temporal_blocks.1.attn.qkv.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(UserError, match="no tensor temporal_blocks.1.attn.qkv.weight"):
        load_pretrained(folder)
    state = load_file(str(FIXTURE / "model.safetensors"))
    save_file({**state, "rope.freqs": state["rope.freqs"] * 2}, str(folder / "model.safetensors"))
    with pytest.raises(UserError, match="rope.freqs differ"):
        load_pretrained(folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="is not a model folder"):
        load_pretrained(tmp_path / "empty")
    torch.save({"weights": [1, 2]}, tmp_path / "odd.pt")
    with pytest.raises(UserError, match="not a state dict of tensors"):
        load_pretrained(tmp_path / "odd.pt")


def test_loading_never_unpickles_objects(tmp_path):
    torch.save({"x_embedder.proj.weight": torch.zeros(1), "hook": Path("/")}, tmp_path / "ema.pt")
    with pytest.raises(UserError, match="refuses to unpickle"):
        load_pretrained(tmp_path / "ema.pt")


def test_export_refuses_a_model_opensora_cannot_compute(tmp_path):
    from videodit.checkpoint import export_released
    from videodit.models.stdit.model import DiTGeometry, STDiT

    geometry = DiTGeometry(in_channels=4, caption_channels=16, caption_length=12, depth=1, hidden_size=32,
                           num_heads=2)   # videodit's own positions and null caption
    STDiT(geometry).save_pretrained(tmp_path / "native")
    with pytest.raises(UserError, match="position_embedding=videodit null_caption_mask=full"):
        export_released(tmp_path / "native", tmp_path / "out", "opensora")
    assert not (tmp_path / "out").exists()


def test_cli_import_and_export(tmp_path, capsys):
    from videodit.cli import main

    assert main(["ckpt", "import", str(FIXTURE), str(tmp_path / "imported")]) == 0
    assert main(["ckpt", "export", str(tmp_path / "imported"), str(tmp_path / "os"), "--format", "opensora"]) == 0
    assert "STDiT3.from_pretrained" in capsys.readouterr().out
    assert main(["ckpt", "import", str(tmp_path / "imported"), str(tmp_path / "again")]) == 2
    assert "holds no released weights videodit reads (Open-Sora STDiT3" in capsys.readouterr().err


def test_init_from_takes_opensora_weights(tmp_path):
    from videodit.models.stdit.model import STDiT
    from videodit.train.state import init_weights_from

    model = STDiT(load_pretrained(FIXTURE).geometry)
    assert init_weights_from(model, str(FIXTURE)).startswith("Open-Sora weights")
    expected = load_pretrained(FIXTURE).state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


def test_opensora_preset_and_freeze_options():
    from types import SimpleNamespace

    from videodit.components import build_model
    from videodit.config import load_config

    small = ["model.depth=1", "model.hidden_size=32", "model.num_heads=2", "model.temporal_pos_embed=false",
             "model.pooled_caption=false"]
    cfg = load_config("tiny", ["model.preset=opensora-v1.2", *small])
    model = build_model(cfg, SimpleNamespace(latent_channels=4), SimpleNamespace(dim=16))
    g = model.geometry
    assert (g.position_embedding, g.null_caption_mask, g.bf16_timesteps) == ("opensora", "prompt", True)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"caption_embedder.null_caption"}   # a fixed buffer in Open-Sora

    cfg = load_config("tiny", [*small, "model.freeze_caption_embedder=true"])
    model = build_model(cfg, SimpleNamespace(latent_channels=4), SimpleNamespace(dim=16))
    assert model.geometry.position_embedding == "videodit"   # videodit's defaults stay
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == \
        {n for n, _ in model.caption_embedder.named_parameters(prefix="caption_embedder")}


def test_imported_weights_sample_with_the_recorded_encoders(tmp_path):
    """The Open-Sora path end to end: imported STDiT3, the Open-Sora 1.2 VAE (tiny fixture),
    Open-Sora's prompt style, a 5-frame clip from the command line."""
    from videodit.cli import main
    from videodit.data.video import read_video

    vae = FIXTURE.parent / "vae"
    assert main(["ckpt", "import", str(FIXTURE), str(tmp_path / "m"), "--config", "tiny", "vae.kind=opensora-v1.2",
                 f"vae.path={vae}", "text.dim=16", "text.max_length=12", "data.height=32", "data.width=32",
                 "data.num_frames=5", "sample.prompt_style=opensora"]) == 0
    assert main(["sample", "--ckpt", str(tmp_path / "m"), "--prompt", "a red circle", "--steps", "2", "--cfg", "7",
                 "--out", str(tmp_path / "clip.mp4")]) == 0
    frames, _ = read_video(tmp_path / "clip.mp4")
    assert frames.shape == (5, 32, 32, 3)
