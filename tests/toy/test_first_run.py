"""The toy clips of the README's first command (`videodit train`: the tiny preset on the toy set)
are decoded once and read the same (issue #36), and the old default stays runnable for
benchmarks/first_run.py."""

from pathlib import Path

import numpy as np
import torch

from videodit.config import load_config
from videodit.data import dataset as dataset_module
from videodit.data.loader import build_training_data

OLD = Path(__file__).parents[2] / "benchmarks" / "first_run_old_tiny.yaml"


def test_the_old_default_is_kept_for_the_benchmark():
    """benchmarks/first_run.py times the default against the preset as it was at #36's start."""
    old = load_config(str(OLD))
    assert (old.train.max_steps, old.train.batch_size, old.train.lr, old.model.hidden_size) == (1000, 32, 1e-3, 128)
    assert old.name == "tiny-old" and old.validation.csv and len(old.sample.prompts) == 4


def test_toy_clips_are_decoded_once_and_read_the_same(toy_dir, monkeypatch):
    cfg = load_config("tiny", [f"data.csv={toy_dir / 'train.csv'}", "data.num_frames=4", "data.frame_interval=2"])
    data = build_training_data(cfg.data, batch_size=4, seed=0)
    kept = data.dataset
    assert kept.kept is not None   # the toy set is small: kept in memory
    reads = []
    real_read = dataset_module.read_video
    monkeypatch.setattr(dataset_module, "read_video", lambda *a, **k: reads.append(a[0]) or real_read(*a, **k))
    keys = [(index, epoch, 0) for epoch in range(3) for index in range(len(kept))]
    held = [kept.load(*key)["video"].clone() for key in keys]
    assert len(reads) == len(kept) == len(set(reads))   # each clip decoded once over three epochs

    fresh = dataset_module.VideoDataset(kept.meta, kept.plan, kept.frame_interval, seed=kept.seed)
    assert fresh.kept is None   # off unless the loader turns it on
    for key, video in zip(keys, held):
        assert torch.equal(fresh.load(*key)["video"], video), key   # the same frames as a fresh read
    assert len({np.asarray(v).tobytes() for v in held}) > len(kept)   # epochs draw other frame windows


def test_large_datasets_are_not_kept(toy_dir, monkeypatch):
    monkeypatch.setattr("videodit.data.loader.KEEP_DECODED_BYTES", 1000)
    cfg = load_config("tiny", [f"data.csv={toy_dir / 'train.csv'}", "data.num_frames=4"])
    assert build_training_data(cfg.data, batch_size=4, seed=0).dataset.kept is None
