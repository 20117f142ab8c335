"""Crash safety end to end: SIGKILL at random moments (some during saves), resume each time,
same final weights as an uninterrupted run; SIGTERM saves and exits cleanly."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from kill_test import run_with_kills, train_command  # noqa: E402


@pytest.mark.parametrize("objective", ["flow", "dmd2"])
def test_sigkill_during_training_and_saves_then_resume_is_exact(toy_dir, dmd2_teacher, tmp_path, objective):
    """Flow matching, and DMD2 with its second trained role (the critic) and two optimizers."""
    import random

    steps = 10
    extra = () if objective == "flow" else (
        "distill.method=dmd2", f"distill.teacher={dmd2_teacher}", "distill.generator_every=2",
        "distill.steps=[1000,500]")
    straight = tmp_path / "straight"
    subprocess.run(train_command(straight, toy_dir, steps, extra=extra), check=True, stdout=subprocess.DEVNULL)
    killed = tmp_path / "killed"
    stats = run_with_kills(killed, toy_dir, steps, kills=3, rng=random.Random(1), log=lambda _: None, extra=extra)
    assert stats["kills"] == 3 and stats["during_save"] >= 1
    for stem in ("model", "ema") + (("critic",) if objective == "dmd2" else ()):
        a = load_file(str(straight / f"checkpoints/step-{steps:07d}/{stem}.safetensors"))
        b = load_file(str(killed / f"checkpoints/step-{steps:07d}/{stem}.safetensors"))
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), stem
    # save_total_limit=3 held through all the restarts, and no staging folder is left.
    names = sorted(p.name for p in (killed / "checkpoints").iterdir())
    assert len([n for n in names if n.startswith("step-")]) <= 4 and not [n for n in names if n.startswith(".")]


def test_sigterm_finishes_the_step_saves_and_exits_cleanly(toy_dir, tmp_path):
    run = tmp_path / "run"
    command = train_command(run, toy_dir, 10_000)
    command = [c for c in command if not c.startswith("checkpoint.every_steps")] + ["checkpoint.every_steps=0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 0, out
    assert "stopping on SIGTERM" in out
    last_step = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert (run / "checkpoints" / f"step-{last_step:07d}" / "manifest.json").is_file()


def test_a_rank_killed_under_torchrun_restarts_and_resumes_exactly(toy_dir, tmp_path):
    """torchrun --max-restarts: SIGKILL one of two FSDP workers mid-run; the group restarts,
    resumes from the last complete checkpoint and ends with the uninterrupted run's weights."""
    import random

    steps = 6
    straight = tmp_path / "straight"
    subprocess.run(train_command(straight, toy_dir, steps, "fsdp"), check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    killed = tmp_path / "killed"
    stats = run_with_kills(killed, toy_dir, steps, kills=1, rng=random.Random(0), log=lambda _: None, layout="fsdp")
    assert stats["kills"] == 1
    a = load_file(str(straight / f"checkpoints/step-{steps:07d}/model.safetensors"))
    b = load_file(str(killed / f"checkpoints/step-{steps:07d}/model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    events = [json.loads(line)["event"] for line in (killed / "checkpoints.jsonl").read_text().splitlines()]
    assert "resume" in events


def test_a_resume_at_max_steps_still_applies_save_total_limit(toy_dir, tmp_path):
    """A kill between a save and its retention leaves a checkpoint too many; the resumed run,
    already at train.max_steps, saves nothing, so it must apply the limit when it starts."""
    from conftest import tiny_overrides
    from videodit.config import load_config
    from videodit.train.trainer import Trainer

    run = tmp_path / "run"
    overrides = tiny_overrides(toy_dir, **{"train.max_steps": 3, "checkpoint.every_steps": 1})
    Trainer(load_config("tiny", overrides), run).fit()   # no limit: steps 1, 2, 3 kept
    Trainer(load_config("tiny", overrides + ["checkpoint.save_total_limit=2", "resume=auto"]), run).fit()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-0000002", "step-0000003"]
