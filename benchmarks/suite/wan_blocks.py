"""The GPU suite's sections on Wan 2.1 14B blocks: fp8 compute (``train.fp8``) against bf16, and
block swapping (``memory.swap_blocks``) against every block resident."""

from __future__ import annotations

import statistics
import time

import torch

from videodit.components import model_geometry
from videodit.config import load_config
from videodit.diffusion.rectified_flow import RectifiedFlow
from videodit.parallel.parallelize import parallelize

from suite.report import Report, attempt, report_out_of_time
from suite.workload import GiB, Workload, precision, single_context, sync


def section_fp8(w: Workload, report: Report, args) -> None:
    """One Wan block as ``train.fp8`` converts it (``parallel/float8.py``) against the same block
    in bf16 autocast (fp32 in the dry run): fp32 weights on one GPU, as the Trainer holds them."""
    from videodit.errors import UserError
    from videodit.models.wan.model import WanBlock, rope_table
    from videodit.parallel.float8 import Float8Options, check_float8, convert_blocks

    try:
        check_float8(w.device, tp=1, lora_rank=0)
    except UserError as exc:
        report.skip("fp8 speed-up", str(exc))
        return
    preset = "wan-tiny" if w.dry else "wan2.1-t2v-14b"
    cfg = load_config("tiny", [f"model.preset={preset}", f"text.max_length={8 if w.dry else 512}"])
    geometry = model_geometry(cfg, 16, 4096)   # Wan's 16 latent channels, umT5-XXL's 4096 (512 tokens)
    grid = (2, 4, 4) if w.dry else (21, 30, 52)   # 480p x 81 frames through Wan's VAE and 1x2x2 patches
    tokens = grid[0] * grid[1] * grid[2]
    g = torch.Generator().manual_seed(0)
    x, e0 = torch.randn(1, tokens, geometry.dim, generator=g), torch.randn(1, 6, geometry.dim, generator=g)
    context = torch.randn(1, geometry.text_len, geometry.dim, generator=g)
    inputs = [t.to(w.device) for t in (x, e0, context)] + [rope_table(grid, geometry, w.device)]
    rows, base = [], {}
    for compiled in (False, True):
        for fp8 in (False, True):
            name = "fp8" if fp8 else precision(w)
            what = f"fp8 {name}, compile {'on' if compiled else 'off'}"
            if report_out_of_time(report, what, args):
                continue

            def measure():
                torch.manual_seed(0)
                block = WanBlock(geometry).to(w.device)
                if fp8:
                    convert_blocks([block], Float8Options(emulate=w.device.type != "cuda"))
                run = torch.compile(block, backend=w.backend) if compiled else block

                def step():
                    with torch.autocast(w.device.type, dtype=torch.bfloat16, enabled=w.bf16):
                        out = run(*inputs)
                    out.float().pow(2).mean().backward()
                    block.zero_grad(set_to_none=True)
                times = []
                for _ in range(w.warmup + w.steps):
                    sync(w.device)
                    if w.device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    start = time.perf_counter()
                    step()
                    sync(w.device)
                    times.append(time.perf_counter() - start)
                peak = f"{torch.cuda.max_memory_allocated() / GiB:.2f}" if w.device.type == "cuda" else "n/a"
                return statistics.median(times[w.warmup:]), peak
            out = attempt(report, what, measure)
            if out:
                median, peak = out
                base.setdefault(compiled, median if not fp8 else None)
                ratio = f"{base[compiled] / median:.2f}" if base.get(compiled) else "n/a"
                rows.append([name, "on" if compiled else "off", f"{median * 1e3:.1f}", ratio, peak])
    if rows:
        report.table(f"fp8 compute (train.fp8): one Wan block, {tokens} tokens", ["matmuls", "compile",
                     "ms fwd+bwd", "speed-up vs " + precision(w), "peak GiB"], rows,
                     note=f"{preset} block (dim {geometry.dim}, FFN {geometry.ffn_dim}, {geometry.num_heads} heads), "
                          f"batch 1, {geometry.text_len} caption tokens; fp32 weights; median of {w.steps} after "
                          f"{w.warmup}; fp8: torchao float8 with tensorwise scales on every block linear"
                          + (" (emulated on CPU: no speed-up to read)" if w.device.type != "cuda" else "") + ".")



def h2d_bandwidth(device: torch.device) -> float | None:
    """GB/s of one 1 GiB copy from pinned host memory to the GPU (None on CPU)."""
    if device.type != "cuda":
        return None
    host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    dest = torch.empty(GiB, dtype=torch.uint8, device=device)
    dest.copy_(host, non_blocking=True)
    sync(device)
    start = time.perf_counter()
    dest.copy_(host, non_blocking=True)
    sync(device)
    return GiB / (time.perf_counter() - start) / 1e9


