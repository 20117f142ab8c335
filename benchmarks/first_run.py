"""The README's first command, old default against new: `videodit train` with the `tiny` preset as
it was before issue #36 (benchmarks/first_run_old_tiny.yaml) and as it is now, one after the other
on this machine, each followed by `videodit toy eval` of its run.

    python benchmarks/first_run.py                        # old, then new; about 30 minutes on 2 quiet cores
    python benchmarks/first_run.py --order new,old        # the other order
    python benchmarks/first_run.py --eval-seeds 0 1 2     # the toy eval with more sampling seeds
    python benchmarks/first_run.py --smoke                # 20 steps each, no eval: does it run

Each run is the first command as a new user meets it: a fresh folder (the toy dataset is generated
into it first), `python -m videodit train CONFIG --out run`, nothing else set, so the torch threads
are the config's (the old default: torch's own, one per core). Reported per run:

- wall s: the whole command, start-up and toy data generation, validation, checkpoints and the
  sample videos at the end included;
- CPU s: user + sys of the child (all its threads: os.wait4's rusage), the robust figure on a
  machine shared with other jobs;
- samples/s: training samples (steps x batch) over the wall time of the whole command, and the
  median `samples_per_s` the trainer logged (its training steps alone);
- the load average (1 min) before, during (mean of one reading every 5 s) and after the run;
- what the run left: sample videos, checkpoints, a validation loss in metrics.jsonl, TensorBoard;
- `videodit toy eval --json --steps 30 --cfg 4` of its checkpoint on all 60 prompts (held-out
  combinations included): colour and direction accuracy, overall and held-out, per sampling seed
  (the same sampler settings for both configs, whatever a preset's sample.steps).

Then the ratios new/old of wall and CPU time. `--json FILE` writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OLD = REPO / "benchmarks" / "first_run_old_tiny.yaml"


class LoadSampler:
    """The 1-minute load average, read every ``every`` seconds in a thread."""

    def __init__(self, every: float = 5.0):
        self.every, self.readings, self._stop = every, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.readings.append(os.getloadavg()[0])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def mean(self) -> float | None:
        return round(statistics.mean(self.readings), 2) if self.readings else None


def env_for_child() -> dict:
    """This environment with the repository importable (an editable install needs nothing more)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_train(name: str, config: str, work: Path, overrides: list[str]) -> dict:
    folder = work / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    run = folder / "run"
    cmd = [sys.executable, "-m", "videodit", "train", config, "--out", str(run), *overrides]
    load_before = os.getloadavg()[0]
    with open(folder / "train.log", "w") as log, LoadSampler() as load:
        start = time.perf_counter()
        child = subprocess.Popen(cmd, cwd=folder, stdout=log, stderr=subprocess.STDOUT, env=env_for_child())
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        tail = (folder / "train.log").read_text()[-3000:]
        raise SystemExit(f"{name}: `{' '.join(cmd)}` failed ({child.returncode}):\n{tail}")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "samples_per_s" in r]
    resolved = yaml_config(run / "config.yaml")
    samples = resolved["train"]["max_steps"] * resolved["train"]["batch_size"] * resolved["train"]["grad_accum"]
    return {
        "name": name, "config": config, "command": " ".join(cmd[1:]), "wall_s": round(wall, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "user_s": round(usage.ru_utime, 1),
        "sys_s": round(usage.ru_stime, 1), "max_rss_mb": round(usage.ru_maxrss / 1024),
        "train_samples": samples, "samples_per_s_end_to_end": round(samples / wall, 2),
        "samples_per_s_logged": round(statistics.median(r["samples_per_s"] for r in steps), 2) if steps else None,
        "final_loss": steps[-1]["loss"] if steps else None,
        "val_loss": next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None),
        "load_before": round(load_before, 2), "load_during": load.mean(), "load_after": round(os.getloadavg()[0], 2),
        "threads": resolved["train"]["threads"] or "torch default",
        "steps": resolved["train"]["max_steps"], "batch_size": resolved["train"]["batch_size"],
        "sample_videos": sorted(str(p.relative_to(run)) for p in (run / "samples").rglob("*.mp4")),
        "checkpoints": sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")),
        "tensorboard_files": len(list((run / "tensorboard").rglob("events.out.tfevents.*"))),
        "run": str(run),
    }


