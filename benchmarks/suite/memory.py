"""The GPU suite's memory sections on the XL workload: the planner's prediction against the
measured peak, ``videodit tune``'s batch search against the planner's, and the activation levers."""

from __future__ import annotations

from videodit.planner.plan import MAX_BATCH
from videodit.planner.tune import search_max_batch

from suite.report import OutOfTime, Report, attempt, remaining, report_out_of_time, size
from suite.step import Step, trial_peak
from suite.workload import GiB, Workload, planner_for, precision, single_context, tokens

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

