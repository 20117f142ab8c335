"""Checkpoint cost: ``CheckpointManager.save`` against ``safetensors.torch.save_file`` + fsync
of the same tensors, at several sizes; optionally the training-loop stall of an async save.

    python benchmarks/checkpoint.py [--sizes 100,500] [--repeats 7] [--dir DIR]
    python benchmarks/checkpoint.py --stall [--preset S] [--steps 5] [--threads N]

1. Throughput (the default). For each size (MB of fp32 tensors in all) the state is what the
   Trainer saves for a model of that size: weights, EMA (``*.safetensors``) and the AdamW
   state (``optimizer.pt`` via ``torch.save``: exp_avg, exp_avg_sq, step), i.e. 4 x the
   weights, in 1024 x 1024 matrices and 1024-vectors. Compared, on the same tensors in the
   same run:
   - baseline: ``safetensors.torch.save_file`` of each file's tensors (the optimizer state
     flattened into a safetensors file), then fsync of every file and of the folder;
   - ``CheckpointManager.save``: the same files plus SHA-256 of every byte, fsync of every file
     and folder, manifest, atomic rename and the event log.
   ``os.sync()`` before each timed save; one untimed round first; the two alternate
   (A-B, B-A, ...) over ``--repeats`` rounds; what a round wrote is deleted after it (then
   ``os.sync()`` and 0.3 s of rest), never between the two. Reported: median and best of
   each, the ratio manager / baseline of both, and the CPU seconds each took (all threads).
   Then the same checkpoint is read back (from the page cache) into tensors of the same
   shapes, as a resume does, with ``LoadedCheckpoint`` (which checks every file's size and
   SHA-256 while reading it) against unchecked ``load_file`` + ``torch.load(weights_only=True)``.
2. Stall (``--stall``): ``--steps`` real training steps of an STDiT of ``--preset`` with one
   save after the first, synchronous and ``blocking=False``: how long ``save()`` blocks the
   loop and how much longer the loop took than without a save.

Prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from videodit.checkpoint import CheckpointManager, LoadedCheckpoint
from videodit.checkpoint.writer import fsync_path

WIDTH = 1024


def synthetic_state(megabytes: float, seed: int = 0) -> dict:
    """Model + EMA + AdamW state of fp32 tensors, ``megabytes`` (MB = 1e6 bytes) in all."""
    params = int(megabytes * 1e6 / 4 / 4)          # weights, EMA, exp_avg, exp_avg_sq: 4 copies
    per_block = WIDTH * WIDTH + WIDTH
    blocks = max(1, round(params / per_block))
    g = torch.Generator().manual_seed(seed)
    model = {}
    for i in range(blocks):
        model[f"blocks.{i}.weight"] = torch.randn(WIDTH, WIDTH, generator=g)
        model[f"blocks.{i}.bias"] = torch.randn(WIDTH, generator=g)
    ema = {name: t + 0.01 for name, t in model.items()}
    state = {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(t.shape, generator=g) * 1e-3,
                 "exp_avg_sq": torch.rand(t.shape, generator=g) * 1e-6} for i, t in enumerate(model.values())}
    optimizer = {"state": state, "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8,
                                                   "weight_decay": 0.0, "params": list(state)}]}
    return {"tensors": {"model": model, "ema": ema, "rng": {"torch_cpu": torch.get_rng_state()}},
            "torch_states": {"optimizer": optimizer},
            "json_state": {"step": 10, "epoch": 0, "data": {"epoch": 0, "offset": 10}},
            "config_yaml": "model:\n  preset: bench\n"}


def payload_bytes(payload: dict) -> int:
    total = sum(v.numel() * v.element_size() for flat in payload["tensors"].values() for v in flat.values())
    for state in payload["torch_states"].values():
        total += sum(v.numel() * v.element_size() for s in state["state"].values() for v in s.values()
                     if torch.is_tensor(v))
    return total


def raw_save(out: Path, payload: dict, fsync: bool = True) -> None:
    """The baseline: the same tensors with ``save_file``, then fsync of every file and the folder."""
    out.mkdir(parents=True)
    files = []
    for stem, flat in payload["tensors"].items():
        save_file(flat, str(out / f"{stem}.safetensors"))
        files.append(out / f"{stem}.safetensors")
    for stem, state in payload["torch_states"].items():
        flat = {f"{i}.{k}": v for i, s in state["state"].items() for k, v in s.items() if torch.is_tensor(v)}
        save_file(flat, str(out / f"{stem}.safetensors"))
        files.append(out / f"{stem}.safetensors")
    if fsync:
        for file in files:
            fsync_path(file)
        fsync_path(out)


def timed(fn) -> float:
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed_cpu(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, every thread)."""
    cpu = time.process_time()
    wall = timed(fn)
    return wall, time.process_time() - cpu


