"""The GPU measurements, in one command: run it on a machine with a GPU, read the section it
appends to benchmarks/RESULTS.md.

    python benchmarks/gpu_suite.py                      # everything the time budget allows (9.5 min)
    python benchmarks/gpu_suite.py --sections mfu,sdpa  # some of it
    python benchmarks/gpu_suite.py --dry-run            # CPU, tiny shapes, fp32: every code path, no figures

Everything does not fit in one 10-minute invocation on one GPU: measurements that would start
after ``--budget-minutes`` are listed as not measured. Run the rest in a second invocation, e.g.
``--sections mfu,sdpa,fastpaths`` then ``--sections planner,tune,levers,parallel``; each
appends its own section.

Needs nothing but this repository and its dependencies: no internet, no pip registry, no
pretrained weights (see "Offline" in ``--help``). The workload is the XL preset with Open-Sora 1.2's geometry (28 block
pairs, hidden 1152, 16 heads, patch (1, 2, 2), captions of 300 tokens x 4096 channels,
4-channel latents at 1/8 of the pixels and 17 frames -> 5 latent frames), random weights,
random latents and random caption embeddings fed straight to the model (no VAE, no T5).
Every step runs what the Trainer runs: ``parallel.parallelize`` (activation checkpointing,
compile, memory levers, FSDP2/TP/SP/PP), the rectified-flow loss, gradient clipping and
AdamW (fused on CUDA).

Sections (``--sections``, default all):

* ``mfu``: model TFLOP/s per GPU and MFU at 240p x 51 and 360p x 51 frames, bf16, full
  activation checkpointing, compile off and on. Model FLOPs from ``models.flops.
  train_step_flops`` (no recompute), the peak from ``train.metrics.peak_tflops``
  (``--peak-tflops`` for a GPU not in its table); HFU counts the recompute too.
* ``sdpa``: which SDPA kernel each attention kind gets (spatial and temporal self-attention
  are unmasked; cross-attention has the caption mask), and each kernel's forward+backward
  time when forced.
* ``fastpaths``: the Trainer's fixed GPU settings: AdamW fused against foreach (one
  optimizer step over the XL parameters) and TF32 against full fp32 matmuls.
* ``planner``: ``videodit.planner``'s predicted peak against ``torch.cuda.max_memory_allocated``
  for five buckets (batch: the planner's largest that fits, at most ``--max-batch``).
* ``tune``: the largest batch found by ``videodit tune``'s search (``planner/tune.py``: from the
  planner's prediction, doubling, then bisecting; a trial fits when its peak stays within the
  planner's budget and it does not run out of memory) against the planner's, for two buckets.
  The trials run this suite's step (random latents) rather than ``videodit tune CONFIG``,
  which needs a dataset, the VAE and T5.
* ``levers``: peak memory and step time of the activation levers (checkpointing, bf16/fp8
  compression, host offload) at 240p x 51, batch 1, no compile.
* ``fp8``: forward + backward of one Wan 2.1 14B block (480p x 81 frames: 32,760 tokens,
  batch 1) with ``train.fp8`` (torchao float8, tensorwise) against bf16 autocast, compile off
  and on: time, speed-up and peak memory. Needs torchao (``pip install videodit[lowmem]``) and
  compute capability >= 8.9; the dry run emulates float8 on CPU.
* ``swap``: ``memory.swap_blocks``: a LoRA step (r32, bf16 base, full checkpointing) of 8 Wan
  2.1 14B blocks at 480p x 81 and 240p x 17 with 0, 4 and 8 blocks swapped: step time, peak
  memory, bytes copied and how much of the copy time the side stream leaves exposed.
* ``parallel``: with more than one GPU, step time and MFU of FSDP, SP, TP and PP over all
  GPUs (torchrun, one launch per layout).
* ``data``: decode clips/s of NVDEC (torchcodec, ``data.decode_device=cuda``) against PyAV and
  torchcodec on the CPU, on the same 832x480 x 81 h264 clips and 33-frame windows, and how far
  each decoder's frames are from PyAV's (``benchmarks/decode_devices.py``), and the share of a
  training step spent waiting for data (``data_wait``) on those clips with 0 and 2 workers. The
  NVDEC row needs torchcodec (``pip install videodit[torchcodec]``) and FFmpeg's shared libraries.

What could not be measured (no GPU, one GPU, out of memory, a failure, the time budget) is
listed in the section's last table ("Not measured", with the reason) instead of silently
missing. What this suite never measures: the VAE and text encoder (bf16 on-the-fly encoding),
the data loader (pinned memory, asynchronous copies), real data and captions, pretrained
weights, and more than one node.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from videodit.config import load_config  # noqa: E402
from videodit.components import model_geometry  # noqa: E402
from videodit.diffusion.rectified_flow import RectifiedFlow  # noqa: E402
from videodit.models.flops import train_step_flops  # noqa: E402
from videodit.models.spec import count_parameters  # noqa: E402
from videodit.models.stdit.model import STDiT  # noqa: E402
from videodit.parallel.compile import CompileOptions  # noqa: E402
from videodit.parallel.distributed import init_distributed  # noqa: E402
from videodit.parallel.parallelize import parallelize  # noqa: E402
from videodit.planner.estimate import Parallel  # noqa: E402
from videodit.planner.measure import LiveMemory, optimizer_bytes, tensor_bytes  # noqa: E402
from videodit.planner.plan import MAX_BATCH, LatentGeometry, Planner  # noqa: E402
from videodit.planner.tune import search_max_batch  # noqa: E402
from videodit.train.metrics import peak_tflops  # noqa: E402

OFFLINE = """\
Offline (no internet, no pip registry; PyTorch with CUDA already installed):
  1. On a machine with internet, the same OS, CPU architecture and Python version as the GPU
     machine, make a wheel folder of videodit's other dependencies:
       pip wheel --wheel-dir videodit-wheels {requirements}
  2. Copy videodit-wheels/ and this repository to the GPU machine; in the repository:
       pip install --no-index --find-links videodit-wheels -e .
     (the installed PyTorch satisfies the torch requirement; nothing else is fetched)
  3. python benchmarks/gpu_suite.py [--sections ...]
     It downloads nothing: random weights, random latents and captions.

