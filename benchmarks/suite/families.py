"""The GPU suite's families section: the speed of every model family at real width on one GPU,
with each activation-checkpointing mode, compile off and on, at the planner's largest batch.

Wan 2.1 1.3B trains whole at 480p x 81; the models that do not train whole on one GPU (Wan 2.1
14B, Open-Sora 2.0's MMDiT, LTX-2.3) run as a few real-width blocks at their typical bucket, and
the FLOP model scales the step time to the whole model. The dry run takes each family's tiny
preset at a tiny bucket, two steps, so every code path runs on CPU."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from videodit.models.families import get_spec
from videodit.models.flops import train_step_flops
from videodit.parallel.compile import CompileOptions
from videodit.planner.measure import LiveMemory
from videodit.planner.plan import LatentGeometry
from videodit.train.metrics import peak_tflops

from suite.breakdown import CATEGORIES, profile_step
from suite.report import Report, attempt, report_out_of_time, size
from suite.step import Step
from suite.workload import Shape, Workload, pick_batch, planner_for, single_context, sync, tokens

CHECKPOINTING = ("none", "selective", "full")


@dataclass(frozen=True)
class Family:
    label: str
    preset: str                 # model.preset (the dry run: ``tiny``)
    tiny: str
    latent: str                 # the VAE's latent geometry (planner/plan.py's KNOWN_LATENTS)
    bucket: Shape               # its typical training clip
    blocks: tuple[str, ...]     # model.* overrides that keep N real-width blocks; () = the whole model
    tiny_blocks: tuple[str, ...] = ()


FAMILIES = (
    Family("Wan 2.1 1.3B", "wan2.1-t2v-1.3b", "wan-tiny", "wan2.1", Shape("480p", 480, 832, 81), ()),
    Family("Wan 2.1 14B", "wan2.1-t2v-14b", "wan-tiny", "wan2.1", Shape("480p", 480, 832, 81),
           ("model.depth=4",), ("model.depth=1",)),
    # Open-Sora 2.0's stage-1 clips: 256px x 129 frames; its 19 double + 38 single blocks kept 1:2
    Family("Open-Sora 2.0 MMDiT", "opensora-v2", "mmdit-tiny", "hunyuan", Shape("256px", 256, 256, 129),
           ("model.depth=2", "model.depth_single=4"), ("model.depth=1", "model.depth_single=1")),
    # LTX-2's trainer bucket 960x544 x 49 (docs/ltx2.md)
    Family("LTX-2.3", "ltx2.3-22b", "ltx2-tiny", "ltx2", Shape("544p", 544, 960, 49), ("model.depth=4",),
           ("model.depth=1",)),
)
TINY_BUCKET = Shape("64x64", 64, 64, 9)
TINY_CAPTION_TOKENS = 8


def family_workload(w: Workload, family: Family, whole: bool = False) -> Workload:
    """``w`` with the family's model, latents and captions (its release's encoders' width and
    length; the dry run: 8 caption tokens); ``whole``: every block, for the FLOP scaling."""
    preset = family.tiny if w.dry else family.preset
    blocks = () if whole else (family.tiny_blocks if w.dry else family.blocks)
    model = [f"model.preset={preset}", *blocks]
    base = dataclasses.replace(w, model=model)
    cfg = base.config()
    _, channels, length = get_spec(cfg.model.family).released_encoders_of(cfg.model)
    return dataclasses.replace(base, caption=(channels, TINY_CAPTION_TOKENS if w.dry else length),
                               latent=LatentGeometry.parse(family.latent))


def section_families(w: Workload, report: Report, args) -> None:
    peak = peak_tflops(torch.cuda.get_device_name() if w.device.type == "cuda" else None, args.peak_tflops)
    if peak is None:
        report.skip("families MFU", "no peak TFLOP/s known for this device (pass --peak-tflops)")
    warmup, steps = (1, 2) if w.dry else (2, min(args.steps, 3))   # compile needs its warm-up; real steps are long
    rows, shares, tops = [], [], {}
    for family in FAMILIES:
        wf = family_workload(w, family)
        shape = TINY_BUCKET if w.dry else family.bucket
        whole = wf if not family.blocks else family_workload(w, family, whole=True)
        for compiled in (False, True):
            for mode in CHECKPOINTING:
                what = f"families: {family.label}, checkpointing {mode}, compile {'on' if compiled else 'off'}"
                if report_out_of_time(report, what, args):
                    continue
                cfg = wf.config([f"memory.checkpointing={mode}"])
                planner = planner_for(wf, cfg)
                if not planner.max_batch(shape.frames, shape.height, shape.width):
                    report.skip(what, "the planner says batch 1 does not fit "
                                      f"({planner.cheapest_fix(shape.frames, shape.height, shape.width)})")
                    continue
                batch = args.batch or pick_batch(wf, cfg, shape, args.max_batch, planner)
                predicted = planner.estimate(batch, shape.frames, shape.height, shape.width).peak
                options = CompileOptions(w.backend, "auto") if compiled else None

                def measure(wf=wf, cfg=cfg, shape=shape, batch=batch, options=options, what=what):
                    step = Step(wf, cfg, single_context(wf, cfg), shape, batch, options)
                    first, median, measured = timed_with_peak(step, warmup, steps, options is not None)
                    # profiled here, before attempt() resets the compiled graphs
                    broken = attempt(report, f"{what}: profile", lambda: profile_step(step, w.device), clean=False)
                    return step.flops, step.geometry, first, median, measured, broken
                out = attempt(report, what, measure)
                if not out:
                    continue
                flops, geometry, first, median, measured, broken = out
                full = train_step_flops(whole.geometry(whole.config([f"memory.checkpointing={mode}"])), batch,
                                        *wf.latent_shape(shape), wf.caption[1]).model
                tflops = flops.model / median / 1e12
                hfu = flops.hardware / median / 1e12
                rows.append([family.label, f"{shape.label} x {shape.frames}", batch, tokens(wf, geometry, shape),
                             mode, "on" if compiled else "off", f"{median:.3f}", f"{first - median:.1f}",
                             f"{tflops:.1f}", f"{tflops / peak:.1%}" if peak else "n/a",
                             f"{hfu / peak:.1%}" if peak else "n/a", size(measured) if measured else "n/a",
                             size(predicted), f"{predicted / measured:.2f}" if measured else "n/a",
                             f"{median * full / flops.model:.2f}"])
                if broken:
                    shares.append([family.label, mode, "on" if compiled else "off", *broken.shares()])
                    if family.label not in tops or tflops > tops[family.label][0]:   # its fastest setting
                        tops[family.label] = (tflops, mode, compiled, broken)
    if rows:
        report.table("Families: speed at real width, one GPU" if not w.dry else "Families (dry run)",
                     ["family", "bucket", "batch", "tokens/sample", "checkpointing", "compile", "s/step",
                      "first-step extra s", "model TFLOP/s", "MFU", "HFU", "peak", "planner",
                      "planner / measured", "whole model s/step (FLOP-scaled)"], rows,
                     note=f"{'bf16 autocast' if w.bf16 else 'fp32'}, one device, the planner's largest batch "
                          f"(at most --max-batch {args.max_batch}); median of {steps} steps after {warmup}; peak "
                          f"{peak or 'unknown'} TFLOP/s. Wan 1.3B is the whole model; the others are a few "
                          "real-width blocks (model.depth overrides), scaled to the whole model by the FLOP model. "
                          "MFU = model FLOPs / s / peak; HFU adds checkpointing's recompute. Peak: "
                          + ("torch.cuda.max_memory_allocated over the timed steps." if w.device.type == "cuda"
                             else "state + LiveMemory peak (CPU; n/a compiled: dynamo does not trace under it)."))
    if shares:
        report.table("Families: where the step's device time goes", ["family", "checkpointing", "compile",
                     *CATEGORIES, "idle/launch gaps"], shares,
                     note="Share of one profiled step's wall time (torch.profiler) in each kind of kernel; idle: no "
                          "kernel running (launch gaps, host work, synchronisation). Kernels on several streams can "
                          "overlap, so the shares can add up to more than 100%."
                          + (" CPU: aten ops' self time stands in for kernels." if w.device.type != "cuda" else ""))
    for label, (_, mode, compiled, broken) in tops.items():
        report.table(f"Families: top kernels, {label} (checkpointing {mode}, compile {'on' if compiled else 'off'})",
                     ["kernel", "ms", "calls", "share of step"],
                     [[name[:90].replace("|", "/"), f"{us / 1e3:.2f}", calls, f"{us / broken.wall_us:.1%}"]
                      for name, us, calls in broken.top],
                     note="The fastest setting of the family (most model TFLOP/s); the 10 kernels with the most time "
                          "in one profiled step.")


def timed_with_peak(step: Step, warmup: int, steps: int, compiled: bool) -> tuple[float, float, int | None]:
    """(first step s, median step s, peak bytes over the timed steps): the warm-up steps compile and
    create the optimizer state before the peak is taken, as ``Step.peak_bytes`` does. On CPU the
    peak is the state plus LiveMemory's over one more step, None when compiled (dynamo does not
    trace under a dispatch mode)."""
    first, _ = step.timed(0, 1)
    for _ in range(warmup - 1):
        step()
    sync(step.device)
    if step.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        _, median = step.timed(0, steps)
        return first, median, torch.cuda.max_memory_allocated()
    _, median = step.timed(0, steps)
    if compiled:
        return first, median, None
    with LiveMemory() as tracker:
        step()
    return first, median, step.state_bytes() + tracker.peak
