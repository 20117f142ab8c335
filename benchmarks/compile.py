"""Compiled (``train.compile=true``) against eager training on CPU: step times, compile time,
and whether compiling pays for the default ``videodit train``.

    python benchmarks/compile.py                      # both parts below, 10-15 minutes on 2 busy cores
    python benchmarks/compile.py --parts steps        # only the step table (--presets tiny,S)
    python benchmarks/compile.py --parts default-run  # only the real runs (--train-steps 100)
    python benchmarks/compile.py --adamw              # AdamW for-loop / foreach / fused steps instead

Everything runs on the default toy dataset (made once in a temporary folder, as ``videodit
train`` makes it) with the tiny preset's config; only ``model.preset`` and the batch size change.

``steps``: per preset, an eager Trainer and a compiled one (``videodit/parallel/compile.py``)
with the same initial weights train on one fixed batch (data loading excluded). Each does a
first step, then ``--steps`` steps, A/B interleaved so that the load of other jobs hits both
alike; medians are compared. The compiled Trainer's first step compiles its graphs (Dynamo,
AOTAutograd, inductor's C++ kernels) in an empty inductor cache, as on a new machine (*cold*);
then a third Trainer is compiled again in a fresh Dynamo state with that cache on disk, as a
later run on the same machine would (*warm*). Compile s = the first step's extra time over
the median, less eager's own first-step extra (the optimizer state it creates). CPU s/step is
this process's CPU time (all its threads): on a machine shared with other jobs it moves far
less than wall time, most of all with ``--threads 1``.

``default-run``: the default ``videodit train`` itself (tiny preset, toy data, EMA,
validation and sample videos at the end), run in a subprocess for ``--train-steps`` steps
eager, compiled with an empty inductor cache, and compiled again with that cache. Reported:
wall time of the command, its CPU time (with the compile workers'), steady step time (from
metrics.jsonl, after the first 20 steps) and the fixed cost (wall time minus steps x steady
step: start-up, compiling, validation, samples). The 1,000-step estimate is fixed cost +
1,000 x steady step. ``--threads N`` passes ``train.threads=N`` to these runs too.

Inductor's compiled kernels are cached on disk (``TORCHINDUCTOR_CACHE_DIR``, by default
``/tmp/torchinductor_$USER``); this script never touches that cache (it uses its own).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PRESETS = {"tiny": ["model.preset=tiny", "train.batch_size=32"],    # the default run's shapes
           "S": ["model.preset=S", "train.batch_size=1"]}           # 512 tokens, ~0.2 TFLOP per step
DEFAULT_RUN_STEPS = 1000
PART_NAMES = ("steps", "default-run")


def make_toy(tmp: Path) -> Path:
    """The default run's toy dataset, made as ``videodit train`` makes it; returns its folder."""
    from videodit.config import load_config
    from videodit.toy.make import ensure_toy_data

    toy = tmp / "videodit-toy"
    ensure_toy_data(load_config("tiny", [f"data.csv={toy / 'train.csv'}"]))
    return toy


def trainer_for(preset: str, toy: Path, run_dir: Path, compiled: bool, backend: str):
    from videodit.config import load_config
    from videodit.train.trainer import Trainer

    overrides = [f"data.csv={toy / 'train.csv'}", "data.make_toy_if_missing=false", "validation.csv=null",
                 *PRESETS[preset]]
    if compiled:
        overrides += ["train.compile=true", f"train.compile_backend={backend}"]
    return Trainer(load_config("tiny", overrides), run_dir)


def first_step(trainer, batch, weights) -> float:
    trainer.model.load_state_dict(weights)
    start = time.perf_counter()
    trainer.train_step([batch])
    return time.perf_counter() - start


