"""A run never loses what is already on disk: refused resumes write nothing, damaged
checkpoints are never started over or replaced, one writer per run folder, non-finite
numbers never reach a checkpoint, and failed writes end in one line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import tiny_overrides
from videodit.checkpoint.manager import read_events
from videodit.cli import main


def train(run: Path, toy: Path, *extra: str, **overrides) -> int:
    return main(["train", "--out", str(run), *tiny_overrides(toy, **overrides), *extra])


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    return errors[0]


@pytest.fixture()
def run(toy_dir, tmp_path):
    """A finished 2-step run with a checkpoint at each step."""
    folder = tmp_path / "run"
    assert train(folder, toy_dir, **{"train.max_steps": 2, "checkpoint.every_steps": 1}) == 0
    return folder


def test_a_refused_resume_writes_nothing(run, toy_dir, capsys):
    before = snapshot(run)
    code = train(run, toy_dir, "resume=auto", **{"train.max_steps": 4, "train.lr": 0.01})
    assert code == 2 and "config changed" in one_error_line(capsys)
    assert snapshot(run) == before


def test_every_checkpoint_damaged_stops_and_keeps_them(run, toy_dir, tmp_path, capsys):
    for ckpt in (run / "checkpoints").iterdir():
        optimizer = ckpt / "optimizer.pt"
        optimizer.write_bytes(optimizer.read_bytes()[:100])
    before = snapshot(run)
    code = train(run, toy_dir, "resume=auto", **{"train.max_steps": 4})
    line = one_error_line(capsys)
    assert code == 2 and "every checkpoint" in line and "model.init_from" in line
    assert snapshot(run) == before

    # The intact weights are still usable: a new run starts from them.
    newest = run / "checkpoints" / "step-0000002"
    fresh = tmp_path / "fresh"
    assert train(fresh, toy_dir, f"model.init_from={newest}", **{"train.max_steps": 1}) == 0
    assert "starting from the ema weights" in capsys.readouterr().out


def test_damaged_newer_checkpoints_are_set_aside_not_replaced(run, toy_dir, capsys):
    newest = run / "checkpoints" / "step-0000002"
    weights = newest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF   # same size, wrong checksum
    weights.write_bytes(bytes(data))
    damaged = snapshot(newest)
    assert train(run, toy_dir, "resume=auto", **{"train.max_steps": 2, "checkpoint.every_steps": 1}) == 0
    aside = run / "checkpoints" / "set-aside-step-0000002"
    assert snapshot(aside) == damaged                       # kept byte for byte
    assert (run / "checkpoints" / "step-0000002" / "manifest.json").is_file()   # saved anew beside it
    assert any(e["event"] == "set_aside" for e in read_events(run))


def test_one_writer_per_run_folder(toy_dir, tmp_path, capsys):
    folder = tmp_path / "locked"
    folder.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (folder / ".lock").write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname(),
                                                  "started": "now"}))
        assert train(folder, toy_dir, **{"train.max_steps": 1}) == 2
        assert "in use by another run" in one_error_line(capsys)
        assert not (folder / "config.yaml").exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    # The holder is gone: its stale lock is taken over, and released at the end.
    assert train(folder, toy_dir, **{"train.max_steps": 1}) == 0
    assert not (folder / ".lock").exists()


def test_out_must_be_a_run_folder_or_new(toy_dir, tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert train(a_file, toy_dir) == 2 and "is a file" in one_error_line(capsys)
    users = tmp_path / "users"
    users.mkdir()
    (users / "config.yaml").write_text("my own file")
    assert train(users, toy_dir) == 2 and "not a videodit run" in one_error_line(capsys)
    assert (users / "config.yaml").read_text() == "my own file" and sorted(os.listdir(users)) == ["config.yaml"]
    nowhere = tmp_path / "nowhere"
    assert train(nowhere, toy_dir, f"resume={tmp_path / 'no-such-checkpoint'}") == 2
    one_error_line(capsys)
    assert not nowhere.exists()


def test_non_finite_numbers_never_reach_a_checkpoint(toy_dir, tmp_path, capsys):
    assert main(["config", "show", "train.lr=nan"]) == 2 and "not a finite number" in one_error_line(capsys)
    assert main(["config", "show", "diffusion.logit_std=.inf"]) == 2
    one_error_line(capsys)

    # A learning rate this large blows the weights up within a few steps.
    run = tmp_path / "explodes"
    code = train(run, toy_dir, **{"train.lr": 1e30, "train.warmup_steps": 1, "train.max_steps": 6,
                                  "checkpoint.every_steps": 1})
    assert code == 2 and "stopped without updating" in one_error_line(capsys)
    saved = list((run / "checkpoints").glob("step-*"))
    for ckpt in saved:
        for stem in ("model", "ema"):
            assert all(t.isfinite().all() for t in load_file(str(ckpt / f"{stem}.safetensors")).values())

    skipping = tmp_path / "skips"
    assert train(skipping, toy_dir, **{"train.lr": 1e30, "train.warmup_steps": 1, "train.max_steps": 6,
                                       "train.on_nonfinite": "skip"}) == 0
    records = [json.loads(line) for line in (skipping / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["skipped_steps"] > 0
    final = skipping / "checkpoints" / "step-0000006" / "model.safetensors"
    assert all(t.isfinite().all() for t in load_file(str(final)).values())


def test_a_full_disk_while_logging_saves_the_checkpoint_then_stops(run, toy_dir, capsys):
    metrics = run / "metrics.jsonl"
    metrics.unlink()
    metrics.symlink_to("/dev/full")   # every write fails with ENOSPC, as on a full disk
    code = train(run, toy_dir, "resume=auto", **{"train.max_steps": 5})
    line = one_error_line(capsys)
    assert code == 2 and "No space left" in line and "checkpoint of step 3 was saved" in line
    assert (run / "checkpoints" / "step-0000003" / "manifest.json").is_file()


def test_a_model_change_under_continue_is_one_line(run, toy_dir, capsys):
    code = train(run, toy_dir, "resume=auto", "checkpoint.on_config_change=continue",
                 **{"train.max_steps": 4, "model.hidden_size": 64})
    assert code == 2 and "model.* changed" in one_error_line(capsys)


def test_sampling_options_are_checked_before_work(run, capsys):
    with pytest.raises(SystemExit) as exit_code:
        main(["sample", "--ckpt", str(run), "--prompt", "a red circle moving right", "--num-frames", "-1"])
    assert exit_code.value.code == 2
    for bad in (["--steps", "0"], ["--cfg", "nan"]):
        with pytest.raises(SystemExit):
            main(["sample", "--ckpt", str(run), "--prompt", "x", *bad])
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(run), "--prompt", "x", "--height", "15", "--out",
                 str(run / "odd")]) == 2
    assert "even height" in one_error_line(capsys) and not (run / "odd").exists()
    assert main(["config", "show", "sample.prompts=[]"]) == 2 and "empty" in one_error_line(capsys)
