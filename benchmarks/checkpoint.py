"""Checkpoint cost on a model-sized state: save throughput, and the training-loop stall of an
async save against a synchronous one.

    python benchmarks/checkpoint.py [--preset S] [--repeats 3] [--steps 5] [--threads N] [--dir DIR]

The state is what the Trainer saves: an STDiT of the preset (3 latent and 64 caption
channels, the toy setup's), its EMA, its AdamW state after one real step (exp_avg +
exp_avg_sq, twice the model), the RNG, state.json and config.yaml.

1. Throughput: ``CheckpointManager.save`` (writes, SHA-256 of every byte, fsync of every
   file and folder, manifest, atomic rename, event log) against writing the same tensors
   raw with ``safetensors.torch.save_file`` (no hashing, no manifest), with and without an
   fsync at the end. ``os.sync()`` before each timed save; the three alternate per repeat.
2. Stall: ``--steps`` real training steps (forward, backward, AdamW) with one save after
   the first step, as a synchronous save and as ``blocking=False``; reported are how long
   ``save()`` blocks the loop and how much longer the whole loop took than the same loop
   without a save (the second includes the background write competing for the CPU).

Medians over ``--repeats``. Prints a table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from videodit.checkpoint import CheckpointManager
from videodit.checkpoint.writer import fsync_path
from videodit.components import model_geometry
from videodit.config import load_config, to_yaml
from videodit.models.stdit import STDiT


def build(preset: str):
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
                "json_state": {"step": step, "epoch": 0, "data": {"epoch": 0, "offset": step}}, "config_yaml": config_yaml}
    return model, train_step, payload


def raw_save(out: Path, payload: dict, fsync: bool) -> None:
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


def payload_bytes(payload: dict) -> int:
    total = sum(v.numel() * v.element_size() for flat in payload["tensors"].values() for v in flat.values())
    for state in payload["torch_states"].values():
        total += sum(v.numel() * v.element_size() for s in state["state"].values() for v in s.values()
                     if torch.is_tensor(v))
    return total


def timed(fn) -> float:
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="S")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="training steps per stall measurement")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads for the training steps (0: torch's default); 1 keeps the "
                             "numbers stable on a machine other jobs are using")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    began = time.perf_counter()

    model, train_step, payload = build(args.preset)
    params = sum(p.numel() for p in model.parameters())
    size = payload_bytes(payload(0))
    print(f"preset {args.preset}: {params / 1e6:.1f} M parameters; checkpoint tensors {size / 1e9:.2f} GB "
          f"(model + EMA + AdamW); torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs", flush=True)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        # ------------------------------------------------------------ throughput
        # One untimed round first: the first write of a fresh process/VM pays for mapping memory.
        times = {"raw": [], "raw_fsync": [], "manager": []}
        for r in range(-1, args.repeats):
            manager = CheckpointManager(tmp / f"run{r}")
            raw = timed(lambda: raw_save(tmp / "raw", payload(r), fsync=False))
            shutil.rmtree(tmp / "raw")
            managed = timed(lambda: manager.save(max(r, 0), **payload(r)))
            shutil.rmtree(tmp / f"run{r}")
            raw_fsync = timed(lambda: raw_save(tmp / "raw", payload(r), fsync=True))
            shutil.rmtree(tmp / "raw")
            if r >= 0:
                times["raw"].append(raw), times["manager"].append(managed), times["raw_fsync"].append(raw_fsync)
                print(f"  throughput repeat {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
                      flush=True)
        med = {k: statistics.median(v) for k, v in times.items()}

        # ------------------------------------------------------------ stall
        # One manager per mode for the whole run, as in training: async saves re-use their CPU
        # buffers from the second save on; the first (which allocates them) is timed apart.
        managers = {mode: CheckpointManager(tmp / f"stall-{mode}") for mode in ("sync", "async")}
        t0 = time.perf_counter()
        managers["async"].save(0, **payload(0), blocking=False)
        first_async_call = time.perf_counter() - t0
        managers["async"].wait()

        def loop(mode: str) -> tuple[float, float, float]:
            manager = managers.get(mode)
            call = 0.0
            start = time.perf_counter()
            for step in range(1, args.steps + 1):
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

        stall = {"none": [], "sync": [], "async": []}
        orders = [("none", "sync", "async"), ("async", "none", "sync"), ("sync", "async", "none")]
        for r in range(args.repeats):
            for mode in orders[r % 3]:
                os.sync()
                stall[mode].append(loop(mode))
            print(f"  stall repeat {r}: " + ", ".join(f"{m} loop {v[-1][0]:.2f} s save() {v[-1][1]:.2f} s"
                                                      for m, v in stall.items()), flush=True)

    base = statistics.median(v[0] for v in stall["none"])
    step_time = base / args.steps
    rows = {m: (statistics.median(v[1] for v in stall[m]), statistics.median(v[0] for v in stall[m]) - base,
                statistics.median(v[2] for v in stall[m])) for m in ("sync", "async")}

    gb = size / 1e9
    print()
    print(f"| save of {gb:.2f} GB ({args.preset}: model + EMA + AdamW) | seconds | GB/s | vs raw save_file |")
    print("|---|---|---|---|")
    print(f"| safetensors.torch.save_file, raw (no fsync, no hashes) | {med['raw']:.2f} | {gb / med['raw']:.2f} "
          "| 1.00 |")
    print(f"| safetensors.torch.save_file + fsync | {med['raw_fsync']:.2f} | {gb / med['raw_fsync']:.2f} | "
          f"{med['raw_fsync'] / med['raw']:.2f} |")
    print(f"| CheckpointManager.save (SHA-256, fsync, manifest, rename, log) | {med['manager']:.2f} | "
          f"{gb / med['manager']:.2f} | {med['manager'] / med['raw']:.2f} |")
    print()
    print(f"| training-loop stall ({args.steps} steps of {step_time:.2f} s, one save) | save() blocks, s "
          f"| extra loop time, s | wait() at the end, s |")
    print("|---|---|---|---|")
    for mode in ("sync", "async"):
        call, extra, tail = rows[mode]
        print(f"| {'synchronous save' if mode == 'sync' else 'async save (blocking=False)'} | {call:.2f} | "
              f"{extra:.2f} | {tail:.2f} |")
    print(f"| ratio async / sync | {rows['async'][0] / rows['sync'][0]:.2f} | "
          f"{rows['async'][1] / rows['sync'][1]:.2f} | |")
    print(f"(the first async save, which allocates its CPU buffers, blocked {first_async_call:.2f} s)")
    print(f"\n(total {time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
