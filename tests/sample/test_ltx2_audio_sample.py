"""``videodit sample`` of an LTX-2 run that trained its audio stream (``model.train_audio``): the DiT
generates the soundtrack beside the video (``ltx2_sampler.sample_av``), the audio VAE + vocoder
decode it and the mp4 carries it; ``--no-audio`` writes the video alone; a video-only run samples
as before. The tiny run is ``tests/train/test_ltx2_audio_train.py``'s (its fixtures, one step)."""

import av
import numpy as np
import pytest
import torch

from conftest import tiny_overrides
from videodit.cli import main
from videodit.config import load_config
from videodit.diffusion import ltx2_sampler
from videodit.train.trainer import Trainer

from train.test_ltx2_audio_train import TwoStreamText, audio_toy, audio_vae  # noqa: F401

LTX2 = {"model.preset": "ltx2-tiny", "model.patch_size": "[1,1,1]", "text.dim": 32, "data.height": 8,
        "data.width": 8, "diffusion.prediction": "velocity", "diffusion.loss_space": "velocity",
        "sample.steps": 2, "train.deterministic": True, "train.batch_size": 2, "train.sample_every": 0,
        "train.max_steps": 1}


@pytest.fixture(scope="module")
def two_streams():
    import videodit.components as components
    import videodit.train.trainer as trainer_module

    real = components.build_encoders

    def build(cfg, device):
        vae, _ = real(cfg, device)
        return vae, TwoStreamText(dim=cfg.text.dim, max_length=cfg.text.max_length)
    mp = pytest.MonkeyPatch()
    mp.setattr(trainer_module, "build_encoders", build)
    mp.setattr(components, "build_encoders", build)   # the Pipeline's
    yield
    mp.undo()


def train(toy, tmp_path_factory, name, audio_vae=None):
    audio = {} if audio_vae is None else {"model.train_audio": True, "audio.kind": "ltx2", "audio.path": str(audio_vae),
                                          "model.audio_channels": 16}
    run = tmp_path_factory.mktemp(name) / "run"
    Trainer(load_config("tiny", tiny_overrides(toy, **{**LTX2, **audio})), run).fit()
    return run


@pytest.fixture(scope="module")
def av_run(audio_toy, audio_vae, two_streams, tmp_path_factory):
    return train(audio_toy, tmp_path_factory, "av", audio_vae)


@pytest.fixture(scope="module")
def video_run(audio_toy, two_streams, tmp_path_factory):
    return train(audio_toy, tmp_path_factory, "video")


def streams(path):
    with av.open(str(path)) as f:
        video = f.streams.video[0]
        audio = f.streams.audio[0] if f.streams.audio else None
        frames = video.frames or sum(1 for _ in f.decode(video))
        seconds = float(video.duration * video.time_base) if video.duration else frames / float(video.average_rate)
        if audio is None:
            return seconds, None
        f.seek(0)
        samples = sum(frame.samples for frame in f.decode(audio))
        return seconds, (samples, audio.rate, audio.codec_context.frame_size or 1024)


def test_an_av_run_samples_an_mp4_with_its_soundtrack(av_run, tmp_path):
    out = tmp_path / "x.mp4"
    assert main(["sample", "--ckpt", str(av_run), "--prompt", "a red circle moving right", "--out", str(out)]) == 0
    seconds, audio = streams(out)
    assert audio is not None
    samples, rate, frame = audio
    assert abs(samples / rate - seconds) <= frame / rate, (samples, rate, seconds)


def test_no_audio_writes_the_video_alone(av_run, tmp_path):
    out = tmp_path / "x.mp4"
    assert main(["sample", "--ckpt", str(av_run), "--prompt", "a red circle", "--out", str(out), "--no-audio"]) == 0
    assert streams(out)[1] is None


def test_a_folder_of_clips_carries_soundtracks_and_a_gif_is_refused(av_run, tmp_path, capsys):
    folder = tmp_path / "clips"
    assert main(["sample", "--ckpt", str(av_run), "--prompts", str(_prompts(tmp_path)), "--out", str(folder)]) == 0
    clips = sorted(folder.glob("*.mp4"))
    assert len(clips) == 2 and all(streams(c)[1] is not None for c in clips)
    assert main(["sample", "--ckpt", str(av_run), "--prompt", "a", "--out", str(tmp_path / "x.gif")]) == 2
    assert "gif cannot hold" in capsys.readouterr().err


def _prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a red circle moving right\na blue square moving up\n")
    return path


def test_a_video_only_run_writes_a_silent_mp4_as_before(video_run, tmp_path):
    from videodit.sample import Pipeline

    out = tmp_path / "x.mp4"
    assert main(["sample", "--ckpt", str(video_run), "--prompt", "a red circle", "--out", str(out)]) == 0
    assert streams(out)[1] is None
    pipeline = Pipeline(video_run, device="cpu", audio=True)
    assert pipeline.soundtrack is None
    a = pipeline(["a red circle"], seed=3)
    b = Pipeline(video_run, device="cpu")(["a red circle"], seed=3)
    assert np.array_equal(a, b)


def test_the_joint_sampler_steps_both_streams_on_one_schedule():
    """Each stream's Euler step on the shared sigmas; with a zero audio velocity the audio's
    x0 is its own x, so it stays put, and the video matches :func:`ltx2_sampler.sample`."""
    torch.manual_seed(0)
    noise, tokens = torch.randn(1, 4, 2, 2, 2), torch.randn(1, 5, 3)
    schedule = ltx2_sampler.sigmas(3)
    seen = []

    def video_v(x, sigma_tokens, sigma):
        return 0.5 * x

    def joint(x, a, sigma_tokens, sigma):
        seen.append(float(sigma[0]))
        return video_v(x, sigma_tokens, sigma), torch.zeros_like(a)
    off = ltx2_sampler.Guidance(cfg=1.0, stg=0.0, rescale=0.0)
    x, a = ltx2_sampler.sample_av(joint, noise, tokens, schedule, off, off)
    assert seen == [float(s) for s in schedule[:-1]]
    assert torch.equal(x, ltx2_sampler.sample(video_v, noise, schedule, off))
    assert torch.allclose(a, tokens * 0 + tokens)
