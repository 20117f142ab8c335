"""LTX-2 weights in and out (``models/ltx2/layouts.py``, ``release_config.py``) and the family's spec:
the release file and diffusers' folder written by the reference libraries (tests/fixtures/ltx2)
read to the same tensors, exports read back bit for bit, bad files refused in one line before
anything is built or read. (Exports loaded strictly by ltx-core and diffusers themselves are
checked when the fixtures are made: ``cases.json``'s ``export_checks``.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from videodit.config.schema import LORA_TARGETS, ModelConfig
from videodit.errors import UserError
from videodit.models.families import get_spec, released_spec, spec_of
from videodit.models.ltx2 import layouts
from videodit.models.ltx2.geometry import LTX2_0, LTX2_3, LTX2Geometry
from videodit.models.ltx2.release_config import (diffusers_config, geometry_from_diffusers, geometry_from_release,
                                                 release_config)
from videodit.models.spec import Conditions

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ltx2"
VERSIONS = ("ltx2.0", "ltx2.3")
SPEC = get_spec("ltx2")


def release(version: str) -> Path:
    return FIXTURE / version / "ltx-2-tiny.safetensors"


def diffusers_folder(version: str) -> Path:
    return FIXTURE / version / "diffusers"


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------- reading

@pytest.mark.parametrize("version", VERSIONS)
def test_both_layouts_read_to_the_same_tensors(version):
    geometry, tensors = layouts.read_ltx2(release(version))
    d_geometry, d_tensors = layouts.read_ltx2(diffusers_folder(version))   # a pipeline folder: its transformer/
    assert geometry == d_geometry
    assert set(tensors) == set(d_tensors) == set(layouts.expected_shapes(geometry))
    for name in tensors:   # copies of stored bytes: exact
        assert torch.equal(tensors[name], d_tensors[name]), name
    expected = {"ltx2.0": dict(caption_channels=24, gated_attention=False, cross_attention_adaln=False),
                "ltx2.3": dict(caption_channels=None, gated_attention=True, cross_attention_adaln=True)}[version]
    assert geometry == LTX2Geometry(num_layers=2, num_heads=2, head_dim=16, audio_head_dim=8, in_channels=8,
                                    audio_in_channels=8, **expected)


def test_release_reads_the_dit_alone_and_notes_the_rest(caplog):
    with caplog.at_level(logging.INFO, logger="videodit.models.ltx2.layouts"):
        _, tensors = layouts.read_release(release("ltx2.3"))
    assert not any("connector" in name or name.startswith(("vae.", "text_embedding")) for name in tensors)
    assert "text_embedding_projection.*" in caplog.text and "vae.*" in caplog.text and "vocoder.*" in caplog.text
    text = layouts.read_text_side(release("ltx2.3"))   # the text encoder's, kept out of the DiT
    assert any(name.startswith("video_embeddings_connector.") for name in text)
    assert "text_embedding_projection.video_aggregate_embed.weight" in text


def test_spec_recognises_both_layouts_and_loads_lazily():
    for path in (release("ltx2.0"), diffusers_folder("ltx2.3"), diffusers_folder("ltx2.3") / "transformer"):
        assert released_spec(path) is SPEC
    model = SPEC.load_released(release("ltx2.0"))
    assert spec_of(model) is SPEC and model.patchify_proj.weight.dtype == torch.float32
    with pytest.raises(UserError, match="no EMA"):
        SPEC.read_released(release("ltx2.0"), ema=True)


# ----------------------------------------------------------------------------- writing

@pytest.mark.parametrize("version", VERSIONS)
def test_exports_round_trip_bit_for_bit(tmp_path, version):
    geometry, tensors = layouts.read_ltx2(release(version))
    state = {name: tensors[name] for name in tensors}
    file = layouts.write_release(tmp_path / "dit.safetensors", geometry, state)
    folder = layouts.write_diffusers(tmp_path / "diffusers", geometry, state)
    for path in (file, folder):
        again_geometry, again = layouts.read_ltx2(path)
        assert again_geometry == geometry
        assert all(torch.equal(again[name], state[name]) for name in state)
    with safe_open(str(file), framework="pt") as handle:   # the config travels in the metadata
        assert geometry_from_release(json.loads(handle.metadata()["config"]), "x") == geometry
    assert json.loads((folder / "config.json").read_text()) == diffusers_config(geometry)
    # the reference's own diffusers config says the same model
    reference = json.loads((diffusers_folder(version) / "transformer" / "config.json").read_text())
    assert geometry_from_diffusers(reference, "x") == geometry


def test_spec_exports_name_the_files():
    geometry, tensors = layouts.read_ltx2(release("ltx2.3"))
    state = {name: tensors[name] for name in tensors}
    released, files, name = SPEC.export_released("ltx2", geometry, state)
    assert name == "{folder}.safetensors" and set(released) == {layouts.PREFIX + k for k in state}
    assert SPEC.export_metadata("ltx2", geometry)["config"] == json.dumps(release_config(geometry))
    renamed, files, name = SPEC.export_released("diffusers", geometry, state)
    assert name == layouts.WEIGHTS_NAME and "config.json" in files
    assert "transformer_blocks.0.attn1.norm_q.weight" in renamed and "time_embed.linear.weight" in renamed
    with pytest.raises(UserError, match="--format"):
        SPEC.export_released("opensora-v2", geometry, state)


@pytest.mark.parametrize("geometry", [LTX2_0, LTX2_3])
def test_configs_round_trip(geometry):
    assert geometry_from_release(release_config(geometry), "x") == geometry
    assert geometry_from_diffusers(diffusers_config(geometry), "x") == geometry
    assert SPEC.geometry_from_config(json.loads(json.dumps(SPEC.geometry_config(geometry)))) == geometry


# ----------------------------------------------------------------------------- bad files

def _rewrite(tmp_path: Path, drop=(), add=None, config=None, rename=None) -> Path:
    """A copy of the 2.3 release file with tensors dropped/added/renamed or another metadata config."""
    source = release("ltx2.3")
    tensors = load_file(str(source))
    with safe_open(str(source), framework="pt") as handle:
        metadata = dict(handle.metadata())
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    for old, new in (rename or {}).items():
        tensors[new] = tensors.pop(old)
    if config is not None:
        metadata["config"] = config if isinstance(config, str) else json.dumps(config)
    out = tmp_path / "bad.safetensors"
    save_file(tensors, str(out), metadata=metadata)
    return out


def _config(**changes) -> dict:
    with safe_open(str(release("ltx2.3")), framework="pt") as handle:
        config = json.loads(handle.metadata()["config"])
    config["transformer"].update(changes)
    return config


BAD_FILES = {
    "missing tensor": (dict(drop=["model.diffusion_model.transformer_blocks.1.attn2.to_v.bias"]),
                       "lacks the tensor model.diffusion_model.transformer_blocks.1.attn2.to_v.bias"),
    "wrong shape": (dict(drop=["model.diffusion_model.proj_out.weight"],
                         add={"model.diffusion_model.proj_out.weight": torch.zeros(9, 32)}),
                    "tensor model.diffusion_model.proj_out.weight has shape [9, 32]"),
    "huge block index": (dict(add={"model.diffusion_model.transformer_blocks.1000000000000.attn1.to_q.weight":
                                   torch.zeros(1)}),
                         "unexpected tensor model.diffusion_model.transformer_blocks.1000000000000"),
    "huge layer count": (dict(config=_config(num_layers=10 ** 12)), "num_layers=1000000000000 is not an integer"),
    "nan epsilon": (dict(config=_config(norm_eps=float("nan"))), "norm_eps=nan is not a finite positive number"),
    "string width": (dict(config=_config(attention_head_dim="16")), "attention_head_dim='16' is not an integer"),
    "bool as int": (dict(config=_config(num_layers=True)), "num_layers=True is not an integer"),
    "interleaved rope": (dict(config=_config(rope_type="interleaved")), "interleaved RoPE"),
    "ltx 2.5 ffn": (dict(config=_config(ff_bias=False)), "without biases"),
    "unequal heads": (dict(config=_config(audio_num_attention_heads=4)), "audio_num_attention_heads=4"),
    "no config": (dict(config="{\"vae\": {}}"), "no transformer section"),
    "bad json": (dict(config="{not json"), "not valid JSON"),
    "ltx-core check": (dict(config=_config(qk_norm="layer_norm")), "qk_norm='layer_norm' is not 'rms_norm'"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_release_files_are_one_line(tmp_path, case):
    changes, message = BAD_FILES[case]
    path = _rewrite(tmp_path, **changes)
    with pytest.raises(UserError) as exc:
        layouts.read_ltx2(path)
    assert message in one_line(exc), str(exc.value)


def test_bad_diffusers_folder_is_one_line(tmp_path):
    folder = tmp_path / "transformer"
    folder.mkdir()
    source = diffusers_folder("ltx2.0") / "transformer"
    config = json.loads((source / "config.json").read_text())
    tensors = load_file(str(source / layouts.WEIGHTS_NAME))
    save_file(tensors, str(folder / layouts.WEIGHTS_NAME))
    for key, value, message in (("num_layers", 3, "lacks the tensor transformer_blocks.2."),
                                ("num_layers", 10 ** 12, "num_layers=1000000000000"),
                                ("vae_scale_factors", [4, 16, 16], "vae_scale_factors"),
                                ("rope_type", "interleaved", "rope_type='interleaved'")):
        (folder / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(UserError) as exc:
            layouts.read_ltx2(tmp_path)
        assert message in one_line(exc), str(exc.value)


def test_not_an_ltx2_path_is_one_line(tmp_path):
    with pytest.raises(UserError) as exc:
        layouts.read_ltx2(tmp_path)
    assert "neither an LTX-2 release file" in one_line(exc)


# ----------------------------------------------------------------------------- the spec

def test_presets_and_config():
    m = ModelConfig(preset="ltx2-tiny").resolved()
    assert m.family == "ltx2" and LORA_TARGETS["ltx2"][:2] == ["attn1.to_q", "attn1.to_k"]
    geometry = SPEC.geometry(m, 8, 32, 1024)
    assert geometry.version == "2.3" and geometry.dim == 32 and geometry.in_channels == 8
    with pytest.raises(UserError, match="as wide as the video stream"):
        SPEC.geometry(m, 8, 48, 1024)
    m19 = ModelConfig(preset="ltx2-19b").resolved()
    assert SPEC.geometry(m19, 128, 3840, 1024) == LTX2_0
    assert SPEC.released_encoders_of(m19) == (128, 3840, 1024)
    assert SPEC.released_encoders_of(ModelConfig(preset="ltx2.3-22b").resolved()) == (128, 4096, 1024)
    assert SPEC.tokens(geometry, 7, 17, 30) == 7 * 17 * 30   # patch 1: a token per latent voxel
    SPEC.check_sequence_parallel(2, tp=1, sp=2, ring=1)   # Ulysses over the video tokens (parallel_plan.py)
    with pytest.raises(UserError, match="^LTX-2 shards its video tokens over parallel.sp"):
        SPEC.check_sequence_parallel(2, tp=1, sp=4, ring=1)
    # The audio stream's text is as wide as the stream on LTX-2.3 (heads x the release's audio head), any on 2.0
    assert SPEC.audio_text_width(m) == geometry.audio_dim and SPEC.audio_text_width(m19) is None


def test_default_lora_targets_take_the_audio_attentions_when_the_audio_stream_trains():
    from videodit.config import load_config

    video = load_config("ltx2.3-22b-lora").lora.targets
    both = load_config("ltx2.3-22b-lora", ["model.train_audio=true"]).lora.targets
    assert video == LORA_TARGETS["ltx2"] and both[:len(video)] == video
    assert {target.split(".")[0] for target in both[len(video):]} == {
        "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn"} and len(both) == 2 * 4 + 4 * 4


def test_model_inputs_drop_captions_and_mark_given_frames():
    model = layouts.load_ltx2(release("ltx2.3")).eval()
    x, t, y = torch.randn(2, 8, 3, 2, 2), torch.tensor([0.5, 0.5]), torch.randn(2, 4, 32)
    drop = torch.tensor([False, True])
    inputs = SPEC.model_inputs(x, t, Conditions(y=y, y_mask=None, drop=drop))
    assert len(inputs) == 5 and inputs[4].all() and torch.equal(inputs[3], torch.full((2,), 24.0))
    assert torch.equal(inputs[2][1], torch.zeros_like(y[1])) and torch.equal(inputs[2][0], y[0])
    with torch.no_grad():
        out = model(*inputs)
        given = torch.ones(2, 3, dtype=torch.bool)
        given[:, 0] = False
        first_given = model(*SPEC.model_inputs(x, t, Conditions(y=y, y_mask=None, x_mask=given)))
    assert out.shape == x.shape
    assert SPEC.frame_mask_index() == 4 and not torch.allclose(out, first_given)
    blocks = model.blocks
    assert len(blocks) == 2 and SPEC.dynamic_dims((torch.zeros(1, 3, 4), None, None, None))[0][1] == [0, 1]
