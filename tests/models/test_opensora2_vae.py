"""Open-Sora 2.0's autoencoders (``vae.kind=hunyuan``, ``vae.kind=opensora-dc-ae``) against
Open-Sora's own code, through the fixtures of scripts/make_opensora2_vae_fixtures.py: tiny
random-weight networks, Open-Sora's encodes (mode and a seeded posterior sample) and decodes,
untiled and with its spatial/temporal tiling. The networks' weights are not stored: they are
redrawn from the seed in the io files' metadata and written to a temporary folder."""

from __future__ import annotations

import atexit
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tolerance import assert_close
from videodit.errors import UserError
from videodit.models.mmdit.dc_ae import DCAE, DCAEConfig, config_from_tensors
from videodit.models.mmdit.dc_ae_vae import OpenSoraDCAE
from videodit.models.mmdit.hunyuan_vae import HunyuanVAE, hunyuan_config_from_tensors
from videodit.models.mmdit.vae import build_opensora2_vae
from videodit.models.vae import build_vae, vae_kinds

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "opensora2"
# fp32, relative to the output's largest value: ten times the worst deviation measured across CPUs,
# thread counts and torch releases (docs/testing.md): at most 6.2e-6 with AVX-512 or AVX2 kernels, 5.6e-4
# (the DC-AE's one-frame tail tile) with scalar kernels and oneDNN/MKL held to SSE4.
TOLERANCE = 1e-2


def _metadata(file: Path) -> dict:
    with safe_open(str(file), "pt") as f:
        return f.metadata()


HUNYUAN_META = _metadata(FIXTURES / "vae_hunyuan_io.safetensors")
DC_AE_META = _metadata(FIXTURES / "dc_ae_io.safetensors")
DC_AE_CASES = json.loads(DC_AE_META["cases"])
HUNYUAN_CLIPS = json.loads(HUNYUAN_META["clips"])


def random_weights(recipe: dict) -> dict[str, torch.Tensor]:
    """The fixture script's weights (its random_weights and shrink_output), redrawn bit for bit:
    bf16-representable draws in name order from one seed, the output conv scaled."""
    gen = torch.Generator().manual_seed(recipe["seed"])
    out = {}
    for name in sorted(recipe["shapes"]):
        shape = tuple(recipe["shapes"][name])
        noise = torch.randn(shape, generator=gen)
        if len(shape) == 1 and name.endswith(("weight", "gamma", "scale")):
            value = 1.0 + 0.1 * noise
        elif len(shape) == 1:
            value = 0.1 * noise
        else:
            value = noise / math.prod(shape[1:]) ** 0.5
        value = value.to(torch.bfloat16).float()
        if name.startswith(recipe["out_conv"] + "."):
            value = (value * recipe["out_scale"]).to(torch.bfloat16).float()
        out[name] = value.to(torch.bfloat16)   # stored bf16, as the release files are read
    return out


# The weight files, written once per session: the Hunyuan VAE as a diffusers folder (the
# fixture's config.json), whose weights file is also Open-Sora's single-file layout.
WEIGHTS = Path(tempfile.mkdtemp(prefix="videodit-opensora2-vae-"))
atexit.register(shutil.rmtree, WEIGHTS, ignore_errors=True)
HUNYUAN_FOLDER = WEIGHTS / "vae_hunyuan"
HUNYUAN_FILE = HUNYUAN_FOLDER / "diffusion_pytorch_model.safetensors"
DC_AE_FILE = WEIGHTS / "dc_ae.safetensors"
HUNYUAN_FOLDER.mkdir()
shutil.copy(FIXTURES / "vae_hunyuan" / "config.json", HUNYUAN_FOLDER / "config.json")
save_file(random_weights(json.loads(HUNYUAN_META["weights"])), str(HUNYUAN_FILE))
save_file(random_weights(json.loads(DC_AE_META["weights"])), str(DC_AE_FILE))


