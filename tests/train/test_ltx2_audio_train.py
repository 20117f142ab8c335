"""LTX-2 training both streams (``model.train_audio``) through the trainer, on one process: a tiny
LTX-2 (``ltx2-tiny`` with 16-wide audio tokens), the tiny random audio VAE of
``audio_stand_ins.save_ltx2_audio_vae`` (LTX's 64-bin mel -> 1 channel x 16 bins) and a toy set with
soundtracks. A step's audio inputs are the audio VAE's tokens noised from the batch's generator after
the video's draws; two steps move the audio stream's weights and log ``audio_loss``; what the run
cannot do is refused in one line. The toy text encoder stands in for Gemma's two streams (its
first 16 features as the audio stream's text)."""

import json

import pytest
import torch

from conftest import TwoStreamText, tiny_overrides, two_stream_encoders
from videodit.config import load_config
from videodit.diffusion import ltx2_schedule
from videodit.errors import UserError
from videodit.models.ltx2.audio_stand_ins import save_ltx2_audio_vae
from videodit.train.trainer import Trainer

LTX2 = {"model.preset": "ltx2-tiny", "model.patch_size": "[1,1,1]", "text.dim": 32, "data.height": 8,
        "data.width": 8, "diffusion.prediction": "velocity", "diffusion.loss_space": "velocity",
        "diffusion.first_frame_p": 0.5, "sample.steps": 2, "train.deterministic": True,
        "train.batch_size": 2, "train.sample_every": 0}


@pytest.fixture(scope="module")
def audio_toy(tmp_path_factory):
    from videodit.toy.make import make_toy_dataset

    out = tmp_path_factory.mktemp("toy_audio")
    make_toy_dataset(out, clips_per_combination=1, num_frames=8, height=16, width=16, seed=0, audio=True)
    return out


@pytest.fixture(scope="module")
def audio_vae(tmp_path_factory):
    return save_ltx2_audio_vae(tmp_path_factory.mktemp("audio_vae"), base_channels=16, latent_channels=1, mel_bins=64)


@pytest.fixture
def two_streams(monkeypatch):
    import videodit.train.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "build_encoders", two_stream_encoders(trainer_module.build_encoders))


def av_settings(audio_vae=None) -> dict:
    """The tiny LTX-2's settings, training both streams on ``audio_vae`` if given (else video alone)."""
    audio = {} if audio_vae is None else {"model.train_audio": True, "audio.kind": "ltx2", "audio.path": str(audio_vae),
                                          "model.audio_channels": 16}
    return {**LTX2, **audio}


def overrides(toy_dir, audio_vae=None, **extra):
    return tiny_overrides(toy_dir, **{**av_settings(audio_vae), **extra})


def audio_weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()
            if name.startswith(("audio_", "av_ca_")) or ".audio_" in name or "video_to_audio" in name}


def test_a_step_feeds_the_audio_stream_its_tokens_sigma_and_text(audio_toy, audio_vae, two_streams, tmp_path):
    trainer = Trainer(load_config("tiny", overrides(audio_toy, audio_vae)), tmp_path / "run")
    batch = next(trainer.batches())
    assert batch.audio.shape[1:] == (2, 51, 64) and batch.audio_mask.all()   # 0.5 s of sound: 51 mel frames
    inputs, target = trainer.prepare(batch)
    x_t, t, y, fps, x_mask, context_mask, audio, audio_t, audio_context = inputs
    x0 = trainer.features(batch)[0]
    generator = torch.Generator().manual_seed(batch.noise_seed)
    video = ltx2_schedule.noised(x0, generator, 0.5)
    tokens = trainer.audio.encoder.tokens(trainer.audio.encoder.encode(batch.audio))
    want = ltx2_schedule.noised_tokens(tokens, generator)   # after the video's draws
    assert tokens.shape == (2, 13, 16) and context_mask is None
    assert torch.equal(x_t, video.x_t) and torch.equal(t, video.sigma) and torch.equal(target, video.target)
    assert torch.equal(audio, want.x_t) and torch.equal(audio_t, want.sigma)
    assert torch.equal(trainer.audio.pending[0], want.target) and trainer.audio.pending[1].all()
    assert torch.equal(audio_context, y[..., :16])
    with torch.no_grad():
        out_video, out_audio = trainer.model(*inputs)
        got = trainer.parallel.loss(inputs, target)
    total, _ = trainer.objective.joint_losses(out_video, target, x_mask, out_audio, want.target,
                                              torch.ones(2, 13, dtype=torch.bool))
    assert torch.equal(got, total.mean())


