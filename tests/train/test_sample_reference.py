"""Image-to-video and continuation: reference frames open the clip and stay as given through
sampling; a model trained with diffusion.mask_ratios (Open-Sora's frame masks) takes them."""

import numpy as np
import pytest

from conftest import tiny_overrides
from videodit.cli import main
from videodit.data.video import read_video
from videodit.data.video_write import write_video
from videodit.sample import Pipeline


@pytest.fixture(scope="module")
def masked_run(toy_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("masked")
    overrides = tiny_overrides(toy_dir, **{"model.patch_size": "[1,2,2]", "train.max_steps": 2,
                                           "checkpoint.every_steps": 2,
                                           "diffusion.mask_ratios": "{'image_head': 0.5, 'quarter_head': 0.2}"})
    assert main(["train", "--out", str(run), *overrides]) == 0
    return run


def test_an_image_reference_opens_every_clip(masked_run, tmp_path):
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (1, 16, 16, 3), dtype=np.uint8)
    write_video(tmp_path / "ref.png", image, 8)
    clips = Pipeline(masked_run)(["a red circle moving right", "a blue square moving up"], steps=2,
                                 reference=str(tmp_path / "ref.png"))
    assert clips.shape == (2, 4, 16, 16, 3)
    # The identity VAE's latents are pixels: the given frame comes back exactly (to uint8).
    assert np.abs(clips[:, 0].astype(int) - image[0].astype(int)).max() <= 1
    assert not np.array_equal(clips[0, 1], image[0])


def test_a_clip_continues_from_the_cli_and_a_bad_reference_is_one_line(masked_run, tmp_path, capsys):
    rng = np.random.default_rng(1)
    clip = rng.integers(0, 256, (4, 16, 16, 3), dtype=np.uint8)
    write_video(tmp_path / "ref.mp4", clip, 8)
    out = tmp_path / "out.mp4"
    assert main(["sample", "--ckpt", str(masked_run), "--prompt", "a red circle moving right", "--steps", "2",
                 "--ref", str(tmp_path / "ref.mp4"), "--ref-frames", "2", "--out", str(out)]) == 0
    frames, _ = read_video(out)
    reference, _ = read_video(tmp_path / "ref.mp4")
    # mp4 is lossy: the given frames come back close to the reference, the others are new.
    assert np.abs(frames[:2].astype(int) - reference[:2].astype(int)).mean() < 12
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(masked_run), "--prompt", "x", "--ref", str(tmp_path / "nope.png"),
                 "--out", str(out)]) == 2
    assert "cannot read the reference" in capsys.readouterr().err
    assert main(["sample", "--ckpt", str(masked_run), "--prompt", "x", "--ref", str(tmp_path / "ref.mp4"),
                 "--ref-frames", "4", "--out", str(out)]) == 2
    assert "leave some to generate" in capsys.readouterr().err


def test_a_reference_on_a_model_never_trained_with_frame_masks_warns_in_one_line(masked_run, toy_dir, tmp_path,
                                                                                  capsys):
    from videodit.config import load_config
    from videodit.sample import trained_with_frame_masks

    plain = tmp_path / "plain"
    assert main(["train", "--out", str(plain), *tiny_overrides(toy_dir, **{
        "model.patch_size": "[1,2,2]", "train.max_steps": 1, "checkpoint.every_steps": 1})]) == 0
    write_video(tmp_path / "ref.png", np.zeros((1, 16, 16, 3), np.uint8), 8)
    for run, warnings in ((masked_run, 0), (plain, 1)):
        capsys.readouterr()
        assert main(["sample", "--ckpt", str(run), "--prompt", "x", "--steps", "1", "--ref", str(tmp_path / "ref.png"),
                     "--out", str(tmp_path / "out.mp4")]) == 0
        lines = [line for line in capsys.readouterr().err.splitlines() if "frame masks" in line]
        assert len(lines) == warnings
    assert lines[0].startswith("warning: ") and "diffusion.mask_ratios" in lines[0]
    # Open-Sora 1.2's weights, imported, were trained with frame masks: no warning for them.
    cfg = load_config("tiny", [])
    assert not trained_with_frame_masks(cfg) and trained_with_frame_masks(cfg, {"format": "opensora-stdit3"})
