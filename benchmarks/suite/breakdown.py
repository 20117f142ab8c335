"""Where a training step's device time goes, from one profiled step: the share of the step's wall
time in matmuls, attention, elementwise/norm kernels, communication, and the idle/launch gaps
between kernels, and the kernels that take the most time.

On CUDA it reads the GPU kernels (and copies) the profiler records; on CPU (the dry run) the
self time of each aten op stands in for a kernel, so the code path runs and the shares add up,
but they describe the CPU, not a GPU."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

CATEGORIES = ("matmul", "attention", "elementwise/norm", "communication")
# Name fragments, checked in this order (attention first: flash kernels contain "gemm"-like names too).
PATTERNS = {
    "communication": ("nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                      "reducescatter", "all_to_all", "alltoall", "c10d", "gloo"),
    "attention": ("flash", "fmha", "attention", "attn", "sdpa", "scaled_dot_product"),
    "matmul": ("gemm", "cublas", "cutlass", "nvjet", "xmma", "wgmma", "aten::mm", "aten::addmm", "aten::bmm",
               "aten::baddbmm", "aten::matmul", "aten::linear", "aten::_scaled_mm", "matmul"),
}


def category(name: str) -> str:
    lower = name.lower()
    for kind, fragments in PATTERNS.items():
        if any(f in lower for f in fragments):
            return kind
    return "elementwise/norm"   # the rest: pointwise, norms, reductions, copies, fused triton kernels


@dataclass
class Breakdown:
    wall_us: float                      # the profiled step's wall time
    busy_us: dict[str, float]           # category -> kernel time
    idle_us: float                      # wall time with no kernel running (launch gaps, host work, syncs)
    top: list[tuple[str, float, int]]   # (kernel, total us, calls), most time first

    def shares(self) -> list[str]:
        return [f"{self.busy_us.get(c, 0.0) / self.wall_us:.1%}" for c in CATEGORIES] + \
            [f"{self.idle_us / self.wall_us:.1%}"]


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Time covered by at least one interval (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def profile_step(step, device: torch.device, top: int = 10) -> Breakdown:
    """Profile one call of ``step`` (a warm training step) and break its time down."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    busy: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list[float]] = defaultdict(list)
    intervals = []
    for event in prof.events():
        if cuda:
            if event.device_type != DeviceType.CUDA:
                continue
            spent = event.time_range.end - event.time_range.start
            intervals.append((event.time_range.start, event.time_range.end))
        else:   # CPU: leaf work is each op's self time (children counted once, in themselves)
            if event.device_type != DeviceType.CPU or not event.name.startswith("aten::"):
                continue
            spent = event.self_cpu_time_total
        busy[category(event.name)] += spent
        per_kernel[event.name].append(spent)
    covered = union_us(intervals) if cuda else sum(busy.values())
    ranked = sorted(((name, sum(t), len(t)) for name, t in per_kernel.items()), key=lambda r: -r[1])
    return Breakdown(wall_us, dict(busy), max(0.0, wall_us - covered), ranked[:top])