def throughput(sizes: list[float], repeats: int, where: Path) -> list[dict]:
    rows = []
    for megabytes in sizes:
        payload = synthetic_state(megabytes)
        size = payload_bytes(payload)
        times = {"baseline": [], "manager": []}
        cpu = {"baseline": [], "manager": []}
        for r in range(-1, repeats):   # round -1: untimed (the first writes of a process map memory)
            run, raw = where / f"run-{r}", where / f"raw-{r}"
            save = {"baseline": lambda: raw_save(raw, payload),
                    "manager": lambda: CheckpointManager(run).save(max(r, 0), **payload)}
            for name in (("baseline", "manager") if r % 2 else ("manager", "baseline")):
                t, c = timed_cpu(save[name])
                if r >= 0:
                    times[name].append(t)
                    cpu[name].append(c)
            # Deleting is kept out of the timed part: on a filesystem mounted with ``discard``
            # the freed blocks are trimmed at the next journal commit, i.e. inside the next fsync.
            shutil.rmtree(run)
            shutil.rmtree(raw)
            os.sync()
            time.sleep(0.3)
            if r >= 0:
                print(f"  {size / 1e6:.0f} MB round {r}: baseline {times['baseline'][-1]:.3f} s, "
                      f"manager {times['manager'][-1]:.3f} s", flush=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        best = {k: min(v) for k, v in times.items()}
        rows.append({"bytes": size, "median": med, "best": best, "load": load_times(payload, repeats, where),
                     "cpu": {k: statistics.median(v) for k, v in cpu.items()},
                     "ratio_median": med["manager"] / med["baseline"],
                     "ratio_best": best["manager"] / best["baseline"]})
    return rows


def load_times(payload: dict, repeats: int, where: Path) -> dict:
    """Reading the checkpoint back (from the page cache) into tensors of the same shapes, as a
    resume does: ``LoadedCheckpoint`` (every file checked against its size and SHA-256 while it
    is read) against ``load_file`` + ``torch.load(weights_only=True)`` of the same files,
    unchecked (what ``LoadedCheckpoint`` did before it checked). Medians."""
    ckpt = CheckpointManager(where / "load").save(0, **payload)
    targets = {stem: {k: torch.empty_like(v) for k, v in payload["tensors"][stem].items()} for stem in ("model", "ema")}
    moments = [torch.empty_like(s["exp_avg"]) for s in payload["torch_states"]["optimizer"]["state"].values()]

    def copy(model: dict, ema: dict, optimizer: dict) -> None:
        for stem, loaded in (("model", model), ("ema", ema)):
            for name, target in targets[stem].items():
                target.copy_(loaded[name])
        for target, state in zip(moments, optimizer["state"].values()):
            target.copy_(state["exp_avg"])
            target.copy_(state["exp_avg_sq"])

    def checked() -> None:
        loaded = LoadedCheckpoint(ckpt)
        copy(loaded.tensors("model"), loaded.tensors("ema"), loaded.torch_state("optimizer"))

    def unchecked() -> None:
        copy(load_file(ckpt / "model.safetensors"), load_file(ckpt / "ema.safetensors"),
             torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=True))

    times = {"unchecked": [], "checked": []}
    for r in range(-1, repeats):
        for name, fn in (("unchecked", unchecked), ("checked", checked)) if r % 2 else \
                (("checked", checked), ("unchecked", unchecked)):
            start = time.perf_counter()
            fn()
            if r >= 0:
                times[name].append(time.perf_counter() - start)
    shutil.rmtree(where / "load")
    return {k: statistics.median(v) for k, v in times.items()}


