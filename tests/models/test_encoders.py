"""Frozen VAE and text encoder adapters (videodit.models.vae / videodit.models.text).

Every real model here is a tiny randomly initialised one saved with save_pretrained into a
temporary folder and loaded back through the factories, with the Hub switched offline and
sockets disabled, so the tests prove that nothing is ever downloaded.
"""

from __future__ import annotations

import json

import pytest
import torch

from videodit.errors import UserError
from videodit.components import build_text_encoder
from videodit.models.text import HFTextEncoder
from videodit.toy.encoder import ToyTextEncoder
from videodit.toy.stand_ins import save_kl_vae, save_t5, save_word_tokenizer
from videodit.models.vae import Diffusers2DVAE, Diffusers3DVAE, IdentityVAE, build_vae


# --------------------------------------------------------------------------- offline guard


@pytest.fixture(scope="module", autouse=True)
def offline(no_network):
    """Every test here runs offline (conftest's no_network)."""


def _video(batch: int, frames: int, size: int = 16, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, frames, size, size, generator=generator) * 2 - 1


# --------------------------------------------------------------------------- tiny saved models


@pytest.fixture(scope="module")
def kl_dir(tmp_path_factory):
    """A tiny 2-D AutoencoderKL (spatial compression 2) under a 'vae' subfolder."""
    root = tmp_path_factory.mktemp("kl")
    save_kl_vae(root / "vae", shift_factor=0.1)
    return root


