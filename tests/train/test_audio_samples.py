"""The trainer's own sample clips (``train/samples.py``) of an LTX-2 run that trains its audio stream
carry their soundtrack: the mp4 has an AAC track of the clip's length, TensorBoard an audio summary
beside the GIF, W&B a Video of that mp4. A video-only run's clips stay silent. The tiny run and
its fixtures are ``test_ltx2_audio_train.py``'s (the stand-in audio VAE is saved with a vocoder);
W&B is a fake module that records what the logger hands it."""

import json
import shutil
import sys
import types

import numpy as np
import pytest

from conftest import tiny_overrides
from videodit.config import load_config
from videodit.sample import slug
from videodit.train.samples import finite_or_none
from videodit.train.trainer import Trainer

from sample.test_ltx2_audio_sample import streams
from train.test_loggers import tensorboard_log
from train.test_ltx2_audio_train import LTX2, audio_toy, audio_vae, two_streams  # noqa: F401

PROMPTS = ["a red circle moving right", "a blue square moving up"]
STEMS = [f"{i:02d}-{slug(prompt)}" for i, prompt in enumerate(PROMPTS)]


@pytest.fixture
def fake_wandb(monkeypatch):
    """A ``wandb`` module whose run records each ``log`` call; offline, so no W&B check reaches out."""
    logged = []

    class Video:
        def __init__(self, path, caption=None):
            self.path, self.caption, self.audio = path, caption, streams(path)[1]   # probed as W&B would copy it

    class Run:
        id = "fake-run"

        def log(self, values, step=None):
            logged.append((step, values))

        def finish(self):
            pass

    module = types.ModuleType("wandb")
    module.Error, module.Video, module.init = type("Error", (Exception,), {}), Video, lambda **kwargs: Run()
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_DIR", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    return logged


@pytest.mark.parametrize("sound", [True, False], ids=["audio-trained", "video-only"])
def test_step_samples_carry_the_soundtrack_of_an_audio_trained_run(audio_toy, audio_vae, two_streams, fake_wandb,
                                                                   tmp_path, sound):
    audio = {"model.train_audio": True, "audio.kind": "ltx2", "audio.path": str(audio_vae),
             "model.audio_channels": 16} if sound else {}
    cfg = load_config("tiny", tiny_overrides(audio_toy, **{**LTX2, **audio, "train.max_steps": 1,
                                                          "train.loggers": "[tensorboard,jsonl,wandb]",
                                                          "sample.prompts": json.dumps(PROMPTS)}))
    run = tmp_path / "run"
    Trainer(cfg, run).fit()
    seconds = (cfg.sample.num_frames or cfg.data.num_frames) / cfg.sample.fps
    paths = [run / "samples" / "step-0000001" / f"{stem}.mp4" for stem in STEMS]
    probed = [streams(path) for path in paths]
    assert all(abs(video - seconds) < 1e-6 for video, _ in probed)
    logged = tensorboard_log(run)
    assert sorted(logged.videos) == [f"samples/{stem}" for stem in STEMS]
    [(step, videos)] = [(step, values) for step, values in fake_wandb if any(k.startswith("samples/") for k in values)]
    assert step == 1 and sorted(videos) == [f"samples/{stem}" for stem in STEMS]
    assert [videos[f"samples/{stem}"].path for stem in STEMS] == [str(path) for path in paths]
    assert [videos[f"samples/{stem}"].caption for stem in STEMS] == PROMPTS
    if not sound:   # as before: silent mp4s, no audio summary
        assert all(track is None for _, track in probed) and not logged.audios
        assert all(video.audio is None for video in videos.values())
        return
    for (video_seconds, (samples, rate, frame)), stem in zip(probed, STEMS):
        assert abs(samples / rate - video_seconds) <= frame / rate, (samples, rate, video_seconds)
        [(step, tb_rate, wav)] = logged.audios[f"samples/{stem}/audio"]
        assert step == 1 and wav.shape == (2, round(seconds * tb_rate))   # stereo, the clip's length
        assert wav.any()   # the vocoder's output, not silence
    assert all(video.audio is not None for video in videos.values())   # W&B's copy of the mp4 has the sound


def test_without_a_vocoder_the_run_goes_on_with_silent_samples(audio_toy, audio_vae, two_streams, tmp_path, capsys):
    """Training needs no vocoder: an audio VAE saved without one trains, and its sample clips are
    written without sound, saying why once."""
    encoder_only = tmp_path / "audio_vae_only"
    shutil.copytree(audio_vae / "audio_vae", encoder_only / "audio_vae")
    cfg = load_config("tiny", tiny_overrides(audio_toy, **{**LTX2, "model.train_audio": True, "audio.kind": "ltx2",
                                                          "audio.path": str(encoder_only), "model.audio_channels": 16,
                                                          "train.max_steps": 2, "train.sample_every": 1}))
    Trainer(cfg, tmp_path / "run").fit()
    clips = sorted((tmp_path / "run" / "samples").glob("step-*/*.mp4"))
    assert len(clips) == 2 and all(streams(clip)[1] is None for clip in clips)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "without sound" in line]
    assert len(warnings) == 1 and "vocoder" in warnings[0]


def test_a_soundtrack_that_is_not_finite_is_dropped_not_the_run(capsys):
    sound = (np.zeros((2, 100), np.float32), 24000)
    assert finite_or_none(sound, 0, 5) is sound
    sound[0][1, 7] = np.nan
    assert finite_or_none(sound, 1, 5) is None
    assert "sample clip 1 of step 5" in capsys.readouterr().err
