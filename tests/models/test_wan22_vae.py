"""Wan 2.2's VAE (TI2V-5B's: ``vae.kind=wan2.2``, videodit.models.wan.vae) against Wan's own code.

The fixture (tests/fixtures/wan22_vae, written by scripts/make_wan22_vae_fixtures.py with Wan
2.2's ``wan/modules/vae2_2.py``) is a tiny random ``WanVAE_`` with Wan 2.2's topology (2x2 pixel
patches: 12 channels in and out; 4 stages with residual ``AvgDown3D`` / ``DupUp3D`` shortcuts, 2
residual blocks per encoder stage and 3 per decoder stage; temporal downsampling [False, True,
True]: 16x space, 4x causal time; z_dim 48 with Wan's 48-value tables) at base widths 4 (encoder)
and 3 (decoder; the release: 160 and 256) in Wan's original layout, plus the same weights as a
diffusers folder converted by diffusers' own ``convert_vae_22``, and Wan's outputs
(``Wan2_2_VAE``: clip-by-clip encode, normalised latents, clamped decode) for 1, 5 (two clips)
and 9 frames of 32x48. ``released_names.json`` holds the released VAE's tensor names and shapes
with diffusers' renaming of them. Offline throughout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tolerance import assert_close, relative
from videodit.errors import UserError
from videodit.models.vae import build_vae
from videodit.models.wan.vae import (WAN22_LATENTS_MEAN, WAN22_LATENTS_STD, WanVAE, build_wan_vae, checkpoint_kind,
                                     load_wan_checkpoint, to_diffusers_name, wan22_vae_config)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "wan22_vae"
PTH = FIXTURE / "Wan2.2_VAE_tiny.pth"
FOLDER = FIXTURE / "diffusers"          # a pipeline folder: vae.subfolder=vae
WAN21_PTH = FIXTURE.parent / "wan_vae" / "Wan2.1_VAE_tiny.pth"
META = json.loads((FIXTURE / "meta.json").read_text())
FRAMES = (1, 5, 9)
# fp32, relative to the reference's max |value|: ten times the worst deviation measured across CPUs,
# thread counts and torch releases (docs/testing.md): 1.1e-5 (a 9-frame decode); two clips in one pass 6.7e-6
TOLERANCE = 2e-4
BATCHED = 2e-4
SOURCES = {"pth": (str(PTH), None), "safetensors": (str(FIXTURE / "Wan2.2_VAE_tiny.safetensors"), None),
           "diffusers": (str(FOLDER), "vae")}


@pytest.fixture(scope="module", autouse=True)
def offline(no_network):
    """Every test here runs offline (conftest's no_network)."""


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "cases.safetensors"))


@pytest.fixture(scope="module")
def vae() -> WanVAE:
    return build_wan_vae(str(PTH), kind="wan2.2")


def _video(cases, frames: int) -> torch.Tensor:
    return cases[f"video_{frames}"].float() / 127.5 - 1


def _one_line_error(call, match: str) -> str:
    with pytest.raises(UserError, match=match) as info:
        call()
    assert "\n" not in str(info.value)
    return str(info.value)


def _state() -> dict[str, torch.Tensor]:
    return dict(torch.load(PTH, map_location="cpu", weights_only=True))


# --------------------------------------------------------------------------- what it is


