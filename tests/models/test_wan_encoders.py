"""Wan 2.1's frozen encoders (videodit.models.wan.vae / videodit.models.wan.text).

The VAE fixture (tests/fixtures/wan_vae, written by scripts/make_wan_vae_fixtures.py with Wan
2.1's own ``wan/modules/vae.py``) is a tiny random ``WanVAE_`` with the released topology (4 stages,
2 residual blocks each, temporal downsampling [False, True, True], z_dim 16, base width 4) in Wan's
original layout, with Wan's posterior means, normalised latents and decoded clips for 1, 5 and 9
(two clips) frames of 32x32. The umT5 tests run a tiny random stand-in. Offline throughout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from videodit.errors import UserError
from videodit.models.vae import Diffusers3DVAE, build_vae, vae_kinds
from videodit.models.wan.text import (WAN_NEGATIVE_PROMPT, UMT5TextEncoder, clean_prompt, load_umt5)
from videodit.models.wan.vae import (WAN21_LATENTS_MEAN, WAN21_LATENTS_STD, WanVAE, build_wan_vae,
                                     to_diffusers_name, wan_vae_config)
from videodit.toy.stand_ins import save_t5, save_umt5, save_wan_vae

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "wan_vae"
PTH = FIXTURE / "Wan2.1_VAE_tiny.pth"
FRAMES = (1, 5, 9)
TOLERANCE = 1e-5   # fp32; measured: 0 (bit-identical)


@pytest.fixture(scope="module", autouse=True)
def offline(no_network):
    """Every test here runs offline (conftest's no_network)."""


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURE / "cases.safetensors"))


@pytest.fixture(scope="module")
def vae() -> WanVAE:
    return build_vae("wan2.1", str(PTH))


def _video(cases, frames: int) -> torch.Tensor:
    return cases[f"video_{frames}"].float() / 127.5 - 1


def _one_line_error(call, match: str) -> str:
    with pytest.raises(UserError, match=match) as info:
        call()
    assert "\n" not in str(info.value)
    return str(info.value)


# --------------------------------------------------------------------------- VAE: parity with Wan


def test_attributes_and_frozen(vae):
    assert isinstance(vae, WanVAE) and "wan2.1" in vae_kinds()
    assert (vae.latent_channels, vae.spatial_compression, vae.temporal_compression) == (16, 8, 4)
    assert not any(p.requires_grad for p in vae.parameters())
    vae.train()
    assert not vae.training and not vae.vae.training
    # Wan 2.1's statistics are applied to a checkpoint file, and land in the diffusers config.
    assert list(vae.vae.config.latents_mean) == list(WAN21_LATENTS_MEAN)
    assert list(vae.vae.config.latents_std) == list(WAN21_LATENTS_STD)


