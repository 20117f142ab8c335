"""Kill a training run with SIGKILL at random moments, resume it each time, and check that
it ends with exactly the weights of an uninterrupted run.

    python scripts/kill_test.py --kills 20 --steps 80
    python scripts/kill_test.py --distributed fsdp --kills 10 --steps 40   # or: sp

Saves happen every step and every other kill waits for a save to begin, so about half the
kills land during a save (the output counts them). The run uses the tiny model on a small
toy set with deterministic CPU settings.

``--distributed LAYOUT`` runs 2 ranks under ``torchrun --max-restarts`` (gloo, CPU) and kills
one worker process at a time: torchrun restarts the group, which resumes with
``resume=auto`` from the last complete checkpoint. Restarts are allowed generously (3 per
kill) and collectives time out after a minute: should a restarted gloo group ever fail to
connect, it gives up quickly and torchrun simply tries again.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file


LAYOUTS = {"fsdp": ["parallel.dp_shard=2"], "sp": ["parallel.sp=2", "parallel.dp_shard=1"]}
TIMEOUT = ["parallel.timeout_minutes=1"]   # the tiny steps take milliseconds
RANKS = 2


def train_command(run: Path, toy: Path, steps: int, layout: str | None = None, restarts: int = 0,
                  extra: tuple[str, ...] = ()) -> list[str]:
    """The run's command line; ``extra``: more overrides (e.g. a DMD2 run's distill.*)."""
    overrides = {
        "data.csv": toy / "train.csv", "data.num_frames": 4, "data.frame_interval": 1, "data.height": 16, "data.width": 16,
        "model.depth": 1, "model.hidden_size": 32, "model.num_heads": 2, "model.patch_size": "[1,4,4]",
        "train.batch_size": 4, "train.max_steps": steps, "train.log_every": 1, "train.deterministic": "true",
        "train.threads": 1, "checkpoint.every_steps": 1, "checkpoint.save_total_limit": 3,
        "sample.steps": 1, "sample.prompts": "['a red circle moving right']", "resume": "auto",
        "validation.csv": "null",
    }
    args = ["train", "--out", str(run), *[f"{k}={v}" for k, v in overrides.items()], *extra]
    if layout is None:
        return [sys.executable, "-m", "videodit", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
            f"--max-restarts={restarts}", "-m", "videodit", *args, *LAYOUTS[layout], *TIMEOUT]


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's workers), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def final_weights(run: Path, steps: int) -> dict:
    return load_file(str(run / "checkpoints" / f"step-{steps:07d}" / "model.safetensors"))


def logged_steps(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return metrics.read_text().count("\n") if metrics.exists() else 0


def saving_now(run: Path) -> bool:
    root = run / "checkpoints"
    return root.is_dir() and any(p.name.startswith(".staging-") for p in root.iterdir())


def run_with_kills(run: Path, toy: Path, steps: int, kills: int, rng: random.Random, log=print,
                   layout: str | None = None, extra: tuple[str, ...] = ()) -> dict:
    """Start, SIGKILL after a random delay, restart, ... then let it finish. With ``layout``
    one torchrun job restarts itself: each kill hits one of its workers."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stats = {"kills": 0, "during_save": 0, "restarts": 0}   # restarts: by hand, of a run that ended early
    while True:
        errors = tempfile.TemporaryFile()   # a pipe could fill up and stall a long job
        command = train_command(run, toy, steps, layout, restarts=3 * kills + 3, extra=extra)
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors, env=env)
        while stats["kills"] < kills:
            # Kill after 1-2 more logged steps, at a random moment within the next step;
            # every other kill waits for a staging folder, i.e. lands during a save.
            target = logged_steps(run) + rng.randint(1, 2)
            aim_at_save = stats["kills"] % 2 == 1
            deadline = time.time() + 120
            while proc.poll() is None and time.time() < deadline and logged_steps(run) < target:
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.2))
            while aim_at_save and proc.poll() is None and time.time() < deadline and not saving_now(run):
                time.sleep(0.0005)
            victims = [proc.pid] if layout is None else children(proc.pid)
            if proc.poll() is not None or not victims:
                break
            during_save = saving_now(run)
            victim = rng.choice(victims)
            os.kill(victim, signal.SIGKILL)
            stats["kills"] += 1
            stats["during_save"] += during_save
            where = "" if layout is None else f" (worker {victims.index(victim)} of {len(victims)})"
            log(f"kill {stats['kills']}{where}: {'during a save' if during_save else 'between saves'}")
            if layout is None:
                proc.wait()
                break
        if layout is None and proc.poll() is not None and proc.returncode == -signal.SIGKILL:
            continue   # one process: start it again by hand
        proc.wait()
        errors.seek(0)
        err = errors.read().decode(errors="replace")
        if proc.returncode != 0:
            first = err.find("Traceback")   # the worker's own error, before torchrun's summary
            shown = err[first:first + 4000] if first >= 0 else err.strip()[-2000:]
            raise RuntimeError(f"training exited with {proc.returncode}: {shown}")
        done = (run / "checkpoints" / f"step-{steps:07d}").is_dir()
        if done:
            return stats
        stats["restarts"] += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--distributed", choices=sorted(LAYOUTS), help="2 ranks under torchrun --max-restarts")
    args = parser.parse_args()

    from videodit.toy.make import make_toy_dataset

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_toy_dataset(tmp / "toy", clips_per_combination=1, num_frames=8, height=16, width=16)
        straight = tmp / "straight"
        subprocess.run(train_command(straight, tmp / "toy", args.steps, args.distributed), check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        killed = tmp / "killed"
        started = time.time()
        stats = run_with_kills(killed, tmp / "toy", args.steps, args.kills, random.Random(args.seed),
                               layout=args.distributed)
        a, b = final_weights(straight, args.steps), final_weights(killed, args.steps)
        identical = a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
        events = [json.loads(line)["event"] for line in (killed / "checkpoints.jsonl").read_text().splitlines()]
        print(json.dumps({**stats, "layout": args.distributed or "one process", "steps": args.steps,
                          "identical": bool(identical), "saves_logged": events.count("save"),
                          "resumes_logged": events.count("resume"), "staging_cleanups": events.count("cleanup"),
                          "seconds": round(time.time() - started, 1)}))
        return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