def test_architecture_read_off_the_checkpoint(vae):
    tiny = META["WanVAE_"]
    assert (vae.latent_channels, vae.spatial_compression, vae.temporal_compression) == (48, 16, 4)
    assert vae.kind == "wan2.2" and not any(p.requires_grad for p in vae.parameters())
    vae.train()
    assert not vae.training and not vae.vae.training
    config = {k: vae.vae.config[k] for k in ("base_dim", "decoder_base_dim", "z_dim", "dim_mult", "num_res_blocks",
                                              "temperal_downsample", "is_residual", "in_channels", "out_channels",
                                              "patch_size", "scale_factor_temporal", "scale_factor_spatial")}
    assert config == {"base_dim": tiny["dim"], "decoder_base_dim": tiny["dec_dim"], "z_dim": 48,
                      "dim_mult": tiny["dim_mult"], "num_res_blocks": tiny["num_res_blocks"],
                      "temperal_downsample": tiny["temperal_downsample"], "is_residual": True, "in_channels": 12,
                      "out_channels": 12, "patch_size": 2, "scale_factor_temporal": 4, "scale_factor_spatial": 16}
    assert checkpoint_kind(_state()) == "wan2.2"
    assert checkpoint_kind(torch.load(WAN21_PTH, map_location="cpu", weights_only=True)) == "wan2.1"


def test_latent_tables_are_wans(vae, cases):
    """The 48-value tables of ``Wan2_2_VAE`` (which keeps ``scale = [mean, 1.0 / std]``), bit for bit."""
    assert list(vae.vae.config.latents_mean) == list(WAN22_LATENTS_MEAN)
    assert list(vae.vae.config.latents_std) == list(WAN22_LATENTS_STD)
    assert torch.equal(vae.latents_mean.flatten(), cases["latents_mean"])
    assert torch.equal(vae.latents_inv_std.flatten(), cases["latents_inv_std"])


def test_released_topology_agrees_with_diffusers_converter():
    """Our own renaming and architecture reading on the *released* Wan2.2_VAE.pth's names and shapes
    (meta tensors): the names go where diffusers' ``convert_vae_22`` puts them, the config read off
    the shapes is diffusers' Wan 2.2 config (base 160, decoder 256, z 48, 12 channels, 2x2 patches,
    16x / 4x), and the renamed tensors load strictly into that ``AutoencoderKLWan``."""
    released = json.loads((FIXTURE / "released_names.json").read_text())
    theirs = released["wan_to_diffusers"]
    assert {name: to_diffusers_name(name, 2) for name in theirs} == theirs
    state = {name: torch.empty(shape, device="meta") for name, shape in released["wan_shapes"].items()}
    assert set(state) == set(theirs) and checkpoint_kind(state) == "wan2.2"
    config = wan22_vae_config(state, "released")
    expected = {k: v for k, v in released["released_config"].items() if k in config}
    assert {k: config[k] for k in expected} == expected
    assert config["dim_mult"] == [1, 2, 4, 4] and config["num_res_blocks"] == 2
    assert config["temperal_downsample"] == [False, True, True]
    from diffusers import AutoencoderKLWan
    with torch.device("meta"):
        model = AutoencoderKLWan(**config)
    assert {theirs[name] for name in state} == set(model.state_dict())
    assert all(tuple(model.state_dict()[theirs[n]].shape) == tuple(t.shape) for n, t in state.items())


# --------------------------------------------------------------------------- parity with Wan


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("frames", FRAMES)
def test_encode_matches_wan(source, frames, cases):
    """Clip by clip, as Wan's wrapper encodes (``micro_batch`` = the clip's frames)."""
    path, subfolder = SOURCES[source]
    vae = build_wan_vae(path, subfolder, micro_batch=frames, kind="wan2.2")
    video = _video(cases, frames)
    latents = vae.encode(video)
    assert latents.shape == (video.shape[0], 48, *vae.latent_size(frames, 32, 48))
    assert_close(latents, cases[f"latents_{frames}"], TOLERANCE, 'latents')
    mu = torch.cat([vae.vae.encode(clip[None]).latent_dist.mode() for clip in video])
    assert_close(mu, cases[f"mu_{frames}"], TOLERANCE, 'mu')


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("frames", FRAMES)
def test_decode_matches_wan(source, frames, cases):
    path, subfolder = SOURCES[source]
    vae = build_wan_vae(path, subfolder, micro_batch=frames, kind="wan2.2")
    video = vae.decode(cases[f"latents_{frames}"], num_frames=frames)
    assert video.shape == cases[f"decoded_{frames}"].shape
    assert_close(video, cases[f"decoded_{frames}"], TOLERANCE, 'video')
    assert torch.equal(vae.decode(cases[f"latents_{frames}"]), video)   # num_frames is optional


