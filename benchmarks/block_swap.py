"""Block swapping (``memory.swap_blocks``) on CPU: the step time of a LoRA run with K blocks swapped
against the same run with every block resident, and where the difference goes.

    python benchmarks/block_swap.py [--steps 8] [--warmup 2] [--threads 1] [--checkpointing none,full]

The model is the S-sized Wan 2.1 of ``benchmarks/wan_step.py`` (dim 512, 8 heads, 6 layers, ffn
2048, text_dim 4096, patch 1x2x2), with random weights that are nothing zero, LoRA rank 16 on its
self-attention and FFN (the default targets) and the base frozen in fp32, built once and
deep-copied per setting; the batch is 2 clips of 16 x 3 x 24 x 32 latents (1,152 tokens) with
512-token contexts. Each setting is ``parallel.parallelize`` with ``memory.swap_blocks`` = 0 (every
block resident), half the blocks and all of them, for each ``--checkpointing``; one step is
forward, the rectified-flow loss, backward and AdamW over the adapters. Steps are interleaved
(resident, half, all, resident, ...) so machine noise hits every setting alike; medians after
``--warmup`` steps.

On CPU host and device are the same memory, so a swap is a memcpy from the host copy into the
weight's storage: this measures the cost of the mechanism, not of PCIe. Reported per setting:

* s/step and its ratio to resident, the median of the paired ratios (each step / the resident step
  of the same round), and the process's CPU time per step (``time.process_time``) and its ratio:
  with one intra-op thread CPU time counts the step's own work, not the time it waited for a core
  that other jobs held, so on a shared machine the CPU ratio is the steadier one;
* copies/step, MiB/step copied and copy CPU s/step: the CPU time spent inside the fetches
  themselves (timed around each one);
* beyond copies CPU s/step = CPU step - resident CPU step - copy time: what the hooks and
  bookkeeping cost on the host on top of the copies (should be ~0, within the noise);
* frozen MiB on device: the frozen weights the device holds at the swapped blocks' peak (the
  resident blocks plus at most 2 swapped ones in flight) against all of them.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from videodit.config import LoraConfig, MemoryConfig, ParallelConfig  # noqa: E402
from videodit.config.schema import DiffusionConfig  # noqa: E402
from videodit.diffusion.rectified_flow import RectifiedFlow  # noqa: E402
from videodit.models.lora import add_adapters  # noqa: E402
from videodit.models.wan.model import WanDiT, WanGeometry  # noqa: E402
from videodit.parallel.block_swap import block_swappers, frozen_tensors  # noqa: E402
from videodit.parallel.dims import ParallelDims  # noqa: E402
from videodit.parallel.distributed import DistContext  # noqa: E402
from videodit.parallel.parallelize import parallelize  # noqa: E402

SEED = 2024
GEOMETRY = WanGeometry(dim=512, ffn_dim=2048, num_heads=8, num_layers=6, text_dim=4096)
LATENT = (2, 16, 3, 24, 32)   # B, C, T, H, W
MiB = 2**20


def base_model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    model = WanDiT(GEOMETRY)
    with torch.no_grad():   # nothing zero (Wan zero-initialises its head): every adapter gets a gradient
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return add_adapters(model, LoraConfig(rank=16, targets=["self_attn.q", "self_attn.k", "self_attn.v",
                                                            "self_attn.o", "ffn.0", "ffn.2"]))


class Setting:
    def __init__(self, name: str, model, swap: int, checkpointing: str, flow: RectifiedFlow):
        self.name, self.swap = name, swap
        ctx = DistContext(ParallelDims.from_config(ParallelConfig(), 1), 0, 0, torch.device("cpu"))
        self.parallel = parallelize(model, ctx, ParallelConfig(), loss_fn=flow.loss,
                                    memory=MemoryConfig(checkpointing=checkpointing, swap_blocks=swap))
        self.model = model
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        self.copy_time = 0.0
        for swapper in block_swappers(model):   # time every fetch (the memcpy from the host copy)
            fetch = swapper._fetch

            def timed(i, fetch=fetch):
                start = time.process_time()
                fetch(i)
                self.copy_time += time.process_time() - start
            swapper._fetch = timed
        self.records: list[dict] = []

    def step(self, inputs, target) -> dict:
        copied, self.copy_time = self.copy_time, 0.0
        swapped = block_swappers(self.model)
        fetched = sum(s.stats.bytes_fetched for s in swapped)
        copies = sum(s.stats.fetches for s in swapped)
        cpu, start = time.process_time(), time.perf_counter()
        loss = self.parallel.forward_backward(inputs, target, scale=1.0, sync=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total, cpu = time.perf_counter() - start, time.process_time() - cpu
        self.copy_time, copy_time = copied, self.copy_time
        return {"total": total, "cpu": cpu, "copy": copy_time, "loss": loss,
                "bytes": sum(s.stats.bytes_fetched for s in swapped) - fetched,
                "copies": sum(s.stats.fetches for s in swapped) - copies}

    def frozen_bytes_on_device(self) -> tuple[int, int]:
        """(frozen bytes the device holds at the swapped blocks' peak, all frozen bytes of the blocks)."""
        blocks = list(self.model.blocks)
        per_block = [sum(t.numel() * t.element_size() for _, t in frozen_tensors(b)) for b in blocks]
        peak = sum(s.stats.peak_resident_bytes for s in block_swappers(self.model))
        return sum(per_block[self.swap:]) + peak, sum(per_block)


def make_inputs(flow: RectifiedFlow):
    g = torch.Generator().manual_seed(SEED)
    x0 = torch.randn(LATENT, generator=g)
    noise = torch.randn(LATENT, generator=g)
    t = torch.tensor([0.3, 0.8])
    context = torch.zeros(LATENT[0], 512, GEOMETRY.text_dim)
    for i, n in enumerate((200, 120)):
        context[i, :n] = torch.randn(n, GEOMETRY.text_dim, generator=g)
    return (flow.interpolate(x0, noise, t), t, context), flow.velocity_target(x0, noise)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per setting (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per setting first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (fixed)")
    parser.add_argument("--checkpointing", default="none,full", help="memory.checkpointing values to run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started, load_before = time.perf_counter(), os.getloadavg()
    flow = RectifiedFlow(DiffusionConfig())
    inputs, target = make_inputs(flow)
    base = base_model()
    blocks = GEOMETRY.num_layers
    print(f"Wan S-sized: dim {GEOMETRY.dim}, {GEOMETRY.num_layers} blocks, ffn {GEOMETRY.ffn_dim}, text_dim "
          f"{GEOMETRY.text_dim}; LoRA rank 16; {sum(p.numel() for p in base.parameters()):,} parameters, "
          f"{sum(p.numel() for p in base.parameters() if p.requires_grad):,} trained; latents "
          f"{' x '.join(map(str, LATENT))}; fp32; {torch.get_num_threads()} thread(s); torch {torch.__version__}",
          flush=True)
    tables = []
    for checkpointing in args.checkpointing.split(","):
        settings = [Setting(f"{swap} of {blocks} swapped" if swap else "resident", copy.deepcopy(base), swap,
                            checkpointing, flow) for swap in (0, blocks // 2, blocks)]
        for rep in range(args.warmup + args.steps):
            for s in settings:
                record = s.step(inputs, target)
                if rep >= args.warmup:
                    s.records.append(record)
            print(f"  checkpointing={checkpointing} step {rep}{' (warm-up)' if rep < args.warmup else ''}: "
                  + ", ".join(f"{s.name} {s.records[-1]['total']:.3f} s" if rep >= args.warmup else s.name
                              for s in settings), flush=True)
        losses = {tuple(r["loss"] for r in s.records) for s in settings}
        assert len(losses) == 1, "swapping changed the losses"
        resident = settings[0]
        base_step = statistics.median(r["total"] for r in resident.records)
        base_cpu = statistics.median(r["cpu"] for r in resident.records)
        rows = []
        for s in settings:
            med = lambda key, s=s: statistics.median(r[key] for r in s.records)   # noqa: E731
            paired = statistics.median(a["total"] / b["total"] for a, b in zip(s.records, resident.records))
            on_device, frozen = s.frozen_bytes_on_device()
            rows.append(f"| {checkpointing} | {s.name} | {med('total'):.3f} | {med('total') / base_step:.3f} "
                        f"| {paired:.3f} | {med('cpu'):.3f} | {med('cpu') / base_cpu:.3f} | {med('copies'):.0f} "
                        f"| {med('bytes') / MiB:.0f} | {med('copy'):.4f} | {med('cpu') - base_cpu - med('copy'):+.4f} "
                        f"| {on_device / MiB:.0f} of {frozen / MiB:.0f} |")
        tables.append(rows)
    load_after = os.getloadavg()
    print("\n| checkpointing | setting | s/step | x resident | paired x resident | CPU s/step | CPU x resident "
          "| copies/step | MiB copied/step | copy CPU s/step | beyond copies CPU s/step | frozen MiB on device |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rows in tables:
        print("\n".join(rows))
    print(f"\nlosses bitwise equal across settings; median of {args.steps} interleaved steps after {args.warmup} "
          f"warm-up; loadavg {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
          f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