def section_swap(w: Workload, report: Report, args) -> None:
    """``memory.swap_blocks``: a LoRA step of Wan 2.1 14B blocks (a few of them: the whole 14B does
    not train on one GPU without swapping, which is what is measured) with K blocks swapped against
    every block resident: the copy overhead the side stream does not hide, at a long and a short clip."""
    from videodit.config import LoraConfig, MemoryConfig, ParallelConfig
    from videodit.config.schema import LORA_TARGETS
    from videodit.models.wan.model import WanDiT
    from videodit.parallel.block_swap import block_swappers
    from videodit.parallel.lora import apply_lora

    preset = "wan-tiny" if w.dry else "wan2.1-t2v-14b"
    layers = 2 if w.dry else 8
    cfg = load_config("tiny", [f"model.preset={preset}", f"model.depth={layers}",
                               f"text.max_length={8 if w.dry else 512}"])
    geometry = model_geometry(cfg, 16, 4096)
    flow = RectifiedFlow(cfg.diffusion)
    latents = {"480p x 81": (21, 60, 104), "240p x 17": (5, 30, 52)} if not w.dry else {"32x32 x 5": (2, 4, 4)}
    bandwidth = h2d_bandwidth(w.device)
    steps = min(w.steps, 5)
    rows = []
    for label, (frames, height, width) in latents.items():
        base_time = None
        for swap in sorted({0, layers // 2, layers}):
            what = f"swap {swap} of {layers}, {label}"
            if report_out_of_time(report, what, args):
                continue

            def measure():
                torch.manual_seed(0)
                with torch.device(w.device):
                    model = WanDiT(geometry)
                apply_lora(model, LoraConfig(rank=32, targets=LORA_TARGETS["wan"]),
                           base_dtype=torch.bfloat16 if w.bf16 else None)
                memory = MemoryConfig(checkpointing="full", swap_blocks=swap)
                parallel = parallelize(model, single_context(w, w.config()), ParallelConfig(), memory=memory,
                                       loss_fn=flow.loss, autocast_dtype=torch.bfloat16 if w.bf16 else None)
                optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
                g = torch.Generator().manual_seed(0)
                x0 = torch.randn(1, geometry.in_channels, frames, height, width, generator=g)
                noise, t = torch.randn(x0.shape, generator=g), torch.rand(1, generator=g)
                context = torch.randn(1, geometry.text_len, geometry.text_dim, generator=g)
                inputs = tuple(v.to(w.device) for v in (flow.interpolate(x0, noise, t), t, context))
                target = flow.velocity_target(x0, noise).to(w.device)
                times = []
                for _ in range(1 + steps):
                    sync(w.device)
                    if w.device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    start = time.perf_counter()
                    parallel.forward_backward(inputs, target, scale=1.0, sync=True)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    sync(w.device)
                    times.append(time.perf_counter() - start)
                peak = torch.cuda.max_memory_allocated() / GiB if w.device.type == "cuda" else float("nan")
                swapper = (block_swappers(model) or [None])[0]
                copied = swapper.stats.bytes_fetched / (1 + steps) if swapper else 0
                on_gpu = (swapper.block_bytes * (layers - swap) + swapper.stats.peak_resident_bytes) if swapper else \
                    sum(p.numel() * p.element_size() for p in model.blocks.parameters() if not p.requires_grad)
                unhidden = swapper.stats.unprefetched if swapper else 0
                return statistics.median(times[1:]), peak, copied, on_gpu, unhidden
            out = attempt(report, what, measure)
            if out:
                median, peak, copied, on_gpu, unhidden = out
                base_time = base_time or (median if swap == 0 else None)
                copy_s = copied / bandwidth / 1e9 if bandwidth else None
                rows.append([label, f"{swap} of {layers}", f"{median:.3f}",
                             f"{median / base_time:.3f}" if base_time else "n/a", f"{peak:.2f}",
                             f"{on_gpu / GiB:.2f}", f"{copied / GiB:.2f}", f"{copy_s:.3f}" if copy_s else "n/a",
                             f"{(median - base_time) / copy_s:.2f}" if base_time and copy_s else "n/a", unhidden])
    if rows:
        report.table(f"Block swapping (memory.swap_blocks), {preset} blocks, LoRA r32",
                     ["clip", "swapped", "s/step", "x resident", "peak GiB", "frozen weights on GPU GiB",
                      "GiB copied/step", "copy s/step at H2D bandwidth", "exposed / copy time",
                      "copies not prefetched"], rows,
                     note=f"{layers} blocks of {preset} (dim {geometry.dim}, FFN {geometry.ffn_dim}), base in "
                          f"{'bf16' if w.bf16 else 'fp32'}, full checkpointing, batch 1, {geometry.text_len} caption "
                          f"tokens; one step = forward, loss, backward, AdamW over the adapters; median of {steps} "
                          "after 1; H2D bandwidth " + (f"{bandwidth:.1f} GB/s (1 GiB pinned -> GPU)" if bandwidth
                                                      else "n/a on CPU") + ". exposed / copy time = (step - resident "
                          "step) / the copies' time at that bandwidth: 0 when the side stream hides them, 1 when "
                          "none is hidden.")