def test_several_clips_per_pass(vae, cases):
    """The default micro_batch (16) puts both 5-frame clips in one pass; Wan encodes them one by one."""
    assert vae.micro_batch // 5 >= 2
    assert_close(vae.encode(_video(cases, 5)), cases["latents_5"], BATCHED, "batched encode")
    assert_close(vae.decode(cases["latents_5"], 5), cases["decoded_5"], BATCHED, "batched decode")


def test_our_conversion_is_diffusers_conversion(vae, tmp_path):
    """The .pth converted by videodit's renaming is, tensor for tensor, the folder diffusers' converter
    wrote; saved with save_pretrained it loads back as the same VAE."""
    theirs = load_file(str(FOLDER / "vae" / "diffusion_pytorch_model.safetensors"))
    ours = vae.vae.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    folder = json.loads((FOLDER / "vae" / "config.json").read_text())
    written = vae.vae.config
    assert all(written[k] == v for k, v in folder.items() if not k.startswith("_"))
    vae.vae.save_pretrained(tmp_path / "pipeline" / "vae")
    again = build_wan_vae(str(tmp_path / "pipeline"), "vae", kind="wan2.2")
    video = torch.rand(1, 3, 5, 32, 32) * 2 - 1
    assert torch.equal(again.encode(video), vae.encode(video))


def test_hub_config_keys_and_missing_tables(cases, tmp_path):
    """Wan-AI/Wan2.2-TI2V-5B-Diffusers' vae/config.json carries ``clip_output: false``, which diffusers
    0.42 no longer takes (ignored); a config without the tables gets Wan 2.2's, not diffusers'
    16-value default."""
    for name, change in (("hub", {"clip_output": False}), ("bare", None)):
        folder = tmp_path / name
        shutil.copytree(FOLDER / "vae", folder)
        config = json.loads((folder / "config.json").read_text())
        if change:
            config.update(change)
        else:
            del config["latents_mean"], config["latents_std"]
        (folder / "config.json").write_text(json.dumps(config))
        loaded = build_wan_vae(str(folder), micro_batch=1, kind="wan2.2")
        assert list(loaded.latents_mean.flatten().tolist()) == pytest.approx(WAN22_LATENTS_MEAN)
        assert_close(loaded.encode(_video(cases, 9)), cases["latents_9"], TOLERANCE, "encode")


def test_build_vae_kind_wan22(cases):
    vae = build_vae("wan2.2", str(PTH), micro_batch=9)
    assert isinstance(vae, WanVAE) and vae.kind == "wan2.2"
    assert_close(vae.encode(_video(cases, 9)), cases["latents_9"], TOLERANCE, "encode")


# --------------------------------------------------------------------------- frames, sizes, dtype


def test_latent_size_rule(vae):
    assert vae.latent_size(121, 704, 1280) == (31, 44, 80)   # TI2V-5B's 121 frames at 1280x704
    assert vae.latent_size(1, 32, 48) == (1, 2, 3)
    assert [vae.num_frames_for(t) for t in (1, 2, 31)] == [1, 5, 121]


@pytest.mark.parametrize("frames, nearest", [(120, "117 or 121"), (4, "1 or 5"), (0, "1")])
def test_frame_counts_that_are_not_4k_plus_1(vae, frames, nearest):
    _one_line_error(lambda: vae.latent_size(frames, 32, 32),
                    rf"^num_frames={frames} does not fit Wan 2\.2's VAE, which needs 4k\+1 frames "
                    rf"\(nearest: {nearest}\)")


