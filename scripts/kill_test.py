"""Kill a training run with SIGKILL at random moments, resume it each time, and check that
it ends with exactly the weights of an uninterrupted run.

    python scripts/kill_test.py --kills 20 --steps 80

Saves happen every step and every other kill waits for a save to begin, so about half the
kills land during a save (the output counts them). The run uses the tiny model on a small toy set with deterministic CPU settings.
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


def train_command(run: Path, toy: Path, steps: int) -> list[str]:
    overrides = {
        "data.csv": toy / "train.csv", "data.num_frames": 4, "data.frame_interval": 1, "data.height": 16, "data.width": 16,
        "model.depth": 1, "model.hidden_size": 32, "model.num_heads": 2, "model.patch_size": "[1,4,4]",
        "train.batch_size": 4, "train.max_steps": steps, "train.log_every": 1, "train.deterministic": "true",
        "train.threads": 1, "checkpoint.every_steps": 1, "checkpoint.save_total_limit": 3,
        "sample.steps": 1, "sample.prompts": "['a red circle moving right']", "resume": "auto",
        "validation.csv": "null",
    }
    return [sys.executable, "-m", "videodit", "train", "--out", str(run),
            *[f"{k}={v}" for k, v in overrides.items()]]


def final_weights(run: Path, steps: int) -> dict:
    return load_file(str(run / "checkpoints" / f"step-{steps:07d}" / "model.safetensors"))


def logged_steps(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return metrics.read_text().count("\n") if metrics.exists() else 0


def saving_now(run: Path) -> bool:
    root = run / "checkpoints"
    return root.is_dir() and any(p.name.startswith(".staging-") for p in root.iterdir())


def run_with_kills(run: Path, toy: Path, steps: int, kills: int, rng: random.Random, log=print) -> dict:
    """Start, SIGKILL after a random delay, restart, ... then let it finish."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stats = {"kills": 0, "during_save": 0, "restarts": 0}
    while True:
        proc = subprocess.Popen(train_command(run, toy, steps), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env=env)
        if stats["kills"] < kills:
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
            if proc.poll() is None:
                during_save = saving_now(run)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                stats["kills"] += 1
                stats["during_save"] += during_save
                log(f"kill {stats['kills']}: {'during a save' if during_save else 'between saves'}")
                continue
        err = proc.communicate()[1].decode()
        if proc.returncode != 0:
            raise RuntimeError(f"training exited with {proc.returncode}: {err.strip()[-2000:]}")
        done = (run / "checkpoints" / f"step-{steps:07d}").is_dir()
        if done:
            return stats
        stats["restarts"] += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from videodit.toy.make import make_toy_dataset

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_toy_dataset(tmp / "toy", clips_per_combination=1, num_frames=8, height=16, width=16)
        straight = tmp / "straight"
        subprocess.run(train_command(straight, tmp / "toy", args.steps), check=True, stdout=subprocess.DEVNULL)
        killed = tmp / "killed"
        stats = run_with_kills(killed, tmp / "toy", args.steps, args.kills, random.Random(args.seed))
        a, b = final_weights(straight, args.steps), final_weights(killed, args.steps)
        identical = a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
        events = [json.loads(line)["event"] for line in (killed / "checkpoints.jsonl").read_text().splitlines()]
        print(json.dumps({**stats, "steps": args.steps, "identical": bool(identical),
                          "saves_logged": events.count("save"), "staging_cleanups": events.count("cleanup")}))
        return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
