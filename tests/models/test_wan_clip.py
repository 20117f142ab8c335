"""Wan 2.1 I2V's CLIP image encoder against Wan's own ``CLIPModel.visual``, through the golden fixtures
of tests/fixtures/wan_clip (scripts/make_wan_clip_fixtures.py): the same tiny ViT from Wan's .pth
and from diffusers' image_encoder/ folder; files that must be refused in one line, crafted pickles
never run."""

from __future__ import annotations

import functools
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tolerance import assert_close, relative
from videodit.errors import UserError
from videodit.models.wan.clip import WAN_CLIP_FILE, WanImageEncoder, load_wan_image_encoder

pytest.importorskip("transformers")
pytestmark = [pytest.mark.filterwarnings("ignore:Detected pickle protocol"), pytest.mark.usefixtures("no_network")]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "wan_clip"
META = json.loads((FIXTURE / "cases.json").read_text())
HEADS = META["num_heads"]   # a tiny width has no known head count: Wan's .pth needs it given
# Relative to the expected features' max: ten times the worst deviation measured across CPUs, thread
# counts and torch releases (1.0e-6; docs/testing.md).
FEATURES = 2e-5
LAYOUTS = {   # what a user may point to -> num_heads to pass
    "wan_pth": (FIXTURE / "wan" / WAN_CLIP_FILE, HEADS),
    "wan_folder": (FIXTURE / "wan", HEADS),
    "diffusers_pipeline": (FIXTURE / "diffusers", None),
    "diffusers_image_encoder": (FIXTURE / "diffusers" / "image_encoder", None),
}