def test_two_steps_train_the_audio_stream_and_log_its_loss(audio_toy, audio_vae, two_streams, tmp_path):
    trainer = Trainer(load_config("tiny", overrides(audio_toy, audio_vae, **{"train.max_steps": 2})), tmp_path / "run")
    assert all(p.requires_grad for p in trainer.model.parameters())   # every weight trains, the audio stream's too
    before = audio_weights(trainer.model)
    calls, at_sampling = TwoStreamText.calls, []
    write = trainer.samples.write   # the end's samples hear the prompts' audio text too: count up to them
    trainer.samples.write = lambda *args, **kwargs: at_sampling.append(TwoStreamText.calls) or write(*args, **kwargs)
    trainer.fit()
    after = audio_weights(trainer.model)
    moved = [name for name in before if not torch.equal(before[name], after[name])]
    assert "audio_patchify_proj.weight" in moved and "audio_proj_out.weight" in moved
    assert any(".audio_attn1." in name for name in moved) and any("video_to_audio" in name for name in moved)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "audio_loss" in row]
    assert len(steps) == 2 and all(0 < row["audio_loss"] < row["loss"] for row in steps)
    assert at_sampling == [calls + 2]   # the audio stream's text: one call a step


def test_without_train_audio_the_audio_stream_stays_frozen(audio_toy, tmp_path):
    trainer = Trainer(load_config("tiny", overrides(audio_toy, **{"train.max_steps": 1})), tmp_path / "run")
    assert trainer.audio is None
    frozen = audio_weights(trainer.model)
    assert frozen and not any(p.requires_grad for n, p in trainer.model.named_parameters() if n in frozen)
    batch = next(trainer.batches())
    assert batch.audio is None and len(trainer.prepare(batch)[0]) == 5   # no soundtrack read, no audio inputs


@pytest.mark.parametrize("extra, words", [
    ({"model.train_audio": True}, "audio.kind=ltx2"),
    ({"model.train_audio": True, "audio.kind": "ltx2", "model.preset": "wan-tiny", "model.depth": 2,
      "model.num_heads": 4, "model.patch_size": "[1,2,2]", "diffusion.first_frame_p": 0.0}, "no audio stream"),
    ({"audio.kind": "ltx2", "model.preset": "wan-tiny", "model.depth": 2, "model.num_heads": 4,
      "model.patch_size": "[1,2,2]", "diffusion.first_frame_p": 0.0}, "audio.kind=none"),
])
def test_what_audio_training_cannot_do_fails_in_one_line(audio_toy, audio_vae, tmp_path, extra, words):
    extra = {k: str(audio_vae) if v == "AUDIO" else v for k, v in extra.items()}
    with pytest.raises(UserError) as err:
        Trainer(load_config("tiny", overrides(audio_toy, **extra)), tmp_path / "run")
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_model_of_other_audio_tokens_fails_in_one_line(audio_toy, audio_vae, two_streams, tmp_path):
    cfg = load_config("tiny", overrides(audio_toy, audio_vae, **{"model.audio_channels": 8}))
    with pytest.raises(UserError) as err:
        Trainer(cfg, tmp_path / "run")
    assert "model.audio_channels=16" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("extra, words", [({"diffusion.mask_ratios": "{'image_head': 0.5}",
                                            "diffusion.first_frame_p": 0.0}, "mask_ratios"),
                                           ({"text.kind": "transformers", "text.path": "x"}, "text.kind=transformers")])
def test_what_audio_training_does_not_run_with_fails_in_one_line(audio_toy, audio_vae, tmp_path, extra, words):
    from videodit.train.audio_stream import AudioStream

    cfg = load_config("tiny", overrides(audio_toy, audio_vae, **extra))
    text = TwoStreamText(dim=32) if cfg.text.kind == "toy" else object()   # an encoder with no audio-stream text
    with pytest.raises(UserError) as err:
        AudioStream.of(cfg, text, object(), torch.device("cpu"))
    assert words in str(err.value) and "\n" not in str(err.value)
