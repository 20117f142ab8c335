"""The GPU suite's parallel section: FSDP, SP, TP and PP over all GPUs, one torchrun launch of
``gpu_suite.py --worker`` per layout (the dry run: all four in one launch over 2 gloo processes)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from videodit.models.flops import train_step_flops
from videodit.parallel.distributed import init_distributed
from videodit.train.metrics import peak_tflops

from suite.report import Report, remaining, report_out_of_time
from suite.step import Step
from suite.workload import GiB, Workload, dry_workload, free_memory, precision, xl_workload

ENTRY = Path(__file__).resolve().parent.parent / "gpu_suite.py"   # the script torchrun launches


def layouts(n: int, heads: int, microbatches: int) -> dict[str, list[str]]:
    """Layouts over ``n`` GPUs: FSDP over all, SP, TP, PP=2 (1F1B, x FSDP over the rest)."""
    out = {f"fsdp={n}": [f"parallel.dp_shard={n}"]}
    if heads % n == 0:
        out[f"sp={n}"] = [f"parallel.sp={n}"]
        out[f"tp={n}"] = [f"parallel.tp={n}"]
    if n % 2 == 0:
        out[f"pp=2 x fsdp={n // 2}"] = ["parallel.pp=2", f"parallel.pp_microbatches={microbatches}"]
    return out


def section_parallel(w: Workload, report: Report, args) -> None:
    n = 2 if w.dry else (torch.cuda.device_count() if w.device.type == "cuda" else 0)
    if n < 2:
        report.skip("SP/TP/PP/FSDP step times", f"needs more than one GPU ({n} visible)")
        return
    chosen = layouts(n, w.geometry().num_heads, microbatches=2 if args.parallel_batch % 4 else 4)
    groups = [list(chosen)] if w.dry else [[name] for name in chosen]   # one launch per layout on GPUs
    rows = []
    for names in groups:
        what = "parallel " + ", ".join(names)
        if report_out_of_time(report, what, args):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.jsonl"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                       str(ENTRY), "--worker", json.dumps({k: chosen[k] for k in names}),
                       "--worker-out", str(out), "--steps", str(w.steps), "--batch", str(args.parallel_batch)]
            if w.dry:
                command.append("--dry-run")
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            try:
                result = subprocess.run(command, capture_output=True, text=True, env=env,
                                        timeout=max(60, remaining(args)))
            except subprocess.TimeoutExpired:
                report.skip(what, "timed out")
                continue
            got = {r["layout"]: r for r in map(json.loads, out.read_text().splitlines())} if out.exists() else {}
            for name in names:
                if name in got and "error" not in got[name]:
                    rows.append(got[name]["row"])
                else:
                    why = got.get(name, {}).get("error") or (result.stderr.strip().splitlines() or ["no output"])[-1]
                    report.skip(f"parallel {name}", f"failed: {why[:200]}")
    if rows:
        report.table(f"Parallel layouts over {n} {'processes (gloo)' if w.dry else 'GPUs'}, "
                     f"{w.lever_shape.label} x {w.lever_shape.frames}",
                     ["layout", "batch per step", "s/step", "model TFLOP/s per GPU", "MFU", "peak GiB (rank 0)"],
                     rows, note=f"{precision(w)}, full checkpointing, no compile; MFU per GPU = model FLOPs of the step's "
                                "samples / s / GPUs / peak.")



def worker(args) -> None:
    """Under torchrun: time each layout given in --worker; rank 0 appends one JSON line each."""
    import torch.distributed as dist

    w = dry_workload(args) if args.dry_run else xl_workload(args)
    if w.device.type == "cuda":
        w = dataclasses.replace(w, device=torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
    peak = peak_tflops(torch.cuda.get_device_name() if w.device.type == "cuda" else None, args.peak_tflops)
    for name, extra in json.loads(args.worker).items():
        record: dict = {"layout": name}
        try:
            cfg = w.config(["memory.checkpointing=full", *extra])
            ctx = init_distributed(cfg)
            if w.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            step = Step(w, cfg, ctx, w.lever_shape, args.batch, seed=ctx.dp_rank)
            _, median = step.timed(w.warmup, w.steps, barrier=dist.barrier)
            samples = args.batch * ctx.dp_size
            flops = train_step_flops(step.geometry, samples, *w.latent_shape(w.lever_shape), w.caption[1]).model
            per_gpu = flops / median / ctx.world_size / 1e12
            peak_mem = torch.cuda.max_memory_allocated() / GiB if w.device.type == "cuda" else float("nan")
            record["row"] = [name, samples, f"{median:.3f}", f"{per_gpu:.1f}",
                             f"{per_gpu / peak:.1%}" if peak else "n/a", f"{peak_mem:.1f}"]
        except Exception as exc:   # noqa: BLE001
            traceback.print_exc()
            record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        if int(os.environ.get("RANK", "0")) == 0:
            with open(args.worker_out, "a") as f:
                f.write(json.dumps(record) + "\n")
        free_memory()
    if dist.is_initialized():
        dist.destroy_process_group()

