"""Compiled (``train.compile=true``) against eager training steps on CPU, with compile time apart.

    python benchmarks/compile.py [--presets tiny,S] [--steps 10] [--backend inductor]
    python benchmarks/compile.py --adamw     # AdamW for-loop / foreach / fused steps on CPU instead

For each preset, two Trainers on the same toy data, the same initial weights and one fixed
batch (data loading excluded): eager, and with every block compiled
(``videodit/parallel/compile.py``). Each does a first step (the compiled one compiles its
graphs then: Dynamo tracing, AOTAutograd, inductor's C++ kernels), then ``--steps`` steps,
A/B interleaved so machine noise hits both alike; medians are compared.

* compile s: the compiled Trainer's first step minus its median step (what compiling cost);
* break-even: steps after which the compiled run has caught up with its compile time;
* ``default run``: the default ``videodit train`` (tiny preset, 16x16x8 clips, batch 32,
  1,000 steps) estimated as 1,000 x median step (+ compile time when compiled). Data
  loading, validation and sampling are the same either way and left out.

The tiny preset runs the default run's shapes; S runs batch 4 of the same clips (512 tokens
per sample). Inductor's compiled kernels are cached on disk (``TORCHINDUCTOR_CACHE_DIR``,
default ``/tmp/torchinductor_$USER``): the first run of a shape pays the C++ compilation,
later runs mostly load it; ``--fresh-cache`` measures the first-run cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

PRESETS = {"tiny": ["model.preset=tiny", "train.batch_size=32"],
           "S": ["model.preset=S", "train.batch_size=4"]}
DEFAULT_RUN_STEPS = 1000


def trainer_for(preset: str, toy: Path, run_dir: Path, compiled: bool, backend: str):
    from videodit.config import load_config
    from videodit.train.trainer import Trainer

    overrides = [f"data.csv={toy / 'train.csv'}", "data.make_toy_if_missing=false", "validation.csv=null",
                 "train.ema_decay=0", *PRESETS[preset]]
    if compiled:
        overrides += ["train.compile=true", f"train.compile_backend={backend}"]
    return Trainer(load_config("tiny", overrides), run_dir)


def run_preset(preset: str, toy: Path, tmp: Path, args) -> dict:
    eager = trainer_for(preset, toy, tmp / f"{preset}-eager", False, args.backend)
    compiled = trainer_for(preset, toy, tmp / f"{preset}-compiled", True, args.backend)
    compiled.model.load_state_dict(eager.model.state_dict())
    batch = next(eager.batches())
    first = {}
    for name, trainer in (("eager", eager), ("compiled", compiled)):
        start = time.perf_counter()
        trainer.train_step([batch])
        first[name] = time.perf_counter() - start
        print(f"  {preset} {name}: first step {first[name]:.1f} s", flush=True)
    times = {"eager": [], "compiled": []}
    for _ in range(args.steps):
        for name, trainer in (("eager", eager), ("compiled", compiled)):
            start = time.perf_counter()
            trainer.train_step([batch])
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(v) for name, v in times.items()}
    compile_s = first["compiled"] - median["compiled"]
    saved = median["eager"] - median["compiled"]
    stats = compiled.parallel.compile_stats
    return {"preset": preset, "params": eager.num_params, "batch": len(batch), "shape": tuple(batch.video.shape[2:]),
            "eager": median["eager"], "compiled": median["compiled"], "compile_s": compile_s,
            "graphs": stats.compiles, "break_even": compile_s / saved if saved > 0 else float("inf"),
            "default_eager": DEFAULT_RUN_STEPS * median["eager"],
            "default_compiled": DEFAULT_RUN_STEPS * median["compiled"] + compile_s}


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,S")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side after the first")
    parser.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager", "eager"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--fresh-cache", action="store_true", help="an empty inductor cache (first-run cost)")
    parser.add_argument("--adamw", action="store_true", help="time AdamW implementations instead")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.adamw:
        adamw_table(args.presets.split(","), args.steps)
        return

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.fresh_cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp / "inductor-cache")
        from videodit.toy.make import make_toy_dataset
        toy = tmp / "toy"
        make_toy_dataset(toy, clips_per_combination=1, num_frames=16, height=16, width=16, seed=0)
        rows = [run_preset(preset, toy, tmp, args) for preset in args.presets.split(",")]

    print(f"\n{torch.get_num_threads()} threads, torch {torch.__version__}, backend {args.backend}, "
          f"{args.steps} interleaved steps each, {'fresh' if args.fresh_cache else 'warm or fresh'} inductor cache")
    print("| preset | params | batch x (T, H, W) | eager s/step | compiled s/step | speed-up | compile s | graphs "
          "| break-even steps |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['preset']} | {r['params'] / 1e6:.2f} M | {r['batch']} x {r['shape']} | {r['eager']:.4f} | "
              f"{r['compiled']:.4f} | {r['eager'] / r['compiled']:.2f}x | {r['compile_s']:.1f} | {r['graphs']} | "
              f"{r['break_even']:.0f} |")
    tiny = next((r for r in rows if r["preset"] == "tiny"), None)
    if tiny:
        verdict = "faster" if tiny["default_compiled"] < tiny["default_eager"] else "slower"
        print(f"\ndefault run (tiny, {DEFAULT_RUN_STEPS} steps, model steps only): eager {tiny['default_eager']:.0f} s, "
              f"compiled {tiny['default_compiled']:.0f} s including {tiny['compile_s']:.0f} s of compiling: "
              f"compiling is {verdict}")


if __name__ == "__main__":
    main()