def yaml_config(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def toy_eval(run: str, seed: int, threads: int) -> dict:
    env = env_for_child()
    env["OMP_NUM_THREADS"] = str(threads)   # not timed; fewer threads waste less on a busy machine
    cmd = [sys.executable, "-m", "videodit", "toy", "eval", "--ckpt", run, "--json", "--steps", "30", "--cfg", "4",
           "--seed", str(seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"`{' '.join(cmd)}` failed:\n{out.stderr[-3000:]}")
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return {"seed": seed, "colour": report["colour_accuracy"], "direction": report["direction_accuracy"],
            "heldout_colour": report["heldout"]["colour_accuracy"],
            "heldout_direction": report["heldout"]["direction_accuracy"]}


def mean_of(evals: list[dict], key: str) -> float:
    return round(statistics.mean(e[key] for e in evals), 3)


def hardware() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} cores ({model}), {memory:.0f} GiB RAM, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default=str(OLD), help="the old default's config (default: %(default)s)")
    parser.add_argument("--new", default="tiny", help="the new default's config (default: the tiny preset)")
    parser.add_argument("--order", default="old,new", choices=("old,new", "new,old"))
    parser.add_argument("--work", default=None, help="folder for the runs (default: a new temporary one)")
    parser.add_argument("--eval-seeds", type=int, nargs="+", default=[0], help="toy eval sampling seeds")
    parser.add_argument("--eval-threads", type=int, default=1, help="torch threads of the (untimed) toy evals")
    parser.add_argument("--smoke", action="store_true", help="20 steps each, no toy eval: a quick check")
    parser.add_argument("--json", dest="json_out", help="also write the results as JSON to this file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for both runs (not for a real benchmark)")
    args = parser.parse_args()

    overrides = list(args.overrides)
    if args.smoke:
        overrides += ["train.max_steps=20", "checkpoint.every_steps=10"]
    work = Path(args.work) if args.work else Path(__import__("tempfile").mkdtemp(prefix="first_run_"))
    configs = {"old": args.old, "new": args.new}
    print(f"hardware: {hardware()}", flush=True)
    print(f"runs in {work}; load average now {os.getloadavg()}", flush=True)
    results = {}
    for name in args.order.split(","):
        print(f"{name}: videodit train {configs[name]} ...", flush=True)
        results[name] = run_train(name, configs[name], work, overrides)
        r = results[name]
        print(f"  wall {r['wall_s']} s, CPU {r['cpu_s']} s, load {r['load_before']} -> {r['load_during']} -> "
              f"{r['load_after']}, {len(r['sample_videos'])} sample videos, checkpoints {r['checkpoints']}, "
              f"val_loss {r['val_loss']}", flush=True)
    if not args.smoke:
        for name in args.order.split(","):
            results[name]["eval"] = [toy_eval(results[name]["run"], seed, args.eval_threads)
                                     for seed in args.eval_seeds]

    old, new = results["old"], results["new"]
    print()
    print("| run | steps x batch | threads | wall s | CPU s | samples/s (end to end) | samples/s (logged) | "
          "load 1-min (before / during / after) | colour | direction | held-out colour | held-out direction | "
          "samples | checkpoints | val_loss |")
    print("|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---:|")
    for name, r in (("old", old), ("new", new)):
        evals = r.get("eval")
        acc = ([mean_of(evals, k) for k in ("colour", "direction", "heldout_colour", "heldout_direction")]
               if evals else ["-"] * 4)
        print(f"| {name} (`{Path(r['config']).name}`) | {r['steps']} x {r['batch_size']} | {r['threads']} | "
              f"{r['wall_s']} | {r['cpu_s']} | {r['samples_per_s_end_to_end']} | {r['samples_per_s_logged']} | "
              f"{r['load_before']} / {r['load_during']} / {r['load_after']} | {' | '.join(map(str, acc))} | "
              f"{len(r['sample_videos'])} | {', '.join(r['checkpoints'])} | {r['val_loss'] and round(r['val_loss'], 4)} |")
    ratios = {"wall": round(new["wall_s"] / old["wall_s"], 3), "cpu": round(new["cpu_s"] / old["cpu_s"], 3)}
    print()
    print(f"new/old wall time: {ratios['wall']}   new/old CPU time: {ratios['cpu']}   (target <= 0.35)")
    if not args.smoke:
        for key in ("colour", "direction", "heldout_colour", "heldout_direction"):
            print(f"toy eval {key}: old {mean_of(old['eval'], key)}, new {mean_of(new['eval'], key)} "
                  f"({'>=' if mean_of(new['eval'], key) >= mean_of(old['eval'], key) else '<'}) "
                  f"per seed old {[e[key] for e in old['eval']]}, new {[e[key] for e in new['eval']]}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"hardware": hardware(), "results": results, "ratios": ratios},
                                                  indent=1) + "\n")


if __name__ == "__main__":
    main()
