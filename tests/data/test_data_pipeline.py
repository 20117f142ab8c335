"""Metadata validation, bucketed training, and training through broken files."""

import json
import shutil

import pytest
import torch

from conftest import tiny_overrides
from videodit.cli import main
from videodit.config import load_config
from videodit.data.loader import build_training_data
from videodit.data.metadata import read_metadata
from videodit.errors import UserError
from videodit.train.trainer import Trainer

HEADER = "path,text,num_frames,height,width,aspect_ratio,fps,extra\n"


def test_metadata_reports_every_bad_row_and_keeps_extra_columns(tmp_path):
    csv = tmp_path / "meta.csv"
    csv.write_text(HEADER
                   + "a.mp4,ok,16,32,32,1.0,8,x\n"
                   + ",empty path,16,32,32,1.0,8,x\n"
                   + "b.mp4,negative,-3,32,32,1.0,8,x\n"
                   + "c.mp4,nan,16,nan,32,1.0,8,x\n"
                   + "/abs/d.mp4,ok,16,32,32,1.0,8,y\n")
    meta = read_metadata(csv)
    assert meta.paths == [str(tmp_path / "a.mp4"), "/abs/d.mp4"]      # relative paths resolve to the CSV folder
    assert meta.columns["extra"] == ["x", "y"]
    assert [line for line, _ in meta.bad_rows] == [3, 4, 5]
    with pytest.raises(UserError) as info:
        read_metadata(csv, bad_rows="error")
    message = str(info.value)
    assert "3 bad row(s)" in message and "line 3: empty path" in message and "line 5: height='nan'" in message


def test_metadata_names_all_missing_columns(tmp_path):
    csv = tmp_path / "meta.csv"
    csv.write_text("path,text,fps\nx.mp4,hi,8\n")
    with pytest.raises(UserError, match="missing column\\(s\\) num_frames, height, width, aspect_ratio"):
        read_metadata(csv)


BUCKETS = "{'24px': {1: [1.0, 4], 4: [1.0, 4]}, '16px': {1: [1.0, 4], 4: [1.0, 4]}}"


def test_bucketed_training_uses_every_bucket_shape(mixed_toy, tmp_path):
    cfg = load_config("tiny", tiny_overrides(mixed_toy, **{"data.bucket_config": BUCKETS,
                                                            "train.max_steps": 12}))
    trainer = Trainer(cfg, tmp_path / "run")
    shapes = set()
    original = trainer.prepare

    def recording_prepare(batch, *args):
        shapes.add(tuple(batch.video.shape[2:]))
        return original(batch, *args)

    trainer.prepare = recording_prepare
    trainer.fit()
    assert {(1, 24, 24), (4, 24, 24), (1, 16, 16), (4, 16, 16)} <= shapes


def test_loader_pins_batches_for_gpus(toy_dir, monkeypatch):
    """On GPUs the loader hands over page-locked batches (the trainer's copies are then
    asynchronous): DataLoader's pin_memory calls ``Batch.pin_memory``, which pins the tensors."""
    cfg = load_config("tiny", tiny_overrides(toy_dir))
    assert build_training_data(cfg.data, batch_size=2, seed=0, pin_memory=True).loader.pin_memory
    data = build_training_data(cfg.data, batch_size=2, seed=0)
    assert not data.loader.pin_memory
    batch = next(iter(data.loader))
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *args: pinned.append(t) or t.clone())  # CPU torch
    out = batch.pin_memory()
    assert pinned[0] is batch.video and pinned[1] is batch.fps
    assert torch.equal(out.video, batch.video) and out.text == batch.text and out.noise_seed == batch.noise_seed


def break_files(toy, fraction=0.1):
    """Break every tenth clip of train.csv in a different way; returns the broken paths."""
    rows = (toy / "train.csv").read_text().splitlines()[1:]
    broken = []
    for i, row in enumerate(rows[:: int(1 / fraction)]):
        path = toy / row.split(",")[0]
        kind = i % 4
        if kind == 0:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])   # truncated
        elif kind == 1:
            path.write_bytes(b"")                                             # zero bytes
        elif kind == 2:
            path.write_text("this is not a video")                            # not a video
        else:
            path.unlink()                                                     # vanished
        broken.append(str(path))
    return broken


def test_training_through_ten_percent_broken_files(toy_dir, tmp_path, capsys):
    toy = tmp_path / "toy"
    shutil.copytree(toy_dir, toy)
    broken = break_files(toy)
    run = tmp_path / "run"
    overrides = tiny_overrides(toy, **{"train.max_steps": 14, "train.batch_size": 8,
                                       "data.max_bad_fraction": 0.3})
    assert main(["train", "--out", str(run), *overrides]) == 0
    out = capsys.readouterr().out
    assert "unreadable file(s)" in out
    assert len([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]) == 14
    assert any(path in out for path in broken)


def test_too_many_broken_files_stop_with_the_worst_named(toy_dir, tmp_path, capsys):
    toy = tmp_path / "toy"
    shutil.copytree(toy_dir, toy)
    broken = break_files(toy, fraction=0.5)
    overrides = tiny_overrides(toy, **{"train.max_steps": 30, "data.max_bad_fraction": 0.05})
    assert main(["train", "--out", str(tmp_path / "run"), *overrides]) == 2
    err = capsys.readouterr().err
    assert "data.max_bad_fraction=0.05" in err and any(path in err for path in broken)


def test_bad_bucket_config_fails_before_work(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "run"), "data.bucket_config={'999p': {1: [1.0, 2]}}"]) == 2
    assert "unknown resolution" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
