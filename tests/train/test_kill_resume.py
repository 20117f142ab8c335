"""Crash safety end to end: SIGKILL at random moments (some during saves), resume each time,
same final weights and logged losses as an uninterrupted run (flow matching, DMD2, LTX-2 training
both streams); SIGTERM saves and exits cleanly."""

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
import kill_test  # noqa: E402
from kill_test import run_with_kills, train_command  # noqa: E402

from train.test_ltx2_audio_train import audio_toy, audio_vae, av_settings  # noqa: E402,F401  (the A/V case's)


# What differs from run to run of the same steps: the clock and the speed measured against it.
TIMED = {"time", "samples_per_s", "tflops", "data_wait", "mfu"}
# DMD2 logs its student's last turn at every step, critic-only steps too, from memory no checkpoint
# holds (train/dmd2.py's ``last``): resumed at a critic-only step it logs grad_norm 0 and no
# generator_loss until the student's next turn. A gap in its log, not in its training.
CARRIED = {"flow": set(), "dmd2": {"grad_norm", "generator_loss", "student_grad_norm"}, "audio": set()}
# Kills per objective: the A/V run's every start imports diffusers (its audio VAE), so it is killed
# twice, once between saves and once during one.
KILLS = {"flow": 3, "dmd2": 3, "audio": 2}
AV_WORKER = ROOT / "tests" / "parallel" / "workers" / "ltx2_audio_train_worker.py"


def launched_by(worker: Path, command=train_command):
    """``train_command`` with ``python -m videodit`` replaced by ``python WORKER`` (one process or a
    torchrun worker): a launcher that sets up what a test's monkeypatch cannot reach in a subprocess."""
    def launch(*args, **kwargs) -> list[str]:
        line = command(*args, **kwargs)
        at = line.index("videodit")
        assert line[at - 1] == "-m", line
        return line[:at - 1] + [str(worker)] + line[at + 1:]
    return launch


def logged_steps_of(run: Path, left_out: set[str] = frozenset()) -> list[dict]:
    """The training steps' rows of metrics.jsonl (not those of samples or validation), without
    timing and ``left_out``."""
    rows = (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
    return [{k: v for k, v in row.items() if k not in TIMED | left_out} for row in rows if "loss" in row]


@pytest.mark.parametrize("objective", ["flow", "dmd2", "audio"])
def test_sigkill_during_training_and_saves_then_resume_is_exact(toy_dir, tmp_path, objective, request, monkeypatch):
    """Flow matching; DMD2 with its second trained role (the critic) and two optimizers; LTX-2
    training both streams (``model.train_audio``: the audio VAE's tokens noised after the video's
    draws, ``audio_loss`` logged), launched through a worker that gives the toy text encoder the
    audio stream's text (tests/train/test_ltx2_audio_train.py's run). Every step logged, before a
    kill or after a resume, holds the uninterrupted run's numbers bitwise."""
    import random

    steps, data, command = 10, toy_dir, train_command
    extra = ()
    if objective == "dmd2":
        extra = ("distill.method=dmd2", f"distill.teacher={request.getfixturevalue('dmd2_teacher')}",
                 "distill.generator_every=2", "distill.steps=[1000,500]")
    elif objective == "audio":
        data = request.getfixturevalue("audio_toy")
        extra = tuple(f"{k}={v}" for k, v in av_settings(request.getfixturevalue("audio_vae")).items())
        command = launched_by(AV_WORKER)
        monkeypatch.setattr(kill_test, "train_command", command)   # run_with_kills' launches too
    straight = tmp_path / "straight"
    subprocess.run(command(straight, data, steps, extra=extra), check=True, stdout=subprocess.DEVNULL)
    killed = tmp_path / "killed"
    kills = KILLS[objective]
    stats = run_with_kills(killed, data, steps, kills=kills, rng=random.Random(1), log=lambda _: None, extra=extra)
    assert stats["kills"] == kills and stats["during_save"] >= 1
    for stem in ("model", "ema") + (("critic",) if objective == "dmd2" else ()):
        a = load_file(str(straight / f"checkpoints/step-{steps:07d}/{stem}.safetensors"))
        b = load_file(str(killed / f"checkpoints/step-{steps:07d}/{stem}.safetensors"))
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), stem
    if objective == "audio":
        assert any(k.startswith("audio_") for k in a) and any(".audio_attn1." in k for k in a)
    # The losses: a step logged before a kill and logged again after the resume holds the same numbers.
    want = {row["step"]: row for row in logged_steps_of(straight, CARRIED[objective])}
    got = logged_steps_of(killed, CARRIED[objective])
    assert sorted(want) == list(range(1, steps + 1)) and {row["step"] for row in got} == set(want)
    assert len(got) > steps   # some steps were logged twice: killed after logging, before their save
    for row in got:
        assert row == want[row["step"]]
    if objective == "audio":
        assert all(0 < row["audio_loss"] < row["loss"] for row in want.values())
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