Output: a "## GPU suite" section appended to benchmarks/RESULTS.md (--results FILE for
another file), printed as it goes; its last table lists what was not measured and why.
"""

GiB = 2**30
SECTIONS = ("mfu", "sdpa", "fastpaths", "planner", "tune", "levers", "fp8", "swap", "parallel", "data")
LEVERS = {   # name -> memory.* overrides (the levers act on blocks that are not checkpointed)
    "none": {},
    "checkpoint full": {"memory.checkpointing": "full"},
    "checkpoint selective": {"memory.checkpointing": "selective"},
    "compression bf16": {"memory.compression": "bf16"},
    "compression fp8": {"memory.compression": "fp8"},
    "offload": {"memory.offload": True},
    "offload + fp8": {"memory.offload": True, "memory.compression": "fp8"},
    "checkpoint full + offload": {"memory.checkpointing": "full", "memory.offload": True},   # the inputs it keeps
}


# --------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Shape:
    label: str
    height: int       # pixels
    width: int
    frames: int


@dataclass
class Workload:
    """What the suite runs: the XL workload on a GPU, or its tiny CPU stand-in (``--dry-run``)."""
    dry: bool
    device: torch.device
    model: list[str]               # config overrides of the model
    caption: tuple[int, int]       # channels, tokens
    latent: LatentGeometry
    mfu_shapes: list[Shape]
    plan_shapes: list[Shape]
    tune_shapes: list[Shape]
    lever_shape: Shape
    steps: int
    warmup: int
    backend: str                   # compile backend
    bf16: bool

    @property
    def overrides(self) -> list[str]:
        return [*self.model, f"text.max_length={self.caption[1]}", f"train.device={self.device.type}",
                f"train.precision={'bf16' if self.bf16 else 'fp32'}", "train.ema_decay=0"]

    def config(self, extra=()):
        return load_config("tiny", [*self.overrides, *extra])

    def geometry(self, cfg=None):
        return model_geometry(cfg or self.config(), self.latent.channels, self.caption[0])

    def latent_shape(self, shape: Shape) -> tuple[int, int, int]:
        s = self.latent.spatial
        return self.latent.frames(shape.frames), shape.height // s, shape.width // s


def xl_workload(args) -> Workload:
    return Workload(
        dry=False, device=torch.device("cuda"),
        model=["model.preset=XL", "model.temporal_pos_embed=false", "model.pooled_caption=false"],
        caption=(4096, 300), latent=LatentGeometry.parse("opensora-v1.2"),
        mfu_shapes=[Shape("240p", 240, 426, 51), Shape("360p", 360, 640, 51)],
        plan_shapes=[Shape("144p", 144, 256, 51), Shape("240p", 240, 426, 51), Shape("240p", 240, 426, 102),
                     Shape("360p", 360, 640, 51), Shape("480p", 480, 854, 51)],
        tune_shapes=[Shape("240p", 240, 426, 51), Shape("360p", 360, 640, 51)],
        lever_shape=Shape("240p", 240, 426, 51), steps=args.steps, warmup=3, backend="inductor", bf16=True)


def dry_workload(args) -> Workload:
    return Workload(
        dry=True, device=torch.device("cpu"),
        model=["model.preset=tiny", "model.depth=1", "model.hidden_size=32", "model.num_heads=4",
               "model.patch_size=[1,2,2]", "model.temporal_pos_embed=false", "model.pooled_caption=false"],
        caption=(16, 8), latent=LatentGeometry.parse("opensora-v1.2"),
        mfu_shapes=[Shape("32x48", 32, 48, 17), Shape("48x64", 48, 64, 17)],
        plan_shapes=[Shape("32x32", 32, 32, 17), Shape("32x48", 32, 48, 17), Shape("32x48", 32, 48, 34),
                     Shape("48x64", 48, 64, 17), Shape("64x64", 64, 64, 17)],
        tune_shapes=[Shape("32x48", 32, 48, 17), Shape("48x64", 48, 64, 17)],
        lever_shape=Shape("32x48", 32, 48, 17), steps=2, warmup=1, backend="eager", bf16=False)


# --------------------------------------------------------------------------- one training step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    torch._dynamo.reset()   # compiled graphs hold on to the blocks they were traced from
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Step:
    """A model with its layout, levers and compile applied exactly as the Trainer does, its
    AdamW, and one batch of random latents and captions."""

    def __init__(self, w: Workload, cfg, ctx, shape: Shape, batch: int, compile: CompileOptions | None = None,
                 seed: int = 0, shapes: int = 1):
        self.w, self.device, self.batch, self.shape = w, ctx.device, batch, shape
        self.geometry = w.geometry(cfg)
        torch.manual_seed(0)   # the same random weights on every rank
        with torch.device(ctx.device):
            model = STDiT(self.geometry)
        self.num_params = count_parameters(model)
        self.flow = RectifiedFlow(cfg.diffusion)
        frames, height, width = w.latent_shape(shape)
        pt, ph, pw = self.geometry.patch_size
        grid = (-(-frames // pt), -(-height // ph) * -(-width // pw), w.caption[1])
        self.parallel = parallelize(model, ctx, cfg.parallel, memory=cfg.memory, loss_fn=self.flow.loss,
                                    autocast_dtype=torch.bfloat16 if w.bf16 else None,
                                    bucket_batch_sizes={f"b{i}": batch for i in range(shapes)}, base_grid=grid,
                                    compile=compile)
        params = list(self.parallel.local_model.parameters())
        fused = bool(params) and all(p.device.type == "cuda" for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True if fused else None)
        self.inputs, self.target = self.make_inputs(seed, frames, height, width)
        self.flops = train_step_flops(self.geometry, batch, frames, height, width, w.caption[1], cfg.memory)

    def make_inputs(self, seed: int, frames: int, height: int, width: int):
        g = torch.Generator().manual_seed(seed)
        b, (channels, length) = self.batch, self.w.caption
        x0 = torch.randn(b, self.geometry.in_channels, frames, height, width, generator=g)
        noise = torch.randn(x0.shape, generator=g)
        t = torch.rand(b, generator=g)
        y = torch.randn(b, length, channels, generator=g)
        y_mask = torch.arange(length)[None] < torch.randint(1, length + 1, (b, 1), generator=g)
        x_t = self.flow.interpolate(x0, noise, t)
        inputs = tuple(v.to(self.device) for v in (x_t, t, y, y_mask, torch.full((b,), 24.0),
                                                     torch.zeros(b, dtype=torch.bool)))
        return inputs, self.flow.velocity_target(x0, noise).to(self.device)

    def __call__(self) -> None:
        self.parallel.forward_backward(self.inputs, self.target, scale=1.0, sync=True)
        self.parallel.clip_gradients(1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed(self, warmup: int, steps: int, barrier=None) -> tuple[float, float]:
        """(first step s, median step s): the first includes compiling."""
        times = []
        for _ in range(warmup + steps):
            sync(self.device)
            if barrier:
                barrier()
            start = time.perf_counter()
            self()
            sync(self.device)
            times.append(time.perf_counter() - start)
        return times[0], statistics.median(times[warmup:])

    def state_bytes(self) -> int:
        params = list(self.parallel.local_model.parameters())
        return tensor_bytes(params) + tensor_bytes(p.grad for p in params) + optimizer_bytes(self.optimizer)

    def peak_bytes(self) -> int:
        """The most memory one step (after the first, which creates the optimizer state) holds:
        ``max_memory_allocated`` on CUDA; on CPU the state plus what LiveMemory saw."""
        self()
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            self()
            sync(self.device)
            return torch.cuda.max_memory_allocated()
        with LiveMemory() as tracker:
            self()
        return self.state_bytes() + tracker.peak


def single_context(w: Workload, cfg):
    """The one-process DistContext the Trainer would have."""
    return init_distributed(cfg)


# --------------------------------------------------------------------------- report


@dataclass
class Report:
    w: Workload
    tables: list[str] = field(default_factory=list)
    missing: list[tuple[str, str]] = field(default_factory=list)    # (what, why)

    def table(self, title: str, header: list[str], rows: list[list], note: str = "") -> None:
        lines = [f"### {title}", ""]
        if note:
            lines += [note, ""]
        lines += ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:"
                                                                for i in range(len(header))) + "|"]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        self.tables.append("\n".join(lines))
        print("\n" + self.tables[-1], flush=True)

    def skip(self, what: str, why: str) -> None:
        self.missing.append((what, why))
        print(f"not measured: {what}: {why}", flush=True)

    def markdown(self, args, elapsed: float) -> str:
        w = self.w
        if w.device.type == "cuda":
            gpu = torch.cuda.get_device_name()
            memory = torch.cuda.get_device_properties(0).total_memory / GiB
            machine = (f"{torch.cuda.device_count()} x {gpu} ({memory:.0f} GiB), CUDA {torch.version.cuda}, "
                       f"cuDNN {torch.backends.cudnn.version()}")
        else:
            machine = f"CPU ({os.cpu_count()} cores), no GPU"
        title = "GPU suite" + (" -- DRY RUN (CPU, tiny shapes, fp32: exercises the code, measures nothing)"
                               if w.dry else "")
        head = [f"## {title} (`benchmarks/gpu_suite.py`), {date.today().isoformat()}", "",
                "`python benchmarks/gpu_suite.py" + "".join(" " + a for a in args.argv) + "`",
                "", f"Machine: {machine}; torch {torch.__version__}, Python {platform.python_version()}; "
                f"{elapsed / 60:.1f} minutes."]
        body = list(self.tables)
        rows = [f"| {what} | {why} |" for what, why in self.missing] or ["| - | everything was measured |"]
        body.append("\n".join(["### Not measured", "", "| what | why |", "|---|---|", *rows]))
        return "\n\n".join(["\n".join(head), *body]) + "\n"


class OutOfTime(Exception):
    """The time budget ran out in the middle of a measurement (the tune section's search)."""


def attempt(report: Report, what: str, fn):
    """Run one measurement; an OOM or any failure becomes a 'not measured' line."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        report.skip(what, "out of GPU memory")
    except OutOfTime as exc:
        report.skip(what, str(exc))
    except Exception as exc:   # noqa: BLE001 -- a failed measurement must not lose the others
        traceback.print_exc()
        report.skip(what, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
    finally:
        free_memory()
    return None


# --------------------------------------------------------------------------- sections


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


def precision(w: Workload) -> str:
    return "bf16 autocast" if w.bf16 else "fp32"


def tokens(w: Workload, geometry, shape: Shape) -> int:
    frames, height, width = w.latent_shape(shape)
    pt, ph, pw = geometry.patch_size
    return -(-frames // pt) * -(-height // ph) * -(-width // pw)


def count_parameters_of(w: Workload) -> int:
    with torch.device("meta"):
        return count_parameters(STDiT(w.geometry()))


def planner_for(w: Workload, cfg) -> Planner:
    gpu = torch.cuda.get_device_properties(0).total_memory if w.device.type == "cuda" else 8 * GiB
    return Planner(w.geometry(cfg), Parallel(), w.bf16, cfg.memory, w.latent, w.caption[1], gpu, margin=0.1,
                   ema=False)


def pick_batch(w: Workload, cfg, shape: Shape, cap: int) -> int:
    """The planner's largest batch that fits, at most ``cap`` (at least 1)."""
    return max(1, min(cap, planner_for(w, cfg).max_batch(shape.frames, shape.height, shape.width)))


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


def section_planner(w: Workload, report: Report, args) -> None:
    cfg = w.config(["memory.checkpointing=full"])
    planner = planner_for(w, cfg)
    rows = []
    for shape in w.plan_shapes:
        what = f"planner vs measured, {shape.label} x {shape.frames}"
        if report_out_of_time(report, what, args):
            continue
        fits = planner.max_batch(shape.frames, shape.height, shape.width)
        if not fits:
            report.skip(what, f"the planner says batch 1 does not fit ({planner.cheapest_fix(shape.frames, shape.height, shape.width)})")
            continue
        batch = min(fits, args.max_batch)
        predicted = planner.estimate(batch, shape.frames, shape.height, shape.width).peak

        def measure():
            step = Step(w, cfg, single_context(w, cfg), shape, batch)
            measured = step.peak_bytes()
            return [f"{shape.label} x {shape.frames}", batch, tokens(w, step.geometry, shape), f"{predicted / GiB:.2f}",
                    f"{measured / GiB:.2f}", f"{predicted / measured:.2f}"]
        row = attempt(report, what, measure)
        if row:
            rows.append(row)
    if rows:
        report.table("Planner prediction vs measured peak", ["bucket", "batch", "tokens/sample", "predicted GiB",
                                                             "measured GiB", "predicted / measured"], rows,
                     note=f"{precision(w)}, full checkpointing, no EMA, no encoders, one GPU; measured: "
                          + ("torch.cuda.max_memory_allocated over one step after the first."
                             if w.device.type == "cuda" else "state + LiveMemory peak (CPU)."))


def size(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.1f} MiB"


def trial_peak(w: Workload, cfg, shape: Shape, batch: int) -> int | None:
    """The peak memory of a training step at ``batch`` (as ``Step.peak_bytes``); None when it
    runs out of GPU memory, which ``videodit tune`` counts as "does not fit" too."""
    try:
        return Step(w, cfg, single_context(w, cfg), shape, batch).peak_bytes()
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        free_memory()


def section_tune(w: Workload, report: Report, args) -> None:
    cfg = w.config(["memory.checkpointing=full"])
    planner = planner_for(w, cfg)
    limit = args.max_batch if w.dry else MAX_BATCH   # CPU: a short search, the code path only
    rows = []
    for shape in w.tune_shapes:
        what = f"tune vs planner, {shape.label} x {shape.frames}"
        if report_out_of_time(report, what, args):
            continue
        planned = planner.max_batch(shape.frames, shape.height, shape.width)

        def measure(shape=shape, planned=planned):
            trials = []

            def fits(batch: int) -> bool:
                if remaining(args) <= 0:
                    raise OutOfTime(f"the time budget (--budget-minutes {args.budget_minutes:g}) was spent "
                                    f"during the search, after trials {', '.join(trials)}")
                peak = trial_peak(w, cfg, shape, batch)
                trials.append(f"{batch}: " + ("out of memory" if peak is None else size(peak)))
                return peak is not None and peak <= planner.budget

            tuned = search_max_batch(fits, start=max(planned, 1), limit=limit, multiple=planner.batch_multiple)
            return [f"{shape.label} x {shape.frames}", planned, tuned, f"{tuned / planned:.2f}" if planned else "n/a",
                    "; ".join(trials)]
        row = attempt(report, what, measure)
        if row:
            rows.append(row)
    if rows:
        report.table("videodit tune's batch sizes vs the planner's",
                     ["bucket", "planner max batch", "tuned max batch", "tuned / planner", "trials (batch: peak)"],
                     rows, note=f"{precision(w)}, full checkpointing, no EMA, no encoders; budget {planner.budget / GiB:.2f} GiB "
                                "(the planner's: device memory less its margin); the search of `videodit tune` "
                                "(planner/tune.py) over trial steps of this suite's workload"
                                + (f", stopped at batch {limit} (dry run)" if w.dry else "") + ".")


def section_levers(w: Workload, report: Report, args) -> None:
    rows, shape = [], w.lever_shape
    base_time = None
    for name, levers in LEVERS.items():
        what = f"lever {name}"
        if report_out_of_time(report, what, args):
            continue
        if levers.get("memory.offload") and w.device.type != "cuda":
            report.skip(what, "offload moves CUDA tensors to host memory: a no-op on CPU")
            continue
        cfg = w.config([f"{k}={v}" for k, v in levers.items()])

        def measure():
            step = Step(w, cfg, single_context(w, cfg), shape, 1)
            peak = step.peak_bytes()
            state = step.state_bytes()
            _, median = step.timed(1, w.steps)
            return [name, f"{peak / GiB:.2f}", f"{(peak - state) / GiB:.2f}", f"{median:.3f}"], median
        out = attempt(report, what, measure)
        if out:
            row, median = out
            base_time = base_time or (median if name == "none" else None)
            rows.append(row + [f"{median / base_time:.2f}" if base_time else "n/a"])
    if rows:
        report.table(f"Memory levers on {w.device.type.upper()}, {shape.label} x {shape.frames}, batch 1",
                     ["lever", "peak GiB", "peak - weights, grads, AdamW GiB", "s/step", "time vs none"], rows,
                     note=f"{precision(w)}, no compile; compression and offload act on the blocks that are not "
                          "checkpointed (all of them here), except with checkpointing, where offload moves the token "
                          "input each block keeps.")


# --------------------------------------------------------------------------- fp8 compute


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


# --------------------------------------------------------------------------- block swapping


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


# --------------------------------------------------------------------------- parallel layouts


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
                       str(Path(__file__).resolve()), "--worker", json.dumps({k: chosen[k] for k in names}),
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


def section_data(w: Workload, report: Report, args) -> None:
    from decode_devices import section_data as decode_clips   # benchmarks/ is this script's folder

    decode_clips(w, report, args)


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


# --------------------------------------------------------------------------- main


def offline_requirements() -> list[str]:
    """What ``pip wheel`` must fetch for an offline install: pyproject.toml's dependencies but
    PyTorch (preinstalled), and the build backend, quoted for a shell."""
    text = (ROOT / "pyproject.toml").read_text()
    build = re.search(r'requires = \[(.*?)\]', text, re.S).group(1)
    runtime = re.search(r'^dependencies = \[(.*?)\]', text, re.S | re.M).group(1)
    names = re.findall(r'"([^"]+)"', build) + re.findall(r'"([^"]+)"', runtime)
    return [f"'{name}'" for name in names if not re.match(r"torch\b", name)]


def remaining(args) -> float:
    return args.budget_minutes * 60 - (time.perf_counter() - args.start)


def report_out_of_time(report: Report, what: str, args) -> bool:
    if remaining(args) > 0:
        return False
    report.skip(what, f"the time budget (--budget-minutes {args.budget_minutes:g}) was spent")
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=OFFLINE.format(requirements=" ".join(offline_requirements())))
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, fp32, two steps: every code path")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}")
    parser.add_argument("--results", default=None,
                        help="append the section here (default benchmarks/RESULTS.md; a dry run only prints)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement (after 3 warm-up)")
    parser.add_argument("--batch", type=int, default=0, help="MFU batch (default: the planner's largest, "
                        "at most --max-batch)")
    parser.add_argument("--max-batch", type=int, default=8, help="largest batch the mfu and planner sections "
                        "use (the tune section searches up to the planner's limit)")
    parser.add_argument("--parallel-batch", type=int, default=4, help="batch per data-parallel group")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak of this GPU "
                        "(default: the table in videodit/train/metrics.py)")
    parser.add_argument("--budget-minutes", type=float, default=9.5, help="stop starting measurements after this")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.start = time.perf_counter()
    if args.worker:
        worker(args)
        return 0

    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.dry_run:
        torch.set_num_threads(1)   # tiny tensors: one thread, no OpenMP spin-waiting on busy cores
        args.max_batch, args.parallel_batch = min(args.max_batch, 2), 2
        w = dry_workload(args)
    elif not torch.cuda.is_available():
        print("error: no GPU visible; run on a machine with one, or --dry-run to check the suite on CPU",
              file=sys.stderr)
        return 2
    else:
        w = xl_workload(args)
        torch.set_float32_matmul_precision("high")   # as the Trainer does on CUDA
        torch.backends.cudnn.benchmark = False
    report = Report(w)
    funcs = {"mfu": section_mfu, "sdpa": section_sdpa, "fastpaths": section_fastpaths, "planner": section_planner,
             "tune": section_tune, "levers": section_levers, "fp8": section_fp8,
             "swap": section_swap, "parallel": section_parallel, "data": section_data}
    for name in SECTIONS:
        if name in sections:
            print(f"\n== {name}", flush=True)
            start = time.perf_counter()
            attempt(report, f"section {name}", lambda name=name: funcs[name](w, report, args))
            print(f"== {name}: {time.perf_counter() - start:.1f} s", flush=True)
        else:
            report.skip(f"section {name}", "not selected (--sections)")
    text = report.markdown(args, time.perf_counter() - args.start)
    results = args.results or (None if args.dry_run else str(ROOT / "benchmarks" / "RESULTS.md"))
    if results:
        with open(results, "a") as f:
            f.write("\n" + text)
        print(f"\nappended to {results}")
    else:
        print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
