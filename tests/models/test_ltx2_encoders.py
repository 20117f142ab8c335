"""LTX-2's frozen encoders (videodit/models/ltx2/{text,connectors,vae}.py) against Lightricks' own
code and diffusers', on the tiny random models scripts/make_ltx2_encoder_fixtures.py wrote with
ltx-core (commit 400fd31) and diffusers 0.42: a tiny Gemma 3, the text side of an LTX-2.0 and an
LTX-2.3 release file (with a tiny VAE each under ``vae.*``) and that VAE as a diffusers folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from tolerance import assert_close  # noqa: E402
from videodit.errors import UserError  # noqa: E402
from videodit.models.ltx2.text import LTX2TextEncoder, load_ltx2_text  # noqa: E402
from videodit.models.ltx2.vae import build_ltx2_vae  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ltx2_encoders"
VERSIONS = ("ltx2.0", "ltx2.3")
WIDTHS = {"ltx2.0": (8, 8), "ltx2.3": (8, 4)}     # (video, audio) connector widths of the fixtures
# measured: 7.5e-7 / 9.3e-7 (video), 5.8e-7 / 1.3e-5 (audio: 2.3's 4-wide connector); the VAE 0.0
TEXT_BOUND, AUDIO_BOUND, VAE_BOUND = 1e-5, 2e-4, 1e-5


@pytest.fixture(scope="module")
def cases():
    return json.loads((FIXTURES / "cases.json").read_text()), load_file(FIXTURES / "cases.safetensors")


@pytest.fixture(scope="module", params=VERSIONS)
def text(request):
    version = request.param
    gemma = FIXTURES / "gemma"
    return version, LTX2TextEncoder(gemma, gemma, FIXTURES / version / "ltx-2-tiny.safetensors", audio=True)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and message
    return message


def _release_folder(tmp_path: Path, version: str, tensors: dict | None = None, metadata: dict | None = None) -> Path:
    """text.path as a user lays it out: gemma/ and the release file side by side."""
    folder = tmp_path / "ltx2"
    folder.mkdir(exist_ok=True)
    if not (folder / "gemma").exists():
        shutil.copytree(FIXTURES / "gemma", folder / "gemma")
    release = FIXTURES / version / "ltx-2-tiny.safetensors"
    if tensors is None and metadata is None:
        shutil.copy(release, folder / release.name)
    else:
        with safe_open(str(release), "pt") as f:
            meta = f.metadata()
        save_file(tensors if tensors is not None else load_file(release), str(folder / release.name),
                  metadata=metadata if metadata is not None else meta)
    return folder


# ----------------------------------------------------------------------------- text

def test_tokens_equal_ltx(text, cases):
    info, expected = cases
    _, encoder = text
    ids, mask = encoder.tokenize(info["captions"])
    assert torch.equal(ids, expected["ids"].long()) and torch.equal(mask, expected["token_mask"])
    assert mask[2].all() and not mask[0, 0] and mask[0, -1]   # truncated to 1024; left-padded


def test_embeddings_equal_ltx_and_diffusers(text, cases):
    info, expected = cases
    version, encoder = text
    video, audio, mask = encoder.encode_streams(info["captions"])
    assert (encoder.dim, encoder.audio_dim, encoder.max_length) == (*WIDTHS[version], 1024)
    assert video.shape == (3, 1024, encoder.dim) and video.dtype == torch.float32
    assert mask.all() and torch.equal(mask, expected[f"{version}/mask"])   # the registers fill every pad
    assert_close(video, expected[f"{version}/video"], TEXT_BOUND, f"{version} video embeddings vs ltx-core")
    assert_close(audio, expected[f"{version}/audio"], AUDIO_BOUND, f"{version} audio embeddings vs ltx-core")
    n = expected[f"{version}/diffusers_video"].shape[0]
    assert_close(video[:n], expected[f"{version}/diffusers_video"], TEXT_BOUND, f"{version} video vs diffusers")
    assert_close(audio[:n], expected[f"{version}/diffusers_audio"], AUDIO_BOUND, f"{version} audio vs diffusers")
    y, y_mask = encoder.encode(info["captions"][:1])
    assert_close(y, expected[f"{version}/video"][:1], TEXT_BOUND, f"{version} encode() alone")
    assert y_mask.all() and not any(p.requires_grad for p in encoder.parameters())


def test_text_path_layout_and_video_only(tmp_path, cases):
    info, expected = cases
    encoder = load_ltx2_text(str(_release_folder(tmp_path, "ltx2.3")))
    assert encoder.audio_dim is None and encoder.side.audio_embeddings_connector is None
    assert_close(encoder.encode(info["captions"][:2])[0], expected["ltx2.3/video"][:2], TEXT_BOUND, "text.path folder")
    encoder.train()
    assert not encoder.training


def test_text_refusals_are_one_line(tmp_path):
    with pytest.raises(UserError, match="text.path is required"):
        load_ltx2_text(None)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no Gemma 3 folder") as exc:
        load_ltx2_text(str(empty))
    _one_line(exc)
    folder = _release_folder(tmp_path, "ltx2.0")
    shutil.copy(FIXTURES / "ltx2.3" / "ltx-2-tiny.safetensors", folder / "second.safetensors")
    with pytest.raises(UserError, match="2 files") as exc:
        load_ltx2_text(str(folder))
    _one_line(exc)
    (folder / "second.safetensors").unlink()
    with pytest.raises(UserError, match="multiple of the connectors' 128 registers") as exc:
        load_ltx2_text(str(folder), max_length=1000)
    _one_line(exc)


def test_mismatched_or_missing_tensors_are_one_line(tmp_path):
    release = FIXTURES / "ltx2.0" / "ltx-2-tiny.safetensors"
    tensors = load_file(release)
    dropped = "video_embeddings_connector.transformer_1d_blocks.1.ff.net.2"
    missing = {k: v for k, v in tensors.items() if dropped not in k}
    with pytest.raises(UserError, match=r"transformer_1d_blocks\.1\.ff\.net\.2\.\w+ is missing") as exc:
        load_ltx2_text(str(_release_folder(tmp_path, "ltx2.0", missing)))
    _one_line(exc)
    wrong = dict(tensors)
    wrong["text_embedding_projection.aggregate_embed.weight"] = torch.zeros(8, 48)   # Gemma gives 5 x 8 = 40
    with pytest.raises(UserError, match="takes 48 features, but the Gemma in text.path gives 40") as exc:
        load_ltx2_text(str(_release_folder(tmp_path, "ltx2.0", wrong)))
    _one_line(exc)
    wrong = dict(tensors)
    wrong["model.diffusion_model.video_embeddings_connector.learnable_registers"] = torch.zeros(128, 9)
    with pytest.raises(UserError, match=r"learnable_registers has shape \(128, 9\)") as exc:
        load_ltx2_text(str(_release_folder(tmp_path, "ltx2.0", wrong)))
    _one_line(exc)
    with safe_open(str(release), "pt") as f:
        config = json.loads(f.metadata()["config"])
    config["transformer"]["caption_proj_before_connector"] = True   # 2.3's key alone: ltx-core refuses it too
    with pytest.raises(UserError, match="ltx-core builds a text side only") as exc:
        load_ltx2_text(str(_release_folder(tmp_path, "ltx2.0", tensors, {"config": json.dumps(config)})))
    _one_line(exc)
    (tmp_path / "ltx2" / "gemma" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(UserError, match="model_type='t5', not 'gemma3'") as exc:
        load_ltx2_text(str(tmp_path / "ltx2"))
    _one_line(exc)


# ----------------------------------------------------------------------------- VAE

@pytest.mark.parametrize("source", ["ltx2.0", "ltx2.3", "diffusers"])
def test_vae_equals_ltx(source, cases):
    _, expected = cases
    version = "ltx2.0" if source == "diffusers" else source
    path = FIXTURES / "vae" if source == "diffusers" else FIXTURES / version / "ltx-2-tiny.safetensors"
    vae = build_ltx2_vae(str(path))
    assert (vae.latent_channels, vae.spatial_compression, vae.temporal_compression) == (8, 32, 8)
    assert vae.latent_size(9, 64, 64) == (2, 2, 2)
    clip = expected["vae/clip"].float()
    assert_close(vae.encode(clip), expected[f"{version}/vae/latents"], VAE_BOUND, f"{source} VAE encode")
    assert_close(vae.encode(clip[:, :, :1]), expected[f"{version}/vae/first_latents"], VAE_BOUND,
                 f"{source} VAE encode, one frame")
    latents = expected[f"{version}/vae/latents" if version == "ltx2.3" else f"{version}/vae/first_latents"]
    want = expected[f"{version}/vae/decoded"]
    assert_close(vae.decode_unclamped(latents), want, VAE_BOUND, f"{source} VAE decode")
    decoded = vae.decode(latents, num_frames=want.shape[2])
    assert decoded.abs().max() <= 1 and torch.equal(decoded, vae.decode_unclamped(latents).clamp(-1, 1))
    assert not any(p.requires_grad for p in vae.parameters())


def test_vae_refusals_are_one_line(tmp_path):
    vae = build_ltx2_vae(str(FIXTURES / "ltx2.0" / "ltx-2-tiny.safetensors"))
    with pytest.raises(UserError, match=r"a clip of 10 frames does not fit LTX-2's VAE, which takes 8k \+ 1") as exc:
        vae.encode(torch.zeros(1, 3, 10, 64, 64))
    _one_line(exc)
    with pytest.raises(UserError, match="not divisible by the VAE's spatial compression 32") as exc:
        vae.encode(torch.zeros(1, 3, 9, 48, 64))
    _one_line(exc)
    release = FIXTURES / "ltx2.3" / "ltx-2-tiny.safetensors"
    tensors = load_file(release)
    with safe_open(str(release), "pt") as f:
        metadata = f.metadata()
    file = tmp_path / "missing.safetensors"
    save_file({k: v for k, v in tensors.items() if k != "vae.decoder.conv_out.conv.bias"}, str(file), metadata=metadata)
    with pytest.raises(UserError, match=r"tensor decoder\.conv_out\.conv\.bias is missing") as exc:
        build_ltx2_vae(str(file))
    _one_line(exc)
    config = json.loads(metadata["config"])
    config["vae"]["timestep_conditioning"] = True
    save_file(tensors, str(file), metadata={"config": json.dumps(config)})
    with pytest.raises(UserError, match="vae.timestep_conditioning=True is not False") as exc:
        build_ltx2_vae(str(file))
    _one_line(exc)
    config["vae"].update(timestep_conditioning=False, decoder_blocks=[["res_x", 1], ["attn", {}], ["res_x", 1]])
    save_file(tensors, str(file), metadata={"config": json.dumps(config)})
    with pytest.raises(UserError, match="vae.decoder_blocks is not a list of res_x blocks") as exc:
        build_ltx2_vae(str(file))
    _one_line(exc)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(UserError, match="has no vae config in its safetensors metadata") as exc:
        build_ltx2_vae(str(file))
    _one_line(exc)
    folder = tmp_path / "not_ltx2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan"}))
    with pytest.raises(UserError, match="not AutoencoderKLLTX2Video") as exc:
        build_ltx2_vae(str(folder))
    _one_line(exc)
    with pytest.raises(UserError, match="vae.path is required"):
        build_ltx2_vae(None)
