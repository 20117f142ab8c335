"""Open-Sora 1.2's VAE (videodit.models.stdit.opensora_vae) against Open-Sora's own outputs.

The fixture (tests/fixtures/opensora/vae, written by scripts/make_opensora_vae_fixtures.py with
Open-Sora v1.2.0's code) is a tiny random VideoAutoencoderPipeline in the released layout,
with Open-Sora's encode (posterior means) and decode outputs for 1, 17, 20 (two clips) and
51 frames of 16x20 pixels. Offline: only the fixture files are read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tolerance import assert_close
from videodit.errors import UserError
from videodit.models.stdit.opensora_vae import SDXL_VAE_CONFIG, OpenSoraVAE
from videodit.models.stdit.temporal_vae import latent_frames
from videodit.models.vae import build_vae

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "opensora" / "vae"
FRAMES = (1, 17, 20, 51)
# fp32, relative to the expected max: ten times the worst deviation measured across CPUs (AVX-512 and
# scalar kernels), thread counts and torch releases (6.5e-6, a decode; docs/testing.md)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "cases.safetensors"))


@pytest.fixture(scope="module")
def vae() -> OpenSoraVAE:
    return build_vae("opensora-v1.2", str(FIXTURE))


def _video(cases, frames: int) -> torch.Tensor:
    return cases[f"video_{frames}"].float() / 127.5 - 1


@pytest.mark.parametrize("frames", FRAMES)
def test_encode_matches_opensora(vae, cases, frames):
    latents = vae.encode(_video(cases, frames))
    expected = cases[f"latents_{frames}"]
    assert_close(latents, expected, TOLERANCE, "latents")


@pytest.mark.parametrize("frames", FRAMES)
def test_decode_matches_opensora(vae, cases, frames):
    video = vae.decode(cases[f"latents_{frames}"], frames)
    expected = cases[f"decoded_{frames}"].clamp(-1, 1)   # the adapter clamps (>99.5% of these are inside)
    assert video.shape == expected.shape == (*cases[f"video_{frames}"].shape[:-1], 16)   # 20 px -> 2 latents
    assert_close(video, expected, TOLERANCE, "video")


def test_micro_batches_do_not_change_the_result(cases):
    """One frame per SD-VAE pass and one piece per temporal pass, against the fixture."""
    small = build_vae("opensora-v1.2", str(FIXTURE), micro_batch=1, temporal_micro_batch=1)
    assert_close(small.encode(_video(cases, 51)), cases["latents_51"], TOLERANCE, "encoded piece by piece")
    assert_close(small.decode(cases["latents_20"], 20), cases["decoded_20"].clamp(-1, 1), TOLERANCE, "decoded piece by piece")


def test_latent_frame_rule():
    # 17-frame pieces, each front-padded to a multiple of 4 and compressed 4x.
    got = {n: latent_frames(n) for n in (1, 2, 4, 5, 16, 17, 18, 20, 34, 51, 68, 102, 408)}
    assert got == {1: 1, 2: 1, 4: 1, 5: 2, 16: 4, 17: 5, 18: 6, 20: 6, 34: 10, 51: 15, 68: 20, 102: 30, 408: 120}
    assert latent_frames(20, chunk=None) == 5
    with pytest.raises(ValueError):
        latent_frames(0)


def test_latent_size_and_geometry(vae):
    assert (vae.latent_channels, vae.spatial_compression, vae.temporal_compression) == (4, 8, 4)
    assert vae.latent_size(20, 240, 426) == (6, 30, 53)   # any frame size: the SD-VAE floors it
    assert vae.latent_size(102, 360, 640) == (30, 45, 80)


def test_decode_needs_the_frame_count(vae, cases):
    latents = cases["latents_20"]
    with pytest.raises(ValueError, match="needs num_frames"):
        vae.decode(latents)
    with pytest.raises(ValueError, match="do not encode to 6 latent frames"):
        vae.decode(latents, 24)
    assert vae.decode(latents, 19).shape[2] == 19   # 17 + 2 frames also give 5 + 1 latent frames


def test_other_adapters_check_the_frame_count_they_are_given():
    identity = build_vae("identity")
    latents = torch.zeros(1, 3, 5, 4, 4)
    assert identity.decode(latents).shape[2] == identity.decode(latents, 5).shape[2] == 5
    with pytest.raises(ValueError, match="6 frames do not encode to 5 latent frames"):
        identity.decode(latents, 6)


def test_frozen(vae):
    vae.train()
    assert not vae.training and not any(p.requires_grad for p in vae.parameters())


def test_builtin_spatial_architecture_is_sdxl_vae():
    from diffusers import AutoencoderKL
    with torch.device("meta"):
        model = AutoencoderKL.from_config(dict(SDXL_VAE_CONFIG))
    assert sum(p.numel() for p in model.parameters()) == 83_653_863


# --------------------------------------------------------------------------- bad folders


def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "vae"
    shutil.copytree(FIXTURE, folder)
    (folder / "cases.safetensors").unlink()
    return folder


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def _edit_weights(folder: Path, edit) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def _broken(tmp_path: Path, problem: str) -> Path:
    folder = _copy(tmp_path)
    if problem == "missing folder":
        return tmp_path / "nope"
    if problem == "no config":
        (folder / "config.json").unlink()
    elif problem == "diffusers config":
        (folder / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    elif problem == "pickle only":
        (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    elif problem == "sdxl default":
        shutil.rmtree(folder / "spatial_vae")
    elif problem == "missing tensor":
        _edit_weights(folder, lambda t: t.pop("temporal_vae.decoder.conv_out.conv.bias"))
    elif problem == "extra tensor":
        _edit_weights(folder, lambda t: t.update(extra=torch.zeros(1)))
    elif problem == "no shift":
        _edit_weights(folder, lambda t: t.pop("shift"))
    elif problem == "wrong temporal config":
        _edit_config(folder, vae_temporal={"type": "VAE_Temporal_SD"})
    elif problem == "unknown temporal argument":
        _edit_config(folder, vae_temporal={"type": "VAE_Temporal_SD", "filters": 4})
    return folder


@pytest.mark.parametrize("problem, message", [
    ("missing folder", "is not an existing folder"),
    ("no config", "has no config.json"),
    ("diffusers config", "not 'VideoAutoencoderPipeline'"),
    ("pickle only", "pytorch_model.bin is a pickle, which videodit does not load"),
    ("sdxl default", "the SD-VAE is not SDXL's: put its diffusers config.json in"),
    ("missing tensor", "tensor temporal_vae.decoder.conv_out.conv.bias is missing (1 such tensors)"),
    ("extra tensor", "tensor extra is not part of Open-Sora 1.2's VAE (1 such tensors)"),
    ("no shift", "tensor shift is missing (1 such tensors)"),
    ("wrong temporal config", "fix vae_temporal in config.json"),
    ("unknown temporal argument", "unsupported arguments filters"),
])
def test_bad_folder_is_one_line_error(tmp_path, problem, message):
    folder = _broken(tmp_path, problem)
    with pytest.raises(UserError) as info:
        build_vae("opensora-v1.2", str(folder))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_wrong_kind_or_option_points_to_the_fix():
    with pytest.raises(UserError, match="set vae.kind=opensora-v1.2"):
        build_vae("diffusers", str(FIXTURE))
    with pytest.raises(UserError, match="vae.scaling_factor does not apply"):
        build_vae("opensora-v1.2", str(FIXTURE), scaling_factor=0.5)
    with pytest.raises(UserError, match="vae.path is required"):
        build_vae("opensora-v1.2", None)