def run_preset(preset: str, toy: Path, tmp: Path, args) -> dict:
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    from torch._inductor.utils import clear_caches

    eager = trainer_for(preset, toy, tmp / f"{preset}-eager", False, args.backend)
    weights = {k: v.clone() for k, v in eager.model.state_dict().items()}
    batch = next(eager.batches())
    first = {"eager": first_step(eager, batch, weights)}
    with temporary_cache_dir(str(tmp / f"inductor-{preset}")):   # empty: what a new machine pays
        compiled = trainer_for(preset, toy, tmp / f"{preset}-compiled", True, args.backend)
        first["compiled"] = first_step(compiled, batch, weights)
        print(f"  {preset}: first step eager {first['eager']:.1f} s, compiled (cold cache) "
              f"{first['compiled']:.1f} s", flush=True)
        times = {"eager": [], "compiled": []}
        cpu = {"eager": [], "compiled": []}
        for _ in range(args.steps):
            for name, trainer in (("eager", eager), ("compiled", compiled)):
                start, start_cpu = time.perf_counter(), time.process_time()
                trainer.train_step([batch])
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
        graphs = compiled.parallel.compile_stats.compiles
        # A later run on this machine: a fresh Dynamo state and no in-memory caches, the disk cache kept.
        del compiled
        torch._dynamo.reset()
        clear_caches()
        again = trainer_for(preset, toy, tmp / f"{preset}-again", True, args.backend)
        first["warm"] = first_step(again, batch, weights)
        print(f"  {preset}: first step compiled (warm cache) {first['warm']:.1f} s", flush=True)
        del again
        torch._dynamo.reset()
    median = {name: statistics.median(v) for name, v in times.items()}
    median_cpu = {name: statistics.median(v) for name, v in cpu.items()}
    eager_extra = first["eager"] - median["eager"]
    cold = first["compiled"] - median["compiled"] - eager_extra
    warm = first["warm"] - median["compiled"] - eager_extra
    saved = median["eager"] - median["compiled"]
    return {"preset": preset, "params": eager.num_params, "batch": len(batch), "shape": tuple(batch.video.shape[2:]),
            "eager": median["eager"], "compiled": median["compiled"], "cold": cold,
            "eager_cpu": median_cpu["eager"], "compiled_cpu": median_cpu["compiled"], "warm": warm, "graphs": graphs,
            "break_even": cold / saved if saved > 0 else float("inf")}


def steps_table(rows: list[dict], args) -> None:
    print(f"\n{torch.get_num_threads()} threads, torch {torch.__version__}, backend {args.backend}, "
          f"medians of {args.steps} interleaved steps")
    print("| preset | params | batch x (T, H, W) | eager s/step | compiled s/step | speed-up | eager CPU s/step "
          "| compiled CPU s/step | CPU speed-up | compile s, cold cache | compile s, warm cache | graphs "
          "| break-even steps (cold) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['preset']} | {r['params'] / 1e6:.2f} M | {r['batch']} x {r['shape']} | {r['eager']:.3f} | "
              f"{r['compiled']:.3f} | {r['eager'] / r['compiled']:.2f}x | {r['eager_cpu']:.3f} | "
              f"{r['compiled_cpu']:.3f} | {r['eager_cpu'] / r['compiled_cpu']:.2f}x | {r['cold']:.1f} | "
              f"{r['warm']:.1f} | {r['graphs']} | {r['break_even']:.0f} |")


# --------------------------------------------------------------------------- the default run


def default_run(tmp: Path, name: str, steps: int, extra: list[str], env: dict) -> dict:
    """``videodit train`` (the default: tiny preset, toy data) for ``steps`` steps in a subprocess."""
    out = tmp / "runs" / name
    command = [sys.executable, "-m", "videodit", "train", "--out", str(out), f"train.max_steps={steps}", *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)   # the run and its compile workers
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in records if "loss" in r}
    recompiles = max((r.get("recompiles", 0) for r in records), default=0)
    skip = 20   # the first steps: compiling (when compiled) and warming up
    steady = (times[steps] - times[skip]) / (steps - skip)
    fixed = wall - steps * steady
    print(f"  {name}: {wall:.1f} s wall, {cpu:.1f} CPU s, {steady:.3f} s/step steady, {fixed:.1f} s fixed", flush=True)
    return {"name": name, "wall": wall, "cpu": cpu, "steady": steady, "fixed": fixed, "recompiles": recompiles,
            "estimate": fixed + DEFAULT_RUN_STEPS * steady}


