"""The GPU suite's speed sections on the XL workload: MFU with compile off and on, the SDPA
kernel of each attention kind, and the Trainer's fixed fast paths (fused AdamW, TF32)."""

from __future__ import annotations

import time

import torch

from videodit.models.stdit.model import STDiT
from videodit.parallel.compile import CompileOptions
from videodit.train.metrics import peak_tflops

from suite.report import Report, attempt, report_out_of_time
from suite.step import Step
from suite.workload import Workload, count_parameters_of, free_memory, pick_batch, single_context, sync, tokens


def section_mfu(w: Workload, report: Report, args) -> None:
    peak = peak_tflops(torch.cuda.get_device_name() if w.device.type == "cuda" else None, args.peak_tflops)
    if peak is None:
        report.skip("MFU", "no peak TFLOP/s known for this device (pass --peak-tflops)")
    rows = []
    for compiled in (False, True):
        for shape in w.mfu_shapes:
            what = f"MFU {shape.label} x {shape.frames}, compile {'on' if compiled else 'off'}"
            if report_out_of_time(report, what, args):
                continue
            cfg = w.config(["memory.checkpointing=full"])
            options = CompileOptions(w.backend, "auto") if compiled else None
            batch = args.batch or pick_batch(w, cfg, shape, args.max_batch)

            def measure():
                step = Step(w, cfg, single_context(w, cfg), shape, batch, options, shapes=len(w.mfu_shapes))
                first, median = step.timed(w.warmup, w.steps)
                tflops = step.flops.model / median / 1e12
                return [shape.label + f" x {shape.frames}", batch, tokens(w, step.geometry, shape),
                        "on" if compiled else "off", f"{median:.3f}", f"{first - median:.1f}",
                        f"{step.flops.model / 1e12:.1f}", f"{tflops:.1f}",
                        f"{tflops / peak:.1%}" if peak else "n/a",
                        f"{step.flops.hardware / median / 1e12 / peak:.1%}" if peak else "n/a",
                        step.parallel.compile_stats.compiles if compiled else "-"]
            row = attempt(report, what, measure)
            if row:
                rows.append(row)
    if rows:
        report.table(
            "MFU, XL (Open-Sora 1.2 geometry), bf16, full activation checkpointing" if not w.dry else "MFU (dry run)",
            ["shape", "batch", "tokens/sample", "compile", "s/step", "first-step extra s", "model TFLOP/step",
             "model TFLOP/s", "MFU", "HFU", "graphs"], rows,
            note=f"{count_parameters_of(w) / 1e9:.2f} B parameters; median of {w.steps} steps after {w.warmup}; "
                 f"peak {peak or 'unknown'} TFLOP/s; MFU = model FLOPs (no recompute) / s / peak, HFU adds the "
                 "recomputed forward of full checkpointing and fused attention's backward recompute.")



