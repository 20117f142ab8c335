"""The GPU suite's output: markdown tables as they are measured, and the "Not measured" table
that lists every measurement a failure, an OOM or the time budget left out, with its reason."""

from __future__ import annotations

import os
import platform
import time
import traceback
from dataclasses import dataclass, field
from datetime import date

import torch

from suite.workload import GiB, Workload, free_memory


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


def attempt(report: Report, what: str, fn, clean: bool = True):
    """Run one measurement; an OOM or any failure becomes a 'not measured' line. ``clean``: free
    memory and compiled graphs after it (not for a part of a measurement that goes on)."""
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
        if clean:
            free_memory()
    return None



def remaining(args) -> float:
    return args.budget_minutes * 60 - (time.perf_counter() - args.start)


def report_out_of_time(report: Report, what: str, args) -> bool:
    if remaining(args) > 0:
        return False
    report.skip(what, f"the time budget (--budget-minutes {args.budget_minutes:g}) was spent")
    return True



def size(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.1f} MiB"

