"""The feature cache of a ``model.train_audio`` run (LTX-2): each clip's audio latents, its
soundtrack mask and the audio stream's caption tokens stored beside the video latents, checksummed
like them; a video-only cache refused for an audio run in one line; and a cached A/V training step
equal to the on-the-fly one bit for bit in fp32 (loss and every gradient). The tiny A/V toy of
tests/train/test_ltx2_audio_train.py."""

import json

import pytest
import torch
from safetensors import safe_open

from conftest import damage_shard
from videodit.cache import build_cache
from videodit.config import load_config
from videodit.errors import UserError
from videodit.train.trainer import Trainer

from train.test_ltx2_audio_train import TwoStreamText, audio_toy, audio_vae, overrides, two_streams  # noqa: F401


def quiet(*args, **kwargs):
    pass


@pytest.fixture
def two_stream_build(monkeypatch):
    """``cache build`` with the toy text encoder that has an audio stream (as for training)."""
    import videodit.cache as cache_module

    real = cache_module.build_encoders

    def build(cfg, device):
        vae, _ = real(cfg, device)
        return vae, TwoStreamText(dim=cfg.text.dim, max_length=cfg.text.max_length)
    monkeypatch.setattr(cache_module, "build_encoders", build)


def step(trainer):
    """One training step's loss and gradients (the first batch), without the optimiser."""
    batch = next(trainer.batches())
    inputs, target = trainer.prepare(batch)
    loss = trainer.parallel.loss(inputs, target)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.fixture
def audio_cache(audio_toy, audio_vae, two_streams, two_stream_build, tmp_path):  # noqa: F811
    cfg = load_config("tiny", overrides(audio_toy, audio_vae))
    build_cache(cfg, tmp_path / "cache", dtype="fp32", batch_size=2, log=quiet)
    return tmp_path / "cache"


def test_the_cache_holds_the_audio_latents_mask_and_text_checksummed(audio_cache, audio_toy, audio_vae, tmp_path):  # noqa: F811
    manifest = json.loads((audio_cache / "manifest.json").read_text())
    assert manifest["audio"] == {"latent_channels": 1, "latent_mel_bins": 16, "text_dim": 16}
    assert manifest["encoders"]["audio"]["kind"] == "ltx2" and manifest["encoders"]["audio"]["weights"]
    with safe_open(str(audio_cache / "shards" / "shard-00000.safetensors"), "pt") as f:
        names = list(f.keys())
        audio = [f.get_tensor(n) for n in names if n.endswith(".audio")]
        masks = [f.get_tensor(n) for n in names if n.endswith(".audio_mask")]
        texts = [f.get_tensor(n) for n in names if n.endswith(".audio_text")]
    latents = [n for n in names if n.endswith(".latent")]
    assert len(audio) == len(masks) == len(texts) == len(latents) > 0
    assert all(a.shape == (1, 13, 16) and a.dtype == torch.float32 for a in audio)   # 51 mel frames -> 13
    assert all(m.tolist() == [1.0] for m in masks) and all(t.shape[1] == 16 for t in texts)
    damage_shard(audio_cache, "flipped")   # the last tensors' bytes: checked by the shard's SHA-256
    trainer = Trainer(load_config("tiny", overrides(audio_toy, audio_vae, **{"data.cache": str(audio_cache)})),
                      tmp_path / "run")
    with pytest.raises(UserError) as err:
        next(trainer.batches())
    assert "damaged" in str(err.value) and "SHA-256" in str(err.value) and "\n" not in str(err.value)


def test_a_video_only_cache_is_refused_for_an_audio_run_in_one_line(audio_toy, audio_vae, two_streams, tmp_path):  # noqa: F811
    build_cache(load_config("tiny", overrides(audio_toy)), tmp_path / "cache", dtype="fp32", log=quiet)
    cfg = load_config("tiny", overrides(audio_toy, audio_vae, **{"data.cache": str(tmp_path / "cache")}))
    with pytest.raises(UserError) as err:
        Trainer(cfg, tmp_path / "run")
    assert "no audio latents" in str(err.value) and "videodit cache build" in str(err.value)
    assert "\n" not in str(err.value)


def test_an_audio_cache_trains_a_video_only_run(audio_cache, audio_toy, tmp_path):  # noqa: F811
    trainer = Trainer(load_config("tiny", overrides(audio_toy, **{"data.cache": str(audio_cache)})), tmp_path / "run")
    batch = next(trainer.batches())
    assert trainer.audio is None and batch.audio_latents is None   # the audio tensors are not read


def test_a_cached_audio_step_is_the_on_the_fly_step_bitwise(audio_cache, audio_toy, audio_vae, tmp_path):  # noqa: F811
    fly = Trainer(load_config("tiny", overrides(audio_toy, audio_vae)), tmp_path / "fly")
    cached = Trainer(load_config("tiny", overrides(audio_toy, audio_vae, **{"data.cache": str(audio_cache)})),
                     tmp_path / "cached")
    assert type(cached.audio.encoder).__name__ == "CachedAudioEncoder"   # no audio VAE built
    fly_loss, fly_grads = step(fly)
    cached_loss, cached_grads = step(cached)
    assert cached.audio.losses and torch.equal(cached.audio.losses[-1], fly.audio.losses[-1])
    assert torch.equal(cached_loss, fly_loss)
    assert fly_grads.keys() == cached_grads.keys() and any("audio" in n for n in fly_grads)
    assert all(torch.equal(cached_grads[n], fly_grads[n]) for n in fly_grads)