def default_run_table(tmp: Path, args) -> None:
    make_toy(tmp)   # made once, outside the timings
    env = {**os.environ, "VIDEODIT_TRACEBACK": "1"}
    cache = str(tmp / "inductor-default-run")
    extra = [f"train.threads={args.threads}"] if args.threads else []
    runs = [default_run(tmp, "eager", args.train_steps, extra, env),
            default_run(tmp, "compiled, cold cache", args.train_steps, [*extra, "train.compile=true"],
                        {**env, "TORCHINDUCTOR_CACHE_DIR": cache}),
            default_run(tmp, "compiled, warm cache", args.train_steps, [*extra, "train.compile=true"],
                        {**env, "TORCHINDUCTOR_CACHE_DIR": cache})]
    print(f"\n`videodit train train.max_steps={args.train_steps}{' ' + extra[0] if extra else ''}` (the default run, "
          f"shortened), torch {torch.__version__}, {os.cpu_count()} cores")
    print(f"| run | wall s | CPU s | steady s/step | fixed s | recompiles | {DEFAULT_RUN_STEPS} steps, estimated s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        print(f"| {r['name']} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['steady']:.3f} | {r['fixed']:.1f} | "
              f"{r['recompiles']} | {r['estimate']:.0f} |")
    eager = runs[0]["estimate"]
    for r in runs[1:]:
        verdict = "faster" if r["estimate"] < eager else "slower"
        print(f"{r['name']}: {r['estimate']:.0f} s against eager {eager:.0f} s for {DEFAULT_RUN_STEPS} steps: "
              f"compiling is {verdict} ({eager / r['estimate']:.2f}x)")


# --------------------------------------------------------------------------- AdamW


def adamw_table(presets: list[str], steps: int) -> None:
    """One AdamW step over each preset's parameters (random gradients), per implementation:
    the Trainer uses the fused kernel on GPUs only; this says what it would do on CPU."""
    from videodit.components import build_encoders, build_model
    from videodit.config import load_config

    print("| preset | params | for-loop ms | foreach ms | fused ms |")
    print("|---|---:|---:|---:|---:|")
    for preset in presets:
        cfg = load_config("tiny", [f"model.preset={preset}"])
        model = build_model(cfg, *build_encoders(cfg, torch.device("cpu")))
        params = list(model.parameters())
        for p in params:
            p.grad = torch.randn_like(p)
        results = {}
        for name, options in (("for-loop", dict(foreach=False)), ("foreach", dict(foreach=True)),
                              ("fused", dict(fused=True))):
            optimizer = torch.optim.AdamW(params, lr=1e-4, **options)
            optimizer.step()
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                optimizer.step()
                times.append(time.perf_counter() - start)
            results[name] = statistics.median(times) * 1e3
        print(f"| {preset} | {sum(p.numel() for p in params) / 1e6:.2f} M | {results['for-loop']:.1f} | "
              f"{results['foreach']:.1f} | {results['fused']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PART_NAMES), help=f"comma-separated: {', '.join(PART_NAMES)}")
    parser.add_argument("--presets", default="tiny,S")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per side after the first")
    parser.add_argument("--train-steps", type=int, default=100, help="steps of each default run (more than 20)")
    parser.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager", "eager"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default, as the default "
                        "run)")
    parser.add_argument("--adamw", action="store_true", help="time AdamW implementations instead")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if set(parts) - set(PART_NAMES) or args.train_steps <= 20:
        parser.error(f"--parts takes {', '.join(PART_NAMES)}; --train-steps must be more than 20")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.adamw:
        adamw_table(args.presets.split(","), args.steps)
        return
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "steps" in parts:
            toy = make_toy(tmp)
            rows = [run_preset(preset, toy, tmp, args) for preset in args.presets.split(",")]
            steps_table(rows, args)
        if "default-run" in parts:
            default_run_table(tmp, args)
    print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