def print_throughput(rows: list[dict], repeats: int) -> None:
    print()
    print("| checkpoint (model + EMA + AdamW, fp32) | save_file + fsync, s (median / best) | "
          "CheckpointManager.save, s (median / best) | GB/s (manager, median) | ratio median | ratio best |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        med, best = row["median"], row["best"]
        print(f"| {row['bytes'] / 1e6:.0f} MB | {med['baseline']:.3f} / {best['baseline']:.3f} | "
              f"{med['manager']:.3f} / {best['manager']:.3f} | {row['bytes'] / 1e9 / med['manager']:.2f} | "
              f"{row['ratio_median']:.2f} | {row['ratio_best']:.2f} |")
    print(f"({repeats} alternating rounds per size; CPU = median CPU seconds of the process, all threads: "
          + ", ".join(f"{row['bytes'] / 1e6:.0f} MB: baseline {row['cpu']['baseline']:.3f}, manager "
                      f"{row['cpu']['manager']:.3f}" for row in rows) + ")")
    print()
    print("| reading it back (page cache) into the model's tensors | load_file + torch.load, unchecked, s | "
          "LoadedCheckpoint, size + SHA-256 checked, s | ratio |")
    print("|---:|---:|---:|---:|")
    for row in rows:
        load = row["load"]
        print(f"| {row['bytes'] / 1e6:.0f} MB | {load['unchecked']:.3f} | {load['checked']:.3f} | "
              f"{load['checked'] / load['unchecked']:.2f} |")


# ---------------------------------------------------------------------------- stall


def build(preset: str):
    from videodit.components import model_geometry
    from videodit.config import load_config, to_yaml
    from videodit.models.stdit.model import STDiT

    cfg = load_config("tiny", [f"model.preset={preset}"])
    torch.manual_seed(0)
    model = STDiT(model_geometry(cfg, 3, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    length = cfg.text.max_length
    batch = (torch.randn(1, 3, 1, 8, 8), torch.rand(1), torch.randn(1, length, 64),
             torch.ones(1, length, dtype=torch.bool), torch.full((1,), 8.0))

    def train_step() -> None:
        x, t, y, mask, fps = batch
        model(x, t, y, mask, fps).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step()   # creates the AdamW state
    ema = {name: p.detach().clone() for name, p in model.named_parameters()}
    config_yaml = to_yaml(cfg)

    def payload(step: int) -> dict:
        return {"tensors": {"model": model.state_dict(), "ema": ema, "rng": {"torch_cpu": torch.get_rng_state()}},
                "torch_states": {"optimizer": optimizer.state_dict()},
                "json_state": {"step": step, "epoch": 0, "data": {"epoch": 0, "offset": step}},
                "config_yaml": config_yaml}
    return model, train_step, payload


def stall(preset: str, steps: int, repeats: int, where: Path) -> None:
    model, train_step, payload = build(preset)
    params = sum(p.numel() for p in model.parameters())
    print(f"preset {preset}: {params / 1e6:.1f} M parameters; checkpoint tensors "
          f"{payload_bytes(payload(0)) / 1e9:.2f} GB", flush=True)
    # One manager per mode for the whole run, as in training: async saves re-use their CPU
    # buffers from the second save on; the first (which allocates them) is timed apart.
    managers = {mode: CheckpointManager(where / f"stall-{mode}") for mode in ("sync", "async")}
    t0 = time.perf_counter()
    managers["async"].save(0, **payload(0), blocking=False)
    first_async_call = time.perf_counter() - t0
    managers["async"].wait()

    def loop(mode: str) -> tuple[float, float, float]:
        manager = managers.get(mode)
        call = 0.0
        start = time.perf_counter()
        for step in range(1, steps + 1):
            train_step()
            if step == 1 and manager is not None:
                t0 = time.perf_counter()
                manager.save(step, **payload(step), blocking=mode == "sync")
                call = time.perf_counter() - t0
        loop_time = time.perf_counter() - start
        t0 = time.perf_counter()
        if manager is not None:
            manager.wait()
        tail = time.perf_counter() - t0
        if manager is not None:
            shutil.rmtree(manager.root / "step-0000001")
        return loop_time, call, tail

    runs = {"none": [], "sync": [], "async": []}
    orders = [("none", "sync", "async"), ("async", "none", "sync"), ("sync", "async", "none")]
    for r in range(repeats):
        for mode in orders[r % 3]:
            os.sync()
            runs[mode].append(loop(mode))
        print(f"  stall repeat {r}: " + ", ".join(f"{m} loop {v[-1][0]:.2f} s save() {v[-1][1]:.2f} s"
                                                  for m, v in runs.items()), flush=True)
    base = statistics.median(v[0] for v in runs["none"])
    rows = {m: (statistics.median(v[1] for v in runs[m]), statistics.median(v[0] for v in runs[m]) - base,
                statistics.median(v[2] for v in runs[m])) for m in ("sync", "async")}
    print()
    print(f"| training-loop stall ({steps} steps of {base / steps:.2f} s, one save) | save() blocks, s "
          "| extra loop time, s | wait() at the end, s |")
    print("|---|---|---|---|")
    for mode in ("sync", "async"):
        call, extra, tail = rows[mode]
        print(f"| {'synchronous save' if mode == 'sync' else 'async save (blocking=False)'} | {call:.2f} | "
              f"{extra:.2f} | {tail:.2f} |")
    print(f"| ratio async / sync | {rows['async'][0] / rows['sync'][0]:.2f} | "
          f"{rows['async'][1] / rows['sync'][1]:.2f} | |")
    print(f"(the first async save, which allocates its CPU buffers, blocked {first_async_call:.2f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,500", help="checkpoint sizes in MB (1e6 bytes), comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--stall", action="store_true", help="measure the training-loop stall instead")
    parser.add_argument("--preset", default="S", help="model preset of --stall")
    parser.add_argument("--steps", type=int, default=5, help="training steps per --stall measurement")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    began = time.perf_counter()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        if args.stall:
            stall(args.preset, args.steps, args.repeats, Path(tmp))
        else:
            sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
            print_throughput(throughput(sizes, args.repeats, Path(tmp)), args.repeats)
    print(f"\n(total {time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