def clip(seed: int, shape) -> torch.Tensor:
    """The fixture script's seeded clip in [-1, 1]."""
    return torch.rand(tuple(shape), generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.fixture(scope="module")
def hunyuan_io():
    io = load_file(str(FIXTURES / "vae_hunyuan_io.safetensors"))
    return {**io, **{name: clip(seed, shape) for name, (seed, shape) in HUNYUAN_CLIPS.items()}}


@pytest.fixture(scope="module")
def dc_ae_io():
    return load_file(str(FIXTURES / "dc_ae_io.safetensors"))


def hunyuan(path=HUNYUAN_FOLDER, **kwargs) -> HunyuanVAE:
    """The adapter with the fixture's small spatial tiles (Open-Sora's are 256 px)."""
    vae = build_opensora2_vae("hunyuan", str(path), **kwargs)
    return HunyuanVAE(vae.vae, vae.scaling_factor, micro_batch=vae.micro_batch, sample_posterior=vae.sample_posterior,
                      spatial_tile=int(HUNYUAN_META["spatial_tile"]))


@pytest.fixture(scope="module")
def dc_ae() -> OpenSoraDCAE:
    vae = build_opensora2_vae("opensora-dc-ae", str(DC_AE_FILE))
    return OpenSoraDCAE(vae.net, vae.scaling_factor, spatial_tile=int(DC_AE_META["spatial_tile_size"]),
                        temporal_tile=int(DC_AE_META["temporal_tile_size"]))


# --------------------------------------------------------------------------- parity


def test_hunyuan_matches_open_sora(hunyuan_io):
    vae = hunyuan()
    assert vae.scaling_factor == float(HUNYUAN_META["scale_factor"]) == 0.476986
    for clip_name, latent, decoded in (("video", "latent_mode", "decoded"), ("image", "image_latent", "image_decoded"),
                                       ("wide", "wide_latent", "wide_decoded")):   # wide: 2 x 2 spatial tiles
        assert_close(vae.encode(hunyuan_io[clip_name]), hunyuan_io[latent], TOLERANCE, clip_name)
        assert_close(vae.decode(hunyuan_io[latent]), hunyuan_io[decoded], TOLERANCE, clip_name)


def test_open_soras_single_file_loads_as_the_diffusers_folder_does():
    """hunyuan_vae.safetensors holds diffusers' names; its architecture is read off the tensors."""
    folder, file = hunyuan(HUNYUAN_FOLDER), hunyuan(HUNYUAN_FILE)
    assert {k: v.shape for k, v in file.state_dict().items()} == {k: v.shape for k, v in folder.state_dict().items()}
    assert all(torch.equal(v, folder.state_dict()[k]) for k, v in file.state_dict().items())
    wanted = ("block_out_channels", "layers_per_block", "latent_channels", "norm_num_groups", "mid_block_add_attention",
              "spatial_compression_ratio", "temporal_compression_ratio", "scaling_factor")
    assert {k: file.vae.config[k] for k in wanted} == {k: folder.vae.config[k] for k in wanted}


def test_hunyuan_posterior_sample_matches_open_sora_and_is_seeded(hunyuan_io):
    video, seed = hunyuan_io["video"], int(HUNYUAN_META["sample_seed"])
    vae = hunyuan(sample_posterior=True)
    sample = vae.encode(video, generator=torch.Generator().manual_seed(seed))
    assert_close(sample, hunyuan_io["latent_sample"], TOLERANCE, 'sample')
    assert torch.equal(sample, vae.encode(video, generator=torch.Generator().manual_seed(seed)))
    assert not torch.allclose(sample, vae.encode(video, generator=torch.Generator().manual_seed(seed + 1)))
    vae.micro_batch = 1000   # both clips in one pass: the same draw for the batch
    assert torch.allclose(sample, vae.encode(video, generator=torch.Generator().manual_seed(seed)), atol=1e-5)
    # Without a generator (validation, cache builds, sampling references) it is the mode, as with the option off.
    assert torch.equal(hunyuan(sample_posterior=True).encode(video), hunyuan(sample_posterior=False).encode(video))


@pytest.mark.parametrize("case", sorted(DC_AE_CASES))
def test_dc_ae_matches_open_sora(case, dc_ae, dc_ae_io):
    seed, shape, _ = DC_AE_CASES[case]
    assert_close(dc_ae.encode(clip(seed, shape)), dc_ae_io[f"{case}_latent"], TOLERANCE, "encode")
    assert_close(dc_ae.decode(dc_ae_io[f"{case}_latent"]), dc_ae_io[f"{case}_decoded"], TOLERANCE, "decode")


def test_dc_ae_decode_with_a_one_frame_last_tile_returns_every_frame(dc_ae, dc_ae_io):
    """Open-Sora decodes 7 latent frames (4-frame tiles every 3) to 25 frames: its last tile holds
    one latent frame, decoded as an image. videodit leaves that tile out and returns 28; the
    frames both have agree."""
    ours, ref = dc_ae.decode(dc_ae_io["short_tail"]), dc_ae_io["short_tail_decoded"].clamp(-1, 1)
    assert (ours.shape[2], ref.shape[2]) == (28, 25)
    assert_close(ours[:, :, :24], ref[:, :, :24], TOLERANCE, "first 24 frames")
    assert_close(ours[:, :, 27], ref[:, :, 24], TOLERANCE, "last frame")   # Open-Sora's last frame is the tile's last


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("kind, frames, size, latent", [
    ("hunyuan", 129, (768, 768), (33, 96, 96)),
    ("hunyuan", 1, (256, 192), (1, 32, 24)),
    ("dc-ae", 128, (768, 768), (32, 24, 24)),
    ("dc-ae", 16, (256, 512), (4, 8, 16)),
    ("dc-ae", 1, (256, 256), (1, 8, 8)),
])
def test_latent_sizes_follow_each_vae(kind, frames, size, latent, dc_ae):
    vae = hunyuan() if kind == "hunyuan" else dc_ae
    assert vae.latent_size(frames, *size) == latent
    assert vae.num_frames_for(latent[0]) == frames


@pytest.mark.parametrize("kind, shape, words", [
    ("hunyuan", (1, 3, 10, 32, 32), "4k+1 frames (nearest: 9 or 13)"),
    ("hunyuan", (1, 3, 9, 36, 32), "multiples of 8"),
    ("dc-ae", (1, 3, 4, 64, 64), "multiple of 4 from 8"),
    ("dc-ae", (1, 3, 10, 64, 64), "(nearest: 8 or 12)"),
    ("dc-ae", (1, 3, 8, 48, 64), "multiples of 32"),
])
def test_clips_that_do_not_fit_are_refused_in_one_line(kind, shape, words, dc_ae):
    vae = hunyuan() if kind == "hunyuan" else dc_ae
    with pytest.raises(UserError) as err:
        vae.encode(torch.zeros(shape))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_adapters_stay_frozen(dc_ae):
    for vae in (hunyuan(), dc_ae):
        vae.train()
        assert not vae.training and not any(m.training for m in vae.modules())
        assert not any(p.requires_grad for p in vae.parameters())


# --------------------------------------------------------------------------- loading


def _edited(tmp_path: Path, source: Path, drop: str | None = None, add: str | None = None) -> Path:
    state = load_file(str(source))
    if drop:
        del state[drop]
    if add:
        state[add] = torch.zeros(1)
    out = tmp_path / "weights.safetensors"
    save_file(state, str(out))
    return out


@pytest.mark.parametrize("kind, make, words", [
    ("hunyuan", lambda t: _edited(t, HUNYUAN_FILE, drop="decoder.conv_out.conv.bias"),
     "tensor decoder.conv_out.conv.bias is missing (1 such tensors)"),
    ("hunyuan", lambda t: _edited(t, HUNYUAN_FILE, add="encoder.extra"), "encoder.extra is not part of the Hunyuan VAE"),
    ("hunyuan", lambda t: DC_AE_FILE, "set vae.kind=opensora-dc-ae"),
    ("opensora-dc-ae", lambda t: HUNYUAN_FILE, "set vae.kind=hunyuan"),
    ("opensora-dc-ae", lambda t: _edited(t, DC_AE_FILE, drop="decoder.project_out.op_list.0.bias"),
     "tensor decoder.project_out.op_list.0.bias is missing"),
    ("opensora-dc-ae", lambda t: _edited(t, DC_AE_FILE, add="decoder.stages.0.op_list.9.x"), "is not part of the Video DC-AE"),
    ("opensora-dc-ae", lambda t: FIXTURES, "is a folder"),
    ("hunyuan", lambda t: t / "absent.safetensors", "does not exist"),
    ("hunyuan", lambda t: (t / "vae.pth").write_bytes(b"x") and t / "vae.pth", "as .safetensors"),
    ("hunyuan", lambda t: (t / "bad.safetensors").write_bytes(b"garbage") and t / "bad.safetensors",
     "cannot be read as safetensors"),
    ("hunyuan", lambda t: FIXTURES, "has no config.json"),
    ("hunyuan", lambda t: (t / "config.json").write_text('{"_class_name": "AutoencoderKLWan"}') and t,
     "not AutoencoderKLHunyuanVideo"),
    ("hunyuan", lambda t: None, "vae.path is required"),
])
def test_bad_weights_are_refused_in_one_line(kind, make, words, tmp_path):
    path = make(tmp_path)
    with pytest.raises(UserError) as err:
        build_opensora2_vae(kind, None if path is None else str(path))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_release_architectures_are_read_off_their_tensors():
    """At the released sizes (built on the meta device): HunyuanVideo's 246M-parameter VAE and
    the 459M-parameter dc-ae-f32t4c128 come back as their own configs."""
    from diffusers import AutoencoderKLHunyuanVideo

    with torch.device("meta"):
        hunyuan_vae, dc_ae_net = AutoencoderKLHunyuanVideo(), DCAE(DCAEConfig())
    config = hunyuan_config_from_tensors({k: tuple(v.shape) for k, v in hunyuan_vae.state_dict().items()})
    assert {k: hunyuan_vae.config[k] for k in config} == {**config, "block_out_channels": (128, 256, 512, 512)}
    assert config_from_tensors({k: tuple(v.shape) for k, v in dc_ae_net.state_dict().items()}) == DCAEConfig()
    assert sum(p.numel() for p in dc_ae_net.parameters()) == 459_462_147


def test_a_pipeline_folder_points_to_its_vae_subfolder(tmp_path):
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text((HUNYUAN_FOLDER / "config.json").read_text())
    with pytest.raises(UserError, match="set vae.subfolder=vae"):
        build_opensora2_vae("hunyuan", str(tmp_path))
    (tmp_path / "vae" / "diffusion_pytorch_model.safetensors").symlink_to(HUNYUAN_FILE)
    assert isinstance(build_opensora2_vae("hunyuan", str(tmp_path), "vae"), HunyuanVAE)


@pytest.mark.parametrize("kind", ["opensora-dc-ae", "identity", "factory:opensora-dc-ae"])
def test_posterior_sampling_is_refused_where_there_is_no_posterior(kind):
    """The DC-AE is a plain autoencoder: no posterior to sample (nor has the identity VAE)."""
    build = build_vae if kind.startswith("factory:") or kind == "identity" else build_opensora2_vae
    with pytest.raises(UserError, match="sample_posterior") as err:
        build(kind.removeprefix("factory:"), str(DC_AE_FILE), sample_posterior=True)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind, path, adapter", [("hunyuan", HUNYUAN_FOLDER, HunyuanVAE),
                                                 ("opensora-dc-ae", DC_AE_FILE, OpenSoraDCAE)])
def test_the_one_vae_factory_builds_them_through_the_family(kind, path, adapter):
    assert kind in vae_kinds()
    vae = build_vae(kind, str(path), micro_batch=3, dtype=torch.bfloat16)
    assert isinstance(vae, adapter) and vae.micro_batch == 3 and vae.dtype == torch.bfloat16


def test_the_one_vae_factory_passes_posterior_sampling_to_hunyuan():
    assert build_vae("hunyuan", str(HUNYUAN_FOLDER), sample_posterior=True).sample_posterior
    assert not build_vae("hunyuan", str(HUNYUAN_FOLDER)).sample_posterior