class Evil:
    """Unpickling it creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@functools.lru_cache(maxsize=None)
def encoder(layout: str, dtype: torch.dtype = torch.float32) -> WanImageEncoder:
    path, heads = LAYOUTS[layout]
    return load_wan_image_encoder(path, dtype=dtype, num_heads=heads)


@functools.lru_cache(maxsize=None)
def case(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = load_file(str(FIXTURE / "cases.safetensors"))
    return tensors[f"{name}.pixels"].float() / 127.5 - 1, tensors[f"{name}.features"]


@pytest.mark.parametrize("name", sorted(META["cases"]))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_features_match_wan_from_either_layout(layout, name):
    frames, expected = case(name)
    features = encoder(layout).encode(frames)
    assert features.dtype == torch.float32 and features.shape == expected.shape
    assert_close(features, expected, FEATURES, name)


@pytest.mark.parametrize("layout", ["wan_pth", "diffusers_image_encoder"])
def test_sizes_frozen_and_cut_before_the_last_block(layout):
    model = encoder(layout)
    tiny = META["tiny"]
    assert (model.image_size, model.num_tokens, model.dim) == (tiny["image_size"], META["num_tokens"],
                                                               tiny["vision_dim"])
    # Wan's features are the second-to-last block's output: the last block is never loaded.
    assert model.vision.config.num_hidden_layers == tiny["vision_layers"] - 1
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.train().training and not model.vision.training
    with pytest.raises(ValueError, match=r"expected frames \[B,3,H,W\]"):
        model.encode(torch.zeros(1, 4, 8, 8))


def test_half_precision_weights_give_fp32_features():
    frames, expected = case("upsample")
    model = encoder("diffusers_image_encoder", torch.bfloat16)
    assert model.dtype == torch.bfloat16
    features = model.encode(frames)
    assert features.dtype == torch.float32 and relative(features, expected) < 5e-2


# ---------------------------------------------------------------------------- refused files


@pytest.mark.parametrize("form, message", [
    ("torch_save", r"holds objects other than tensors \(io\.open\), which videodit refuses to unpickle"),
    ("legacy_pickle", r"holds objects other than tensors \(io\.open\), which videodit refuses to unpickle"),
    ("pickle_protocol_4", r"cannot be read as weights"),   # refused at its first opcode torch does not allow
])
def test_a_crafted_pth_is_refused_without_running_it(tmp_path, form, message):
    marker = tmp_path / "pwned"
    file = tmp_path / WAN_CLIP_FILE
    if form == "torch_save":
        torch.save({"visual.patch_embedding.weight": Evil(marker)}, file)
    else:
        file.write_bytes(pickle.dumps(Evil(marker), protocol=2 if form == "legacy_pickle" else 4))
    with pytest.raises(UserError, match=message) as caught:
        load_wan_image_encoder(tmp_path)
    assert str(file) in str(caught.value) and "\n" not in str(caught.value)
    assert not marker.exists()
    # The control: unpickled for real, it does run.
    torch.load(file, weights_only=False) if form == "torch_save" else pickle.loads(file.read_bytes())
    assert marker.exists()


def _pth(state) -> callable:
    def make(tmp: Path) -> Path:
        torch.save(state(), tmp / WAN_CLIP_FILE)
        return tmp / WAN_CLIP_FILE
    return make


def _fixture_pth_without(name: str) -> callable:
    def state() -> dict:
        tensors = torch.load(FIXTURE / "wan" / WAN_CLIP_FILE, weights_only=True)
        del tensors[name]
        return tensors
    return _pth(state)


def _image_encoder(weights: str | None, drop: str | None = None, model_type: str = "clip_vision_model") -> callable:
    def make(tmp: Path) -> Path:
        folder = tmp / "pipeline" / "image_encoder"
        folder.mkdir(parents=True)
        config = json.loads((FIXTURE / "diffusers" / "image_encoder" / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
        tensors = load_file(str(FIXTURE / "diffusers" / "image_encoder" / "model.safetensors"))
        if weights == "bin":
            torch.save(tensors, folder / "pytorch_model.bin")
        elif weights == "safetensors":
            save_file({k: v for k, v in tensors.items() if k != drop}, str(folder / "model.safetensors"))
        return tmp / "pipeline"
    return make


def _file(name: str, data: bytes) -> callable:
    def make(tmp: Path) -> Path:
        (tmp / name).write_bytes(data)
        return tmp / name
    return make


REFUSED = {
    "missing_folder": (lambda tmp: tmp / "nowhere", r"is neither a file nor an existing folder"),
    "empty_folder": (lambda tmp: tmp, r"has neither image_encoder/config.json, config.json nor models_clip_"),
    "only_a_bin": (_image_encoder("bin"), r"has pytorch_model.bin but no model.safetensors; videodit reads only "
                                          r"safetensors"),
    "no_weights": (_image_encoder(None), r"no model.safetensors"),
    "not_clip_vision": (_image_encoder("safetensors", model_type="clip"), r"model_type='clip', not "
                                                                          r"'clip_vision_model'"),
    "tensor_missing_from_safetensors": (
        _image_encoder("safetensors", drop="vision_model.encoder.layers.0.mlp.fc1.bias"),
        r"tensor vision_model.encoder.layers.0.mlp.fc1.bias is missing"),
    "pth_without_visual": (_pth(lambda: {"textual.head.0.weight": torch.zeros(2, 2), "log_scale": torch.zeros(())}),
                           r"has no visual.\* tensors"),
    "pth_not_a_mapping": (_pth(lambda: [torch.zeros(2)]), r"is not a plain state dict of tensors"),
    "pth_with_a_number": (_pth(lambda: {"visual.pos_embedding": 3}), r"is not a plain state dict of tensors"),
    "pth_tensor_missing": (_fixture_pth_without("visual.pre_norm.bias"), r"tensor visual.pre_norm.bias is missing"),
    "pth_block_tensor_missing": (_fixture_pth_without("visual.transformer.1.attn.to_qkv.bias"),
                                 r"tensor visual.transformer.1.attn.to_qkv.bias is missing"),
    "pth_without_pos_embedding": (_fixture_pth_without("visual.pos_embedding"),
                                  r"tensor visual.pos_embedding is missing"),
    "pth_garbage": (_file(WAN_CLIP_FILE, b"not a checkpoint at all"), r"cannot be read as weights"),
    "wrong_suffix": (_file("clip.txt", b"{}"), r"is a .txt file, not Wan's models_clip_"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_bad_paths_and_files_are_one_line_user_errors(tmp_path, name):
    make, message = REFUSED[name]
    path = make(tmp_path)
    with pytest.raises(UserError, match=message) as caught:
        load_wan_image_encoder(path, num_heads=HEADS if "pth" in name else None)
    assert "\n" not in str(caught.value)


def test_a_width_without_a_known_head_count_asks_for_num_heads(tmp_path):
    with pytest.raises(UserError, match=r"a CLIP ViT 32 wide has no known head count .*; pass num_heads"):
        load_wan_image_encoder(FIXTURE / "wan")


def test_wan_release_folder_reads_the_pth_beside_the_dit_config(tmp_path):
    """Wan's Wan2.1-I2V-14B-480P folder also holds the DiT's config.json: the .pth is what counts."""
    folder = tmp_path / "Wan2.1-I2V-14B-480P"
    shutil.copytree(FIXTURE / "wan", folder)
    (folder / "config.json").write_text(json.dumps({"_class_name": "WanModel", "model_type": "i2v"}))
    frames, expected = case("upsample")
    assert_close(load_wan_image_encoder(folder, num_heads=HEADS).encode(frames), expected, FEATURES, "release folder")


def test_a_copied_pipeline_folder_loads_without_the_fixture_paths(tmp_path):
    """Only what the folder holds matters (and nothing is fetched): a copy elsewhere loads the same."""
    shutil.copytree(FIXTURE / "diffusers", tmp_path / "Wan2.1-I2V-14B-480P-Diffusers")
    frames, expected = case("downsample")
    model = load_wan_image_encoder(tmp_path / "Wan2.1-I2V-14B-480P-Diffusers")
    assert_close(model.encode(frames), expected, FEATURES, "features")