@pytest.fixture(scope="module")
def cogvideox_dir(tmp_path_factory):
    """A tiny AutoencoderKLCogVideoX: 3 blocks -> spatial 4, temporal 4 (causal)."""
    from diffusers import AutoencoderKLCogVideoX

    torch.manual_seed(0)
    model = AutoencoderKLCogVideoX(
        block_out_channels=(8, 8, 16),
        down_block_types=("CogVideoXDownBlock3D",) * 3,
        up_block_types=("CogVideoXUpBlock3D",) * 3,
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=4,
        temporal_compression_ratio=4,
        scaling_factor=0.7,
    )
    path = tmp_path_factory.mktemp("cogvideox")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    """A tiny AutoencoderKLWan: spatial 4, temporal 4, per-channel latents_mean/std."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    model = AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[2.0, 1.5, 1.0, 0.5],
    )
    path = tmp_path_factory.mktemp("wan")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def kl_vae(kl_dir):
    return build_vae("diffusers", str(kl_dir), subfolder="vae", micro_batch=4)


@pytest.fixture(scope="module", params=["cogvideox", "wan"])
def video_vae(request):
    path = request.getfixturevalue(f"{request.param}_dir")
    return build_vae("diffusers", str(path), micro_batch=9)


TOKENS = ["<pad>", "</s>", "<unk>", "a", "red", "green", "circle", "square", "moving", "left", "up"]


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    return save_t5(tmp_path_factory.mktemp("t5"), words=TOKENS)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A non-T5 encoder, loaded through the AutoModel path."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(TOKENS), hidden_size=12, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=32, pad_token_id=0,
    )
    path = tmp_path_factory.mktemp("bert")
    BertModel(config).save_pretrained(path)
    save_word_tokenizer(path, TOKENS)
    return path


# --------------------------------------------------------------------------- VAE: identity


@pytest.mark.parametrize("kind, channels, compression", [("identity", 3, 1), ("space-to-depth", 48, 4)])
def test_weight_free_vae_round_trip(kind, channels, compression):
    vae = build_vae(kind)
    assert isinstance(vae, IdentityVAE)
    assert (vae.latent_channels, vae.spatial_compression, vae.temporal_compression) == (channels, compression, 1)
    video = _video(2, 3, size=8)
    latents = vae.encode(video)
    assert latents.shape == (2, channels, *vae.latent_size(3, 8, 8))
    assert torch.equal(vae.decode(latents), video)
    if compression > 1:   # channel c * 16 + 4 i + j of a latent pixel is pixel (i, j) of its 4 x 4 block
        assert torch.equal(latents[:, 4 * 4 + 2 * 4 + 3, :, 1, 0], video[:, 1, :, 4 + 2, 3])


# --------------------------------------------------------------------------- VAE: 2-D per frame


def test_2d_vae_attributes_and_frozen(kl_vae):
    assert isinstance(kl_vae, Diffusers2DVAE)
    assert (kl_vae.latent_channels, kl_vae.spatial_compression, kl_vae.temporal_compression) == (4, 2, 1)
    assert not any(p.requires_grad for p in kl_vae.parameters())
    kl_vae.train()
    assert not kl_vae.training and not kl_vae.vae.training


@pytest.mark.parametrize("frames", [3, 1])
def test_2d_vae_shapes_and_determinism(kl_vae, frames):
    video = _video(2, frames)
    latents = kl_vae.encode(video)
    assert latents.shape == (2, 4, *kl_vae.latent_size(frames, 16, 16))
    assert latents.shape == (2, 4, frames, 8, 8)
    assert not latents.requires_grad
    assert torch.equal(latents, kl_vae.encode(video))
    decoded = kl_vae.decode(latents)
    assert decoded.shape == video.shape
    assert decoded.abs().max() <= 1.0


def test_2d_vae_normalisation_and_micro_batch(kl_vae, kl_dir):
    video = _video(1, 5)
    latents = kl_vae.encode(video)
    # Frame 3 by hand: (posterior mean - shift_factor) * scaling_factor.
    raw = kl_vae.vae.encode(video[:, :, 3]).latent_dist.mean
    assert torch.allclose(latents[:, :, 3], (raw - 0.1) * 0.5, atol=1e-5)
    # Micro-batching must not change the result; a scaling_factor override is honoured.
    other = build_vae("diffusers", str(kl_dir), subfolder="vae", micro_batch=1, scaling_factor=1.0)
    assert torch.allclose(other.encode(video), latents / 0.5, atol=1e-5)


def test_vae_frame_size_must_divide(kl_vae):
    with pytest.raises(UserError, match="divisible"):
        kl_vae.encode(_video(1, 1, size=15))


# --------------------------------------------------------------------------- VAE: 3-D video


def test_3d_vae_attributes(video_vae):
    assert isinstance(video_vae, Diffusers3DVAE)
    sizes = (video_vae.latent_channels, video_vae.spatial_compression, video_vae.temporal_compression)
    assert sizes == (4, 4, 4)
    assert video_vae.latent_size(9, 16, 16) == (3, 4, 4)
    assert video_vae.latent_size(1, 16, 16) == (1, 4, 4)
    assert not any(p.requires_grad for p in video_vae.parameters())


@pytest.mark.parametrize("frames", [9, 1])
def test_3d_vae_shapes_and_determinism(video_vae, frames):
    video = _video(2, frames)
    latents = video_vae.encode(video)
    assert latents.shape == (2, 4, *video_vae.latent_size(frames, 16, 16))
    assert torch.equal(latents, video_vae.encode(video))
    decoded = video_vae.decode(latents)
    assert decoded.shape == video.shape
    assert decoded.abs().max() <= 1.0


def test_3d_vae_normalisation(video_vae):
    video = _video(1, 5)
    raw = video_vae.vae.encode(video).latent_dist.mode()
    cfg = video_vae.vae.config
    if cfg.get("latents_mean") is not None:  # Wan: per-channel statistics
        mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
        expected = (raw - mean) / std
    else:  # CogVideoX: scaling factor only
        expected = raw * 0.7
    assert torch.allclose(video_vae.encode(video), expected, atol=1e-5)


def test_3d_vae_rejects_bad_frame_count(video_vae):
    with pytest.raises(UserError, match=r"num_frames=4 .*1 \+ 4\*k"):
        video_vae.encode(_video(1, 4))


# --------------------------------------------------------------------------- VAE: errors


@pytest.mark.parametrize("path", [None, ""])
def test_build_vae_missing_path(path):
    expected = r"^vae\.path is required for vae\.kind='diffusers'.*nothing is downloaded"
    with pytest.raises(UserError, match=expected):
        build_vae("diffusers", path)


def test_build_vae_nonexistent_folder(tmp_path):
    with pytest.raises(UserError, match=r"vae\.path='.*nope' is not an existing folder"):
        build_vae("diffusers", str(tmp_path / "nope"))


def test_build_vae_folder_without_config(tmp_path, kl_dir):
    with pytest.raises(UserError, match=r"vae\.path='.*' has no config\.json"):
        build_vae("diffusers", str(tmp_path))
    # The model sits in the 'vae' subfolder, so the root alone has no config.json either.
    with pytest.raises(UserError, match=r"no config\.json"):
        build_vae("diffusers", str(kl_dir))


def test_build_vae_unknown_class(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    with pytest.raises(UserError, match=r"'UNet2DModel'.*AutoencoderKL.*vae\.kind"):
        build_vae("diffusers", str(tmp_path))


def test_build_vae_unknown_kind():
    expected = r"vae\.kind='sd' is not supported; choose one of: identity, space-to-depth, diffusers"
    with pytest.raises(UserError, match=expected):
        build_vae("sd")


def test_error_messages_are_one_line(tmp_path):
    for call in (lambda: build_vae("diffusers"), lambda: build_vae("x"),
                 lambda: build_text_encoder("transformers"), lambda: build_text_encoder("x"),
                 lambda: build_text_encoder("transformers", str(tmp_path))):
        with pytest.raises(UserError) as info:
            call()
        assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- text: toy


CAPTIONS = ["a red circle moving left", "a blue square moving up"]


def test_toy_encoder_shapes_mask_and_buffers():
    encoder = build_text_encoder("toy", dim=32)
    assert isinstance(encoder, ToyTextEncoder)
    assert (encoder.dim, encoder.max_length) == (32, 8)
    assert list(encoder.parameters()) == []
    assert {name for name, _ in encoder.named_buffers()} == {"token_table", "position_table"}
    emb, mask = encoder.encode(CAPTIONS + ["A Green Triangle!", ""])
    assert emb.shape == (4, 8, 32) and emb.dtype == torch.float32
    assert mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [5, 5, 3, 0]
    assert torch.all(emb[~mask] == 0)
    norms = encoder.token_table.norm(dim=1)
    assert torch.allclose(norms, torch.ones_like(norms))


@pytest.mark.parametrize("audio_dim", [None, 16, 100])
def test_toy_encoder_gives_the_audio_stream_its_text_at_its_width(audio_dim):
    encoder = ToyTextEncoder(dim=32, audio_dim=audio_dim)
    video, audio, mask = encoder.encode_streams(CAPTIONS)
    assert torch.equal(video, encoder.encode(CAPTIONS)[0]) and torch.equal(mask, encoder.encode(CAPTIONS)[1])
    assert audio.shape == (*video.shape[:2], audio_dim or 32)
    assert torch.equal(audio[..., :min(audio_dim or 32, 32)], video[..., :min(audio_dim or 32, 32)])
    assert not torch.allclose(audio[0], audio[1])   # the captions stay apart in the audio stream's text


def test_toy_encoder_is_reproducible_and_distinguishes_captions():
    emb_a, mask_a = ToyTextEncoder().encode(CAPTIONS)
    emb_b, mask_b = ToyTextEncoder().encode(CAPTIONS)
    assert torch.equal(emb_a, emb_b) and torch.equal(mask_a, mask_b)
    assert not torch.allclose(emb_a[0], emb_a[1])
    # Word order matters (position encodings) and another seed gives another table.
    swapped, _ = ToyTextEncoder().encode(["red a circle moving left"])
    assert not torch.allclose(swapped[0], emb_a[0])
    assert not torch.allclose(ToyTextEncoder(seed=1).encode(CAPTIONS)[0], emb_a)
    # On a GPU the trainer keeps the encoder in bf16; its features still come out float32, as
    # every encoder's do (the fp32 model of end-of-run samples takes them without autocast).
    half, _ = ToyTextEncoder().to(torch.bfloat16).encode(CAPTIONS)
    assert half.dtype == torch.float32 and torch.allclose(half, emb_a, atol=1e-2)


def test_toy_encoder_unknown_words_and_truncation():
    encoder = ToyTextEncoder(max_length=4)
    ids, mask = encoder.token_ids(["a purple circle", "a red circle moving left fast"])
    unk = encoder.vocab["<unk>"]
    assert ids[0, 1].item() == unk
    assert mask.tolist() == [[True, True, True, False], [True] * 4]
    emb, _ = encoder.encode(["zebra", "quokka"])
    assert torch.equal(emb[0], emb[1])  # both are a single <unk>


# --------------------------------------------------------------------------- text: transformers


def test_t5_encoder_loads_and_masks(t5_dir):
    encoder = build_text_encoder("transformers", str(t5_dir), max_length=6)
    assert isinstance(encoder, HFTextEncoder)
    assert type(encoder.model).__name__ == "T5EncoderModel"
    assert (encoder.dim, encoder.max_length) == (16, 6)
    assert not any(p.requires_grad for p in encoder.parameters())
    emb, mask = encoder.encode(["a red circle", "a green square moving left up up", "zzz"])
    assert emb.shape == (3, 6, 16) and emb.dtype == torch.float32
    # Words plus the appended </s>; the long caption is truncated to max_length.
    assert mask.tolist() == [
        [True] * 4 + [False] * 2,
        [True] * 6,
        [True] * 2 + [False] * 4,
    ]
    assert torch.all(emb[~mask] == 0) and torch.all(emb[mask].abs().sum(-1) > 0)
    again, _ = encoder.encode(["a red circle", "a green square moving left up up", "zzz"])
    assert torch.equal(emb, again)


def test_automodel_text_encoder(bert_dir):
    encoder = build_text_encoder("transformers", str(bert_dir), max_length=5)
    assert type(encoder.model).__name__ == "BertModel"
    emb, mask = encoder.encode(["a red circle"])
    assert emb.shape == (1, 5, 12)
    assert mask.tolist() == [[True] * 4 + [False]]


@pytest.mark.parametrize("path", [None, ""])
def test_build_text_encoder_missing_path(path):
    expected = r"^text\.path is required for text\.kind='transformers'.*nothing is downloaded"
    with pytest.raises(UserError, match=expected):
        build_text_encoder("transformers", path)


def test_build_text_encoder_bad_folders(tmp_path):
    with pytest.raises(UserError, match=r"text\.path='.*missing' is not an existing folder"):
        build_text_encoder("transformers", str(tmp_path / "missing"))
    with pytest.raises(UserError, match=r"text\.path='.*' has no config\.json"):
        build_text_encoder("transformers", str(tmp_path))


def test_build_text_encoder_unknown_kind():
    expected = r"text\.kind='clip' is not supported; choose one of: toy, transformers"
    with pytest.raises(UserError, match=expected):
        build_text_encoder("clip")


def test_text_dtype_bf16_halves_the_weights_and_keeps_fp32_embeddings(t5_dir):
    from videodit.components import build_encoders
    from videodit.config import load_config

    cfg = load_config("tiny", ["text.kind=transformers", f"text.path={t5_dir}", "text.max_length=6", "text.dtype=bf16"])
    _, bf16 = build_encoders(cfg, torch.device("cpu"))
    fp32 = build_text_encoder("transformers", str(t5_dir), max_length=6)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    emb16, mask16 = bf16.encode(["a red circle", "zzz"])
    emb32, mask32 = fp32.encode(["a red circle", "zzz"])
    assert emb16.dtype == torch.float32 and torch.equal(mask16, mask32)
    assert torch.allclose(emb16, emb32, atol=0.05, rtol=0.05) and not torch.equal(emb16, emb32)


def test_vae_dtype_bf16_halves_the_weights_and_keeps_fp32_latents(kl_dir, kl_vae):
    from videodit.components import build_encoders
    from videodit.config import load_config

    cfg = load_config("tiny", ["vae.kind=diffusers", f"vae.path={kl_dir}", "vae.subfolder=vae", "vae.dtype=bf16"])
    bf16, _ = build_encoders(cfg, torch.device("cpu"))
    assert {p.dtype for p in bf16.vae.parameters()} == {torch.bfloat16}
    video = _video(1, 3)
    latents16, latents32 = bf16.encode(video), kl_vae.encode(video)
    assert latents16.dtype == torch.float32 and latents16.shape == latents32.shape
    assert torch.allclose(latents16, latents32, atol=0.05, rtol=0.05) and not torch.equal(latents16, latents32)
    decoded = bf16.decode(latents32)
    assert decoded.dtype == torch.float32 and torch.allclose(decoded, kl_vae.decode(latents32), atol=0.05)