@pytest.mark.parametrize("frames", FRAMES)
def test_encode_matches_wan(vae, cases, frames):
    video = _video(cases, frames)
    latents = vae.encode(video)
    assert latents.shape == cases[f"latents_{frames}"].shape == (video.shape[0], 16, *vae.latent_size(frames, 32, 32))
    assert latents.dtype == torch.float32
    assert (latents - cases[f"latents_{frames}"]).abs().max() <= TOLERANCE
    mu = torch.cat([vae.vae.encode(clip[None]).latent_dist.mode() for clip in video])   # Wan: clip by clip
    assert (mu - cases[f"mu_{frames}"]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("frames", FRAMES)
def test_decode_matches_wan(vae, cases, frames):
    video = vae.decode(cases[f"latents_{frames}"], num_frames=frames)
    assert video.shape == cases[f"video_{frames}"].shape
    assert (video - cases[f"decoded_{frames}"]).abs().max() <= TOLERANCE
    assert torch.equal(vae.decode(cases[f"latents_{frames}"]), video)   # num_frames is optional


def test_normalisation_is_wans_per_channel_table(vae, cases):
    mean = torch.tensor(WAN21_LATENTS_MEAN).view(1, -1, 1, 1, 1)
    std = torch.tensor(WAN21_LATENTS_STD).view(1, -1, 1, 1, 1)
    assert torch.allclose(cases["latents_mean"], mean.flatten()) and torch.allclose(cases["latents_std"], std.flatten())
    assert torch.allclose((cases["mu_5"] - mean) / std, cases["latents_5"], atol=1e-6)


def test_micro_batches_do_not_change_the_result(cases):
    video = _video(cases, 9)
    whole = build_wan_vae(str(PTH), micro_batch=18).encode(video)   # both clips in one pass
    assert (whole - cases["latents_9"]).abs().max() <= TOLERANCE


def test_safetensors_checkpoint_and_diffusers_folder(vae, cases, tmp_path):
    video = _video(cases, 5)
    from_safetensors = build_wan_vae(str(FIXTURE / "Wan2.1_VAE_tiny.safetensors"))
    assert torch.equal(from_safetensors.encode(video), vae.encode(video))
    # The converted model, written as a diffusers pipeline's vae/ folder, loads back the same.
    vae.vae.save_pretrained(tmp_path / "pipeline" / "vae")
    folder = build_vae("wan2.1", str(tmp_path / "pipeline"), subfolder="vae")
    assert (folder.encode(video) - cases["latents_5"]).abs().max() <= TOLERANCE
    assert (folder.decode(cases["latents_5"], 5) - cases["decoded_5"]).abs().max() <= TOLERANCE
    assert torch.equal(build_wan_vae(str(tmp_path / "pipeline" / "vae")).encode(video), folder.encode(video))
    # videodit's generic diffusers adapter reads the same folder alike ((mu - mean) / std vs Wan's * (1 / std)).
    generic = build_vae("diffusers", str(tmp_path / "pipeline"), subfolder="vae")
    assert isinstance(generic, Diffusers3DVAE)
    assert (generic.encode(video) - cases["latents_5"]).abs().max() <= TOLERANCE


def test_name_map_agrees_with_diffusers_converter():
    """Our own Wan -> diffusers renaming against diffusers' converter, on the released Wan 2.1 VAE's
    names (diffusers' converter is hard-wired to that topology: up-block indices 0-14, a shortcut in
    up block 1 only, so it cannot check the fixture, whose narrower widths add one in up block 2)."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    state = torch.load(PTH, map_location="cpu", weights_only=True)
    assert sorted(state) == sorted(_wan_names(2, [1, 2, 2, 2], [False, True, True]))   # the generator is right
    released = _wan_names(2, [1, 2, 4, 4], [False, True, True])
    theirs = convert_wan_vae_to_diffusers({name: i for i, name in enumerate(released)})
    ours = {to_diffusers_name(name, 2): i for i, name in enumerate(released)}
    assert ours == theirs
    meta = json.loads((FIXTURE / "meta.json").read_text())["WanVAE_"]
    config = wan_vae_config(state, "test")
    assert config == {"base_dim": meta["dim"], "z_dim": meta["z_dim"], "dim_mult": meta["dim_mult"],
                      "num_res_blocks": meta["num_res_blocks"], "attn_scales": [],
                      "temperal_downsample": meta["temperal_downsample"], "dropout": 0.0}


def test_other_architectures_are_read_from_the_tensors(tmp_path):
    """A topology other than the released one (3 stages, 1 residual block): the config is inferred
    from the names and shapes, and the renamed tensors load strictly."""
    save_wan_vae(tmp_path / "d", z_dim=4, dim_mult=(1, 2, 2), num_res_blocks=1, temperal_downsample=(True, False))
    reference = build_wan_vae(str(tmp_path / "d"))
    back = {to_diffusers_name(k, 1): k for k in _wan_names(1, [1, 2, 2], [True, False])}
    assert set(back) == set(reference.vae.state_dict())
    inverse = {wan: reference.vae.state_dict()[ours] for ours, wan in back.items()}
    save_file(inverse, str(tmp_path / "wan.safetensors"))
    mean, std = reference.vae.config.latents_mean, reference.vae.config.latents_std
    loaded = build_wan_vae(str(tmp_path / "wan.safetensors"), latents_mean=mean, latents_std=std)
    assert loaded.temporal_compression == 2 and loaded.spatial_compression == 4
    video = torch.rand(1, 3, 5, 8, 8) * 2 - 1
    assert torch.equal(loaded.encode(video), reference.encode(video))
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "wan.safetensors")), r"4 latent channels.*latents_mean")


def _wan_names(r: int, dim_mult: list[int], temporal: list[bool]) -> list[str]:
    """Wan's tensor names for a VAE built as wan/modules/vae.py builds it: per encoder stage ``r``
    residual blocks then a resample (none after the last stage); per decoder stage ``r + 1``
    residual blocks then an upsample; a 1x1 shortcut wherever a block changes width."""
    res = ["residual.0.gamma", "residual.2.weight", "residual.2.bias", "residual.3.gamma", "residual.6.weight",
           "residual.6.bias"]
    attn = ["norm.gamma", "to_qkv.weight", "to_qkv.bias", "proj.weight", "proj.bias"]
    conv = ["weight", "bias"]
    names = [f"conv{i}.{c}" for i in (1, 2) for c in conv]
    for part in ("encoder", "decoder"):
        names += [f"{part}.conv1.{c}" for c in conv] + [f"{part}.head.0.gamma"] + [f"{part}.head.2.{c}" for c in conv]
        names += [f"{part}.middle.{i}.{n}" for i in (0, 2) for n in res] + [f"{part}.middle.1.{n}" for n in attn]
    stages = len(dim_mult)
    for part, blocks, dims, flags in (("encoder.downsamples", r, [1] + dim_mult, temporal),
                                      ("decoder.upsamples", r + 1, [dim_mult[-1]] + dim_mult[::-1], temporal[::-1])):
        index = 0
        for stage in range(stages):
            width = dims[stage] // (2 if part.startswith("decoder") and stage else 1)   # Wan's upsample halves it
            for block in range(blocks):
                names += [f"{part}.{index}.{n}" for n in res]
                if block == 0 and width != dims[stage + 1]:
                    names += [f"{part}.{index}.shortcut.{c}" for c in conv]
                index += 1
            if stage < stages - 1:
                names += [f"{part}.{index}.resample.1.{c}" for c in conv]
                names += [f"{part}.{index}.time_conv.{c}" for c in conv] if flags[stage] else []
                index += 1
    return names


# --------------------------------------------------------------------------- VAE: frame rule, dtype


def test_latent_size_rule(vae):
    assert vae.latent_size(1, 480, 832) == (1, 60, 104)
    assert vae.latent_size(81, 480, 832) == (21, 60, 104)   # Wan 2.1's 81-frame clips
    assert vae.latent_size(17, 32, 32) == (5, 4, 4)
    assert [vae.num_frames_for(t) for t in (1, 2, 21)] == [1, 5, 81]


@pytest.mark.parametrize("frames, nearest", [(80, "77 or 81"), (4, "1 or 5"), (0, "1")])
def test_frame_counts_that_are_not_4k_plus_1(vae, frames, nearest):
    _one_line_error(lambda: vae.latent_size(frames, 32, 32),
                    rf"^num_frames={frames} does not fit Wan 2.1's VAE, which needs 4k\+1 frames "
                    rf"\(nearest: {nearest}\)")


def test_encode_and_decode_check_their_inputs(vae, cases):
    _one_line_error(lambda: vae.encode(torch.zeros(1, 3, 6, 32, 32)), r"num_frames=6 .*nearest: 5 or 9")
    _one_line_error(lambda: vae.encode(torch.zeros(1, 3, 5, 32, 36)), r"not divisible by .* 8")
    with pytest.raises(ValueError, match="do not encode to 2 latent frames"):
        vae.decode(cases["latents_5"], num_frames=9)
    _one_line_error(lambda: vae.decode(cases["latents_5"], num_frames=6), r"num_frames=6")


def test_bf16_halves_the_weights_and_keeps_fp32_latents(vae, cases):
    bf16 = build_vae("wan2.1", str(PTH), dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.vae.parameters()} == {torch.bfloat16}
    video = _video(cases, 5)
    latents = bf16.encode(video)
    assert latents.dtype == torch.float32 and latents.shape == cases["latents_5"].shape
    assert torch.allclose(latents, cases["latents_5"], atol=0.1) and not torch.equal(latents, cases["latents_5"])
    decoded = bf16.decode(cases["latents_5"], 5)
    assert decoded.dtype == torch.float32 and torch.allclose(decoded, cases["decoded_5"], atol=0.1)


# --------------------------------------------------------------------------- VAE: refused files


class _Payload:
    """Pickles to a call of ``_record``: unpickling it would run code."""

    def __reduce__(self):
        return (_record, ("unpickled",))


RAN: list[str] = []


def _record(value):
    RAN.append(value)
    return value


def test_checkpoint_with_a_pickled_object_is_refused(tmp_path):
    state = dict(torch.load(PTH, map_location="cpu", weights_only=True))
    torch.save({**state, "extra": _Payload()}, tmp_path / "evil.pth")
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "evil.pth")),
                    r"objects other than tensors.*refuses to unpickle")
    assert RAN == []


def test_malformed_checkpoints_are_refused(tmp_path):
    state = dict(torch.load(PTH, map_location="cpu", weights_only=True))
    torch.save({"state_dict": state}, tmp_path / "nested.pth")
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "nested.pth")), r"not a plain state dict of tensors")
    (tmp_path / "garbage.pth").write_bytes(b"not a checkpoint")
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "garbage.pth")), r"cannot be read as weights")
    del state["decoder.upsamples.7.time_conv.weight"]
    torch.save(state, tmp_path / "partial.pth")
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "partial.pth")),
                    r"tensor decoder\.up_blocks\.1\.upsamplers\.0\.time_conv\.weight is missing \(1 such")
    renamed = {to_diffusers_name(k, 2): v for k, v in state.items()}
    save_file(renamed, str(tmp_path / "diffusers_names.safetensors"))
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "diffusers_names.safetensors")), r"diffusers' tensor names")


def test_bad_paths_are_one_line_errors(tmp_path, vae):
    _one_line_error(lambda: build_vae("wan2.1"), r"^vae\.path is required for vae\.kind=wan2\.1")
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "nope")), r"is neither a file nor an existing folder")
    _one_line_error(lambda: build_wan_vae(str(tmp_path)), r"has no config\.json; point vae\.path")
    vae.vae.save_pretrained(tmp_path / "pipeline" / "vae")
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "pipeline")), r"has a vae/ folder: set vae\.subfolder=vae")
    (tmp_path / "ckpt").mkdir()
    shutil.copy(PTH, tmp_path / "ckpt" / "Wan2.1_VAE.pth")
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "ckpt")), r"holds Wan2\.1_VAE\.pth: point vae\.path to that")
    (tmp_path / "notes.txt").write_text("x")
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "notes.txt")), r"\.txt file, not a checkpoint")
    (tmp_path / "kl").mkdir()
    (tmp_path / "kl" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    _one_line_error(lambda: build_wan_vae(str(tmp_path / "kl")), r"'AutoencoderKL', not AutoencoderKLWan")
    _one_line_error(lambda: build_vae("wan2.1", str(PTH), scaling_factor=0.5), r"scaling_factor does not apply")


# --------------------------------------------------------------------------- text: umT5


TOKENS = ["<pad>", "</s>", "<unk>", "a", "red", "green", "circle", "square", "moving", "left", "up", "&"]
CAPTIONS = ["a red circle", "a green square moving left up up", ""]


@pytest.fixture(scope="module")
def umt5_dir(tmp_path_factory):
    return save_umt5(tmp_path_factory.mktemp("wan_pipeline"), words=TOKENS)


@pytest.fixture(scope="module")
def umt5(umt5_dir) -> UMT5TextEncoder:
    return load_umt5(str(umt5_dir))


def test_umt5_shapes_mask_and_zero_padding(umt5):
    assert type(umt5.model).__name__ == "UMT5EncoderModel"
    assert (umt5.dim, umt5.max_length) == (16, 512)
    assert not any(p.requires_grad for p in umt5.parameters())
    emb, mask = umt5.encode(CAPTIONS)
    assert emb.shape == (3, 512, 16) and emb.dtype == torch.float32 and mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [4, 8, 1]   # words + </s>; an empty caption is </s> alone
    assert all(mask[i, :n].all() and not mask[i, n:].any() for i, n in enumerate([4, 8, 1]))
    assert torch.all(emb[~mask] == 0) and torch.all(emb[mask].abs().sum(-1) > 0)


def test_umt5_equals_masked_run_trimmed_by_hand(umt5, umt5_dir):
    """What Wan and diffusers' WanPipeline do: run with the mask, keep u[:len], zero-pad to 512."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    tokenizer = AutoTokenizer.from_pretrained(str(umt5_dir / "tokenizer"), local_files_only=True)
    model = UMT5EncoderModel.from_pretrained(str(umt5_dir / "text_encoder"), local_files_only=True).eval()
    tokens = tokenizer(CAPTIONS, padding="max_length", max_length=512, truncation=True, add_special_tokens=True,
                       return_attention_mask=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(tokens.input_ids, tokens.attention_mask).last_hidden_state
        unmasked = model(tokens.input_ids).last_hidden_state
    lengths = tokens.attention_mask.gt(0).sum(1)
    expected = torch.stack([torch.cat([u[:n], u.new_zeros(512 - n, u.shape[1])]) for u, n in zip(hidden, lengths)])
    emb, _ = umt5.encode(CAPTIONS)
    assert torch.equal(emb, expected)
    # The mask matters: without it the pads change the real tokens' outputs.
    assert not torch.allclose(emb[0, :4], unmasked[0, :4], atol=1e-4)


def test_umt5_equals_diffusers_wan_pipeline(umt5):
    """diffusers' own prompt embedding for Wan (cleaning, masked run, trim, zero-pad), bit for bit."""
    import types

    from diffusers import WanPipeline

    if not hasattr(WanPipeline, "_get_t5_prompt_embeds"):
        pytest.skip("this diffusers release has no WanPipeline._get_t5_prompt_embeds")
    pipeline = types.SimpleNamespace(tokenizer=umt5.tokenizer, text_encoder=umt5.model,
                                     _execution_device=torch.device("cpu"))
    captions = ["a red circle", "  a green square moving left up up &amp; ", ""]
    expected = WanPipeline._get_t5_prompt_embeds(pipeline, captions, max_sequence_length=512,
                                                 device=torch.device("cpu"), dtype=torch.float32)
    emb, mask = umt5.encode(captions)
    assert torch.equal(emb, expected) and mask.sum(1).tolist() == [4, 9, 1]


def test_umt5_cleans_prompts_like_wan(umt5):
    assert clean_prompt("  a   red\tcircle &amp;amp; \n") == "a red circle &"
    messy, _ = umt5.encode(["  a   red\tcircle &amp;amp; \n"])
    clean, _ = umt5.encode(["a red circle &"])
    assert torch.equal(messy, clean)


def test_umt5_folder_layouts(umt5, umt5_dir, tmp_path):
    emb, _ = umt5.encode(CAPTIONS)
    # A text_encoder/ folder finds its sibling tokenizer/; one folder may hold both.
    assert torch.equal(load_umt5(str(umt5_dir / "text_encoder")).encode(CAPTIONS)[0], emb)
    shutil.copytree(umt5_dir / "text_encoder", tmp_path / "both")
    shutil.copytree(umt5_dir / "tokenizer", tmp_path / "both", dirs_exist_ok=True)
    both = load_umt5(str(tmp_path / "both"), max_length=16)
    short, mask = both.encode(CAPTIONS)
    assert short.shape == (3, 16, 16) and torch.equal(short, emb[:, :16])


def test_umt5_bf16(umt5, umt5_dir):
    bf16 = load_umt5(str(umt5_dir), dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    emb16, mask16 = bf16.encode(CAPTIONS)
    emb32, mask32 = umt5.encode(CAPTIONS)
    assert emb16.dtype == torch.float32 and torch.equal(mask16, mask32)
    assert torch.allclose(emb16, emb32, atol=0.1) and not torch.equal(emb16, emb32)


def test_umt5_bad_folders(tmp_path):
    _one_line_error(lambda: load_umt5(None), r"^text\.path is required for text\.kind=umt5")
    _one_line_error(lambda: load_umt5(str(tmp_path / "missing")), r"is not an existing folder")
    (tmp_path / "models_t5_umt5-xxl-enc-bf16.pth").write_bytes(b"")
    _one_line_error(lambda: load_umt5(str(tmp_path)), r"neither text_encoder/config\.json.*Wan's original layout")
    save_t5(tmp_path / "t5", words=TOKENS)
    _one_line_error(lambda: load_umt5(str(tmp_path / "t5")), r"model_type='t5', not 'umt5'")
    (tmp_path / "no_tok").mkdir()
    (tmp_path / "no_tok" / "config.json").write_text(json.dumps({"model_type": "umt5"}))
    _one_line_error(lambda: load_umt5(str(tmp_path / "no_tok")), r"has no tokenizer")


def test_wan_negative_prompt():
    assert WAN_NEGATIVE_PROMPT.startswith("色调艳丽，过曝，静态") and WAN_NEGATIVE_PROMPT.endswith("背景人很多，倒着走")
    assert len(WAN_NEGATIVE_PROMPT) == 137 and "\n" not in WAN_NEGATIVE_PROMPT
