"""One fp32 CPU training step of videodit's model against a reference implementation of the same
function: the timing harness shared by ``wan_step.py`` (vs diffusers) and ``mmdit_step.py`` (vs
Open-Sora 2.0's own code).

A step is forward + MSE loss + backward + ``torch.optim.AdamW`` (lr 1e-4, weight decay 0.01,
torch's default CPU implementation), gradients set to None before the clock starts. The sides
alternate (ours, theirs, ours, ...) so machine noise hits both alike; after the warm-up steps
the median and min of the timed steps are reported with the ratio to the reference of the
medians and the median of the ratios of each step to the reference's step of the same round,
the split into forward / backward / optimizer, and the peak RSS growth during a step (before
each step glibc's ``malloc_trim(0)`` hands freed heap back to the OS and
``/proc/self/clear_refs`` resets VmHWM; the figure is VmHWM after minus VmRSS before: the
activations, gradients and optimizer temporaries of the step, approximately). The CPU time of the
process during the step (``time.process_time``) is reported too: with one intra-op thread it counts
the step's own work and not the time it waited for a core other jobs held, so on a busy machine its
ratio is the steadier one.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

# A side: (model, run(model, inputs) -> output). Inputs carry the loss's "target".
Side = tuple[torch.nn.Module, Callable[[torch.nn.Module, dict], torch.Tensor]]

try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:
    _LIBC = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each model (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each model first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (fixed)")
    parser.add_argument("--profile", action="store_true", help="also print a torch.profiler table per model")
    parser.add_argument("--profile-rows", type=int, default=20)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> bool:
    """Hand freed heap memory back to the OS (so the other model's cached blocks are not reused for
    free) and reset VmHWM to the current RSS."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def train_step(model, run, optimizer, inputs: dict) -> dict:
    """Seconds of forward (with the loss), backward and optimizer step, the loss, and the peak RSS
    growth in MiB (None where VmHWM cannot be reset)."""
    optimizer.zero_grad(set_to_none=True)
    can_reset = _reset_peak_rss()
    rss_before = _status_kb("VmRSS")
    c0, t0 = time.process_time(), time.perf_counter()
    loss = F.mse_loss(run(model, inputs), inputs["target"])
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optimizer.step()
    t3, c3 = time.perf_counter(), time.process_time()
    peak = (_status_kb("VmHWM") - rss_before) / 1024 if can_reset else None
    return {"total": t3 - t0, "cpu": c3 - c0, "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2,
            "loss": loss.item(), "rss": peak}


def forward_error(ours: Side, theirs: Side, inputs: dict) -> tuple[float, float]:
    """(max |ours - theirs| / max |theirs|, max |theirs|) of the forward outputs, eval mode, no grad."""
    (mine, run_mine), (reference, run_reference) = ours, theirs
    mine.eval(), reference.eval()
    with torch.no_grad():
        a, b = run_mine(mine, inputs), run_reference(reference, inputs)
    mine.train(), reference.train()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale, scale


def race(sides: dict[str, Side], inputs: dict, steps: int, warmup: int, profile_rows: int = 0
         ) -> dict[str, list[dict]]:
    """Interleaved training steps of every side; the records of the timed ones. ``profile_rows``:
    then a torch.profiler table of one more step of each side."""
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
                  for name, (model, _) in sides.items()}
    records = {name: [] for name in sides}
    for rep in range(warmup + steps):
        for name, (model, run) in sides.items():
            record = train_step(model, run, optimizers[name], inputs)
            if rep >= warmup:
                records[name].append(record)
        print(f"  step {rep}{' (warm-up)' if rep < warmup else ''}: " + ", ".join(
            f"{name} {records[name][-1]['total']:.3f} s" if rep >= warmup else name for name in sides), flush=True)
    if profile_rows:
        profile(sides, inputs, optimizers, profile_rows)
    return records


def print_table(records: dict[str, list[dict]], reference: str) -> None:
    """The markdown table of medians, ratios to ``reference`` and the loss agreement."""
    def med(name, key):
        return statistics.median(r[key] for r in records[name])

    print(f"\n| model | ms/step median | ms/step min | ratio to {reference} | forward ms | backward ms | AdamW ms "
          "| CPU ms/step median | CPU ratio | peak RSS delta MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = med(reference, "total")
    for name in records:
        rss = [r["rss"] for r in records[name] if r["rss"] is not None]
        rss_text = f"{statistics.median(rss):.0f}" if rss else "n/a"
        print(f"| {name} | {1000 * med(name, 'total'):.0f} | {1000 * min(r['total'] for r in records[name]):.0f} "
              f"| **{med(name, 'total') / base:.3f}** | {1000 * med(name, 'forward'):.0f} "
              f"| {1000 * med(name, 'backward'):.0f} | {1000 * med(name, 'optimizer'):.0f} "
              f"| {1000 * med(name, 'cpu'):.0f} | {med(name, 'cpu') / med(reference, 'cpu'):.3f} | {rss_text} |")
    others = [name for name in records if name != reference]
    paired = {name: statistics.median(a["total"] / b["total"] for a, b in zip(records[name], records[reference]))
              for name in others}
    loss_diff = max(abs(a["loss"] - b["loss"]) / b["loss"] for name in others
                    for a, b in zip(records[name], records[reference]))
    print(f"\nmedian of paired ratios (each step / the {reference} step of the same round): "
          + "; ".join(f"{name} {ratio:.3f}" for name, ratio in paired.items())
          + f"\nlargest loss rel. diff to {reference}: {loss_diff:.1e}")


def profile(sides: dict[str, Side], inputs: dict, optimizers: dict, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile
    for name, (model, run) in sides.items():
        optimizers[name].zero_grad(set_to_none=True)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            F.mse_loss(run(model, inputs), inputs["target"]).backward()
            optimizers[name].step()
        print(f"\n### profile: {name} (one step, top {rows} by self CPU time)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
