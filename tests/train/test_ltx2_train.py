"""LTX-2 (``model.preset=ltx2-tiny``) through the whole system on one process, on LTX's objective
(``diffusion/ltx2_objective.py``): a step's inputs are ltx-trainer's (token-shifted sigma, noise,
first frame given at p), its loss LTX's masked MSE; exact resume; a cached run equals the
on-the-fly one; ``videodit sample`` writes an mp4 with LTX's sampler, from an image too; and the
clip-size rule and the options it cannot honour fail in one line. Stand-in encoders: the identity
VAE (pixels as latents) and the toy text encoder, as wide as the tiny model (LTX-2.3 takes text as
wide as its stream)."""

import json

import av
import numpy as np
import pytest
import torch

from conftest import tiny_overrides
from videodit.cache import build_cache
from videodit.cli import main
from videodit.config import load_config
from videodit.data.video_write import write_video
from videodit.diffusion import ltx2_schedule
from videodit.errors import UserError
from videodit.sample import Pipeline
from videodit.train.trainer import Trainer

# 8x8 pixels x 4 frames: 256 tokens a clip at patch 1
LTX2 = {"model.preset": "ltx2-tiny", "model.patch_size": "[1,1,1]", "text.dim": 32, "data.height": 8,
        "data.width": 8, "diffusion.prediction": "velocity", "diffusion.loss_space": "velocity",
        "diffusion.first_frame_p": 0.5, "sample.steps": 2}


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def overrides(toy_dir, **extra):
    return tiny_overrides(toy_dir, **{**LTX2, "train.deterministic": True, **extra})


def test_a_step_is_ltx_trainers(toy_dir, tmp_path):
    """x_t, sigma, target and the first-frame choice are ``ltx2_schedule.noised`` of the batch's
    latents from the batch's generator; the model sees per-sample sigma as t and per-token sigma
    through x_mask; the loss is ``masked_mse`` over the generated tokens, averaged."""
    trainer = Trainer(load_config("tiny", overrides(toy_dir)), tmp_path / "run")
    batches = trainer.batches()
    for _ in range(3):
        batch = next(batches)
        inputs, target = trainer.prepare(batch)
        x_t, t, y, fps, x_mask = inputs
        x0 = trainer.features(batch)[0]
        want = ltx2_schedule.noised(x0, torch.Generator().manual_seed(batch.noise_seed), 0.5)
        assert torch.equal(x_t, want.x_t) and torch.equal(t, want.sigma) and torch.equal(target, want.target)
        assert torch.equal(x_mask, want.generated_frames)
        per_token = torch.where(x_mask.repeat_interleave(x0.shape[-2] * x0.shape[-1], dim=1), t[:, None], 0.0)
        assert torch.equal(per_token, want.sigma_tokens)                 # LTX's Modality.timesteps
        with torch.no_grad():
            out = trainer.model(*inputs)
            got = trainer.parallel.loss(inputs, target)
        assert torch.equal(got, ltx2_schedule.masked_mse(out, target, want.loss_mask).mean())
        if (~x_mask[:, 0]).any():
            break
    assert (~x_mask[:, 0]).any() and x_mask[:, 1:].all()   # a given first frame was drawn, and only that
    given = ~x_mask[:, 0]
    assert torch.equal(x_t[given, :, 0], x0[given, :, 0])   # clean


def test_ltx2_trains_resumes_exactly_and_samples_an_mp4(toy_dir, tmp_path, capsys):
    common = overrides(toy_dir, **{"train.max_steps": 4, "checkpoint.every_steps": 2})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    Trainer(load_config("tiny", common), straight).fit()
    Trainer(load_config("tiny", common + ["train.max_steps=2"]), resumed).fit()
    Trainer(load_config("tiny", common + ["resume=auto"]), resumed).fit()
    assert losses(resumed)[-2:] == losses(straight)[-2:]   # bitwise: the resumed run is the same run
    assert all(np.isfinite(losses(straight)))
    assert list((straight / "samples" / "step-0000004").glob("*.mp4"))   # the run's own samples

    out = tmp_path / "clip.mp4"
    assert main(["sample", "--ckpt", str(straight), "--prompt", "a red circle moving right", "--steps", "2",
                 "--out", str(out), "--device", "cpu"]) == 0
    with av.open(str(out)) as container:
        stream = container.streams.video[0]
        frames = [f for f in container.decode(stream)]
        assert (len(frames), stream.width, stream.height) == (4, 8, 8)
        assert float(stream.average_rate) == load_config("tiny", common).sample.fps   # the clip's fps

    reference = tmp_path / "ref.png"   # image-to-video: the first frame comes back as given (identity VAE)
    write_video(reference, np.full((1, 8, 8, 3), 200, dtype=np.uint8), fps=8)
    capsys.readouterr()
    clips = Pipeline(straight, device="cpu")(["a red circle moving right"], steps=2, seed=0, reference=str(reference))
    assert clips.shape == (1, 4, 8, 8, 3) and abs(float(clips[0, 0].astype(float).mean()) - 200) < 2
    assert "warning" not in capsys.readouterr().err   # it was trained with first frames given


def test_a_cached_run_equals_the_on_the_fly_run(toy_dir, tmp_path):
    common = overrides(toy_dir, **{"train.max_steps": 3})
    build_cache(load_config("tiny", common), tmp_path / "cache", dtype="fp32", shard_size=16, log=lambda *a, **k: None)
    Trainer(load_config("tiny", common), tmp_path / "fly").fit()
    Trainer(load_config("tiny", common + [f"data.cache={tmp_path / 'cache'}"]), tmp_path / "cached").fit()
    assert losses(tmp_path / "cached") == losses(tmp_path / "fly")


def test_clips_off_the_vaes_grid_fail_in_one_line_before_a_model_is_built(toy_dir, tmp_path, monkeypatch):
    """With a VAE of LTX-2's 8 x 32 x 32 grid, a 4-frame 8x8 bucket is refused (8k+1 frames, sides
    multiples of 32), naming the nearest sizes; nothing is built after the encoders."""
    import videodit.train.trainer as trainer_module

    built = []
    real = trainer_module.build_encoders

    def ltx_grid(cfg, device):
        vae, text = real(cfg, device)
        vae.temporal_compression, vae.spatial_compression = 8, 32
        return vae, text
    monkeypatch.setattr(trainer_module, "build_encoders", ltx_grid)
    monkeypatch.setattr(trainer_module, "build_model", lambda *a: built.append(1))
    with pytest.raises(UserError) as err:
        Trainer(load_config("tiny", overrides(toy_dir)), tmp_path / "run")
    message = str(err.value)
    assert "8k+1" in message and "1 or 9 frames" in message and "8 -> 32" in message and "\n" not in message
    assert not built and not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, words", [
    ({"diffusion.prediction": "data"}, "diffusion.prediction=velocity"),
    ({"diffusion.timestep_range": "[0.5, 1.0]"}, "timestep_range"),
    ({"diffusion.mask_ratios": "{'image_head': 0.5}"}, "keep one"),
    ({"model.preset": "wan-tiny", "model.depth": 2, "model.num_heads": 4, "model.patch_size": "[1,2,2]",
      "diffusion.constant_shift": 5.0}, "diffusion.mask_ratios"),
])
def test_options_ltxs_objective_cannot_honour_fail_in_one_line(toy_dir, tmp_path, extra, words):
    with pytest.raises(UserError) as err:
        Trainer(load_config("tiny", overrides(toy_dir, **extra)), tmp_path / "run")
    assert words in str(err.value) and "\n" not in str(err.value)
