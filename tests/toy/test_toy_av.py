"""The toy world you can hear, end to end (issue #38): the weight-free toy audio codec
(``audio.kind=toy``) hears what the mel holds, and the ``toy-av`` preset (a tiny LTX-2 with both
streams on the toy clips with soundtracks) trains, samples its sound and is judged by
``videodit toy eval`` on the picture and the sound."""

import json

import numpy as np
import pytest
import torch

from conftest import tiny_overrides
from videodit.cli import main
from videodit.config import load_config
from videodit.data.audio import log_mel
from videodit.toy.audio import COLOUR_PITCHES, audio_pitch_correct, audio_timing_score, soundtrack
from videodit.toy.audio_codec import ToyAudioCodec
from videodit.train.trainer import Trainer


def test_the_codec_keeps_the_pitch_and_the_clicks_through_mel_tokens_and_vocoder():
    codec = ToyAudioCodec()
    hits = [0.6, 1.4]
    for colour in COLOUR_PITCHES:
        mel = log_mel(torch.from_numpy(soundtrack(colour, 2.0, hits)))[None]          # [1, 2, 201, 64]
        latents = codec.encode(mel)
        tokens = codec.tokens(latents)
        assert latents.shape == (1, 4, 51, 64) and tokens.shape == (1, 51, codec.token_width)
        assert codec.latent_frames(201) == 51 and codec.latent_size(seconds=2.0) == (50, 64)
        assert torch.equal(codec.untokens(tokens), latents)
        back = codec.decode(codec.untokens(tokens))
        assert back.shape == (1, 2, 204, 64) and torch.allclose(back[:, :, :201], mel.mean(1, keepdim=True), atol=1e-5)
        wave = codec.vocode(back)[0].numpy()
        assert wave.shape == (2, 204 * 160) and np.abs(wave).max() <= 1
        assert audio_pitch_correct(wave, codec.output_sample_rate, colour), colour
        assert audio_timing_score(wave, codec.output_sample_rate, hits, tolerance=0.05) == 1.0, colour
    silence = codec.vocode(codec.decode(codec.encode(torch.full((1, 2, 40, 64), float(np.log(1e-5))))))
    assert silence.abs().max() < 1e-3   # silence stays silent (no pitch, no click)


@pytest.fixture(scope="module")
def audio_toy(tmp_path_factory):
    from videodit.toy.make import make_toy_dataset

    out = tmp_path_factory.mktemp("toy_av")
    make_toy_dataset(out, clips_per_combination=1, num_frames=8, height=16, width=16, seed=0, audio=True)
    return out


def test_the_toy_av_preset_trains_both_streams_and_toy_eval_judges_the_sound(audio_toy, tmp_path, capsys):
    overrides = tiny_overrides(audio_toy, **{"model.patch_size": "null", "model.hidden_size": 32, "text.dim": 32,
                                             "train.max_steps": 2, "train.batch_size": 2, "data.num_frames": 8,
                                             "checkpoint.every_steps": 2, "sample.audio_cfg": 3.0})
    cfg = load_config("toy-av", overrides)
    assert (cfg.model.family, cfg.vae.kind, cfg.audio.kind, cfg.model.train_audio) == ("ltx2", "space-to-depth",
                                                                                         "toy", True)
    trainer = Trainer(cfg, tmp_path / "run")
    assert trainer.model.geometry.in_channels == 48 and trainer.model.geometry.audio_in_channels == 256
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "audio_loss" in row] == [1, 2]

    from videodit.sample import Pipeline
    started = Pipeline(tmp_path / "run", audio=True).soundtrack.start(["a red circle"], [0], 0, 1.0, None, "cpu")
    assert started.cfg == 3.0 and started.noise.shape == (1, 25, 256)   # sample.audio_cfg guides the audio stream
    assert main(["toy", "eval", "--ckpt", str(tmp_path / "run"), "--num-prompts", "3", "--steps", "2",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    audio = report["audio"]
    assert report["n"] == audio["n"] == 3 and 0 <= audio["pitch_accuracy"] <= 1
    assert audio["with_hit"] <= 3 and (audio["timing_f1"] is None) == (audio["with_hit"] == 0)
    assert main(["toy", "eval", "--ckpt", str(tmp_path / "run"), "--num-prompts", "2", "--steps", "2"]) == 0
    header = capsys.readouterr().out.splitlines()[1].split()
    assert header == ["group", "n", "colour", "direction", "pitch", "timing"]
