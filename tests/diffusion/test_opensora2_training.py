"""Open-Sora 2.0's objective and conditioning inside videodit's trainer, and ``--ref`` sampling of
what it trained (mmdit-tiny on the toy data: pixels as latents, toy captions)."""

import pytest
import torch

from conftest import tiny_overrides
from videodit.config import load_config
from videodit.errors import UserError

OPENSORA2 = {"model.preset": "mmdit-tiny", "model.hidden_size": 64, "model.patch_size": "[1,2,2]", "text.dim": 32,
             "diffusion.shift_rule": "opensora2", "diffusion.sigma_min": 1e-5, "diffusion.prediction": "velocity",
             "diffusion.loss_space": "velocity", "diffusion.logit_mean": 0.0,
             "diffusion.condition_config": "{t2v: 1, i2v_head: 5, i2v_loop: 1, i2v_tail: 1}",
             "diffusion.no_i2v_ref_loss": "true", "train.max_steps": 2, "sample.steps": 2,
             "checkpoint.every_steps": 2}


def test_condition_modes_train_and_the_run_samples_from_a_reference(toy_dir, tmp_path):
    from videodit.sample import Pipeline
    from videodit.train.trainer import Trainer

    trainer = Trainer(load_config("tiny", tiny_overrides(toy_dir, **OPENSORA2)), tmp_path / "run")
    batch = next(trainer.batches())
    inputs, target = trainer.prepare(batch)
    x_t, cond = inputs[0], inputs[4]
    assert cond.shape == (x_t.shape[0], x_t.shape[1] + 1, *x_t.shape[2:])
    mask = cond[:, 0, :, 0, 0]                     # [B, T]: 1 on given frames, constant over space
    assert torch.equal(cond[:, :1], mask[:, None, :, None, None].expand_as(cond[:, :1]))
    assert ((mask == 0) | (mask == 1)).all() and mask.any()
    assert torch.equal(trainer.visual.kept_frames, mask == 0)            # i2v modes: the given frames leave the loss
    result = trainer.fit()
    assert torch.isfinite(torch.tensor(result["loss"]))

    pipeline = Pipeline(tmp_path / "run", device="cpu")
    image = tmp_path / "ref.png"
    from PIL import Image
    Image.new("RGB", (16, 16), (200, 30, 30)).save(image)
    for mode in ("i2v_head", "i2v_tail", "i2v_loop"):
        clips = pipeline(["a red circle moving right"], num_frames=4, height=16, width=16, steps=2, seed=0,
                         reference=str(image), ref_mode=mode, image_guidance=2.0)
        assert clips.shape == (1, 4, 16, 16, 3)
        given = {"i2v_head": [0], "i2v_tail": [-1], "i2v_loop": [0, -1]}[mode]
        for frame in given:                     # pixels as latents: the given frame comes back as given
            assert abs(clips[0, frame].astype(int) - [200, 30, 30]).max() <= 1
    with pytest.raises(UserError, match="reference frames"):
        pipeline(["x"], num_frames=40, height=16, width=16, steps=1, reference=str(image), ref_mode="v2v_head")
    from videodit.cli import main
    out = tmp_path / "loop.mp4"
    assert main(["sample", "--ckpt", str(tmp_path / "run"), "--prompt", "a red circle", "--steps", "1", "--ref",
                 str(image), "--ref-end", str(image), "--ref-mode", "i2v_loop", "--image-cfg", "1.5", "--out",
                 str(out), "--device", "cpu"]) == 0
    assert out.stat().st_size > 0


@pytest.mark.parametrize("extra, words", [
    ({"model.preset": "tiny", "diffusion.condition_config": "{i2v_head: 1}"}, "input channels"),
    ({"diffusion.condition_config": "{i2v_first: 1}"}, "unknown mode"),
])
def test_condition_config_is_refused_where_it_cannot_apply(toy_dir, tmp_path, extra, words):
    from videodit.train.trainer import Trainer

    with pytest.raises(UserError) as err:
        Trainer(load_config("tiny", tiny_overrides(toy_dir, **{**OPENSORA2, **extra})), tmp_path / "run")
    assert words in str(err.value) and "\n" not in str(err.value)