def test_encode_and_decode_check_their_inputs(vae, cases):
    _one_line_error(lambda: vae.encode(torch.zeros(1, 3, 6, 32, 32)), r"num_frames=6 .*nearest: 5 or 9")
    _one_line_error(lambda: vae.encode(torch.zeros(1, 3, 5, 32, 40)), r"32x40 is not divisible by .* 16")
    with pytest.raises(ValueError, match="do not encode to 2 latent frames"):
        vae.decode(cases["latents_5"], num_frames=9)
    with pytest.raises(ValueError, match=r"expected latents \[B,48"):
        vae.decode(torch.zeros(1, 16, 2, 2, 3))


def test_bf16(cases):
    bf16 = build_wan_vae(str(PTH), dtype=torch.bfloat16, micro_batch=5, kind="wan2.2")
    assert {p.dtype for p in bf16.vae.parameters()} == {torch.bfloat16}
    latents = bf16.encode(_video(cases, 5))
    assert latents.dtype == torch.float32 and latents.shape == cases["latents_5"].shape
    assert relative(latents, cases["latents_5"]) < 0.1 and not torch.equal(latents, cases["latents_5"])


# --------------------------------------------------------------------------- refused files


def test_mismatched_release_is_one_line(tmp_path, vae):
    """A Wan 2.1 file or folder given as wan2.2 (and the other way round) names the kind to set."""
    _one_line_error(lambda: build_wan_vae(str(WAN21_PTH), kind="wan2.2"),
                    r"^vae\.path='.*Wan2\.1_VAE_tiny\.pth' holds Wan 2\.1's VAE \(Wan2\.1_VAE\.pth\), not Wan "
                    r"2\.2's; set vae\.kind=wan2\.1$")
    _one_line_error(lambda: build_wan_vae(str(PTH)), r"holds Wan 2\.2's VAE \(Wan2\.2_VAE\.pth\), not Wan 2\.1's; "
                                                     r"set vae\.kind=wan2\.2$")
    _one_line_error(lambda: build_wan_vae(str(FIXTURE / "Wan2.2_VAE_tiny.safetensors"), kind="wan2.1"),
                    r"set vae\.kind=wan2\.2$")
    vae.vae.save_pretrained(tmp_path / "v22")
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "v22")), r"holds Wan 2\.2's VAE .* set vae\.kind=wan2\.2$")
    build_wan_vae(str(WAN21_PTH)).vae.save_pretrained(tmp_path / "v21")
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "v21"), kind="wan2.2"),
                    r"holds Wan 2\.1's VAE, not Wan 2\.2's \(is_residual: true, patch_size: 2\); set vae\.kind=wan2\.1$")
    _one_line_error(lambda: build_wan_vae(str(PTH), kind="wan3"), r"vae\.kind='wan3' is not a Wan VAE")


def _crafted(tmp_path, name: str, state: dict) -> str:
    torch.save(state, tmp_path / name)
    return str(tmp_path / name)