def section_sdpa(w: Workload, report: Report, args) -> None:
    """q, k, v as the model hands them to SDPA (under bf16 autocast SDPA runs in bf16) at the
    first MFU shape, batch 1: which kernel runs, and each kernel's time when forced."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    if report_out_of_time(report, "SDPA kernels", args):
        return
    g = w.geometry()
    frames, height, width = w.latent_shape(w.mfu_shapes[0])
    pt, ph, pw = g.patch_size
    t, s, heads, hd = -(-frames // pt), -(-height // ph) * -(-width // pw), g.num_heads, g.hidden_size // g.num_heads
    dtype = torch.bfloat16 if w.bf16 else torch.float32
    length = w.caption[1]
    mask = (torch.arange(length, device=w.device) < length // 3)[None, None, None, :]
    kinds = {"spatial (self, unmasked)": ((t, heads, s, hd), (t, heads, s, hd), None),
             "temporal (self, unmasked)": ((s, heads, t, hd), (s, heads, t, hd), None),
             "cross (caption mask)": ((1, heads, t * s, hd), (1, heads, length, hd), mask)}
    backends = [b for b in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
                if hasattr(SDPBackend, b)]
    rows = []
    for kind, (q_shape, kv_shape, attn_mask) in kinds.items():
        q = torch.randn(q_shape, device=w.device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(kv_shape, device=w.device, dtype=dtype, requires_grad=True) for _ in range(2))

        def run(q=q, k=k, v=v, attn_mask=attn_mask):
            F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).sum().backward()

        run()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
        picked = sorted({e.name.replace("aten::", "") for e in prof.events()
                         if "attention" in e.name and "backward" not in e.name
                         and e.name != "aten::scaled_dot_product_attention"})
        timing = []
        for backend in backends:
            def forced(backend=backend):
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    run()
                    sync(w.device)
                    start = time.perf_counter()
                    for _ in range(3):
                        run()
                    sync(w.device)
                return f"{(time.perf_counter() - start) / 3 * 1e3:.2f}"
            try:
                timing.append(forced())
            except RuntimeError:
                timing.append("n/a")
        rows.append([kind, f"{list(q_shape)} x {list(kv_shape)}", ", ".join(picked) or "?", *timing])
        del q, k, v
        free_memory()
    report.table("SDPA kernel per attention kind", ["attention", "q x k/v shape", "default kernel",
                                                     *[f"{b.lower()} ms" for b in backends]], rows,
                 note=f"{dtype}, {w.mfu_shapes[0].label} x {w.mfu_shapes[0].frames}, batch 1; forward + backward; "
                      "n/a: the kernel refuses these inputs.")


def section_fastpaths(w: Workload, report: Report, args) -> None:
    """AdamW fused vs foreach (and the for-loop) over the model's parameters with random
    gradients; an fp32 matmul with TF32 allowed and not."""
    if report_out_of_time(report, "fast paths", args):
        return
    rows = []
    with torch.device(w.device):
        model = STDiT(w.geometry())
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    for name, options in (("for-loop", dict(foreach=False)), ("foreach", dict(foreach=True)),
                          ("fused", dict(fused=True))):
        def measure(options=options, params=params):
            optimizer = torch.optim.AdamW(params, lr=1e-5, **options)
            optimizer.step()     # creates the state
            sync(w.device)
            start = time.perf_counter()
            for _ in range(w.steps):
                optimizer.step()
            sync(w.device)
            return (time.perf_counter() - start) / w.steps
        seconds = attempt(report, f"AdamW {name}", measure)
        if seconds is not None:
            rows.append([f"AdamW step, {name}", f"{seconds * 1e3:.1f} ms"])
    del model, params
    free_memory()
    if w.device.type == "cuda":
        n = 8192
        a, b = torch.randn(n, n, device=w.device), torch.randn(n, n, device=w.device)
        before = torch.get_float32_matmul_precision()
        for tf32 in (False, True):
            # The Trainer's switch (torch's older TF32 API: mixing in the newer one breaks inductor).
            torch.set_float32_matmul_precision("high" if tf32 else "highest")
            a @ b
            sync(w.device)
            start = time.perf_counter()
            for _ in range(10):
                a @ b
            sync(w.device)
            rows.append([f"fp32 matmul {n}^2, TF32 {'on' if tf32 else 'off'}",
                         f"{2 * n**3 * 10 / (time.perf_counter() - start) / 1e12:.1f} TFLOP/s"])
        torch.set_float32_matmul_precision(before)
        del a, b
    else:
        report.skip("TF32 matmuls", "CUDA only")
    report.table("Fast paths", ["what", "time or rate"], rows,
                 note=f"{count_parameters_of(w) / 1e9:.2f} B parameters, fp32 AdamW state; the Trainer uses fused "
                      "AdamW when every parameter is on a GPU, and TF32 for fp32 matmuls (torch.set_float32_matmul_"
                      "precision('high')); cudnn.benchmark stays off (bucket shapes change).")