def test_crafted_checkpoints_are_one_line_errors(tmp_path):
    def refused(state, match, name="crafted.pth"):
        _one_line_error(lambda: build_wan_vae(_crafted(tmp_path, name, state), kind="wan2.2"), match)

    state = _state()
    missing = {k: v for k, v in state.items() if k != "decoder.upsamples.1.upsamples.3.time_conv.weight"}
    refused(missing, r"tensor decoder\.up_blocks\.1\.upsampler\.time_conv\.weight is missing \(1 such tensors\); "
                     r"is this Wan 2\.2's VAE \(Wan2\.2_VAE\.pth\)\?$")
    wrong = {**state, "encoder.middle.1.to_qkv.weight": state["encoder.middle.1.to_qkv.weight"][:-3]}
    refused(wrong, r"tensor encoder\.mid_block\.attentions\.0\.to_qkv\.weight has shape \(21, 8, 1, 1\), the "
                   r"architecture wants \(24, 8, 1, 1\)")
    refused({**state, "encoder.downsamples.0.avg_shortcut.weight": torch.zeros(1)},
            r"tensor encoder\.downsamples\.0\.avg_shortcut\.weight is not part of Wan 2\.2's VAE")
    refused({**state, "decoder.extra.weight": torch.zeros(1)},
            r"tensor decoder\.extra\.weight is not part of Wan 2\.2's VAE \(1 such tensors\)")
    no_time = {k: v for k, v in state.items() if not k.startswith("decoder.upsamples.0.upsamples.3.time_conv.")}
    refused(no_time, r"decoder's temporal upsampling \[False, True, False\] is not the encoder's temporal "
                     r"downsampling \[False, True, True\] reversed")
    no_block = {k: v for k, v in state.items() if ".downsamples.1.downsamples.1." not in k}
    refused(no_block, r"encoder's stages hold \[2, 1, 2, 2\] residual blocks")
    rgb = {**state, "encoder.conv1.weight": state["encoder.conv1.weight"][:, :10]}
    refused(rgb, r"the encoder takes 10 channels, not 3 x p x p pixel patches")
    refused({k: v for k, v in state.items() if k != "conv2.weight"}, r"tensor conv2\.weight is missing")
    narrow = {k: (v[:16] if k in ("conv2.weight", "conv2.bias") else v) for k, v in state.items()}
    refused(narrow, r"has 16 latent channels, but Wan 2\.2's latent statistics have 48; pass latents_mean")
    refused({"state_dict": state}, r"not a plain state dict of tensors \(as Wan2\.2_VAE\.pth is\)")
    (tmp_path / "garbage.pth").write_bytes(b"not a checkpoint")
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "garbage.pth"), kind="wan2.2"), r"cannot be read as weights")
    renamed = {to_diffusers_name(k, 2): v for k, v in state.items()}
    save_file(renamed, str(tmp_path / "diffusers_names.safetensors"))
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "diffusers_names.safetensors"), kind="wan2.2"),
                    r"diffusers' tensor names")


class _Payload:
    """Pickles to a call of ``_record``: unpickling it would run code."""

    def __reduce__(self):
        return (_record, ("unpickled",))


RAN: list[str] = []


def _record(value):
    RAN.append(value)
    return value


def test_checkpoint_with_a_pickled_object_is_refused(tmp_path):
    torch.save({**_state(), "extra": _Payload()}, tmp_path / "evil.pth")
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "evil.pth"), kind="wan2.2"),
                    r"objects other than tensors.*refuses to unpickle; pass Wan's Wan2\.2_VAE\.pth")
    assert RAN == []


def test_bad_paths_are_one_line_errors(tmp_path):
    _one_line_error(lambda: build_wan_vae(None, kind="wan2.2"),
                    r"^vae\.path is required for vae\.kind=wan2\.2: point vae\.path to Wan2\.2_VAE\.pth")
    _one_line_error(lambda: build_wan_vae(str(PTH), scaling_factor=1.0, kind="wan2.2"),
                    r"vae\.scaling_factor does not apply to vae\.kind=wan2\.2")
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "nope"), kind="wan2.2"), r"neither a file nor an existing")
    (tmp_path / "ckpt").mkdir()
    shutil.copy(PTH, tmp_path / "ckpt" / "Wan2.2_VAE.pth")
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "ckpt"), kind="wan2.2"),
                    r"holds Wan2\.2_VAE\.pth: point vae\.path to that file")
    _one_line_error(lambda: build_wan_vae(str(FOLDER), kind="wan2.2"), r"has a vae/ folder: set vae\.subfolder=vae")


def test_load_wan_checkpoint_keeps_wan21_default():
    """The 2.1 entry points keep their defaults: kind is wan2.1 unless given."""
    assert not load_wan_checkpoint(WAN21_PTH).config.get("is_residual")
    assert load_wan_checkpoint(PTH, kind="wan2.2").config.is_residual
