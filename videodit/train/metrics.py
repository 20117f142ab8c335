"""Training metrics: one JSON object per logged step in metrics.jsonl, plus TensorBoard.

Metrics are not worth a run: a write that fails (a full disk) turns logging off and leaves
the one-line reason in ``error``, for the trainer to save a checkpoint and stop."""

from __future__ import annotations

import json
import time
from pathlib import Path

from videodit.errors import os_error_message


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool = True):
        self.run_dir = run_dir
        self.enabled = enabled
        self.error: str | None = None
        self._file = self._writer = None
        if enabled:
            self._guarded(self._open)

    def _open(self) -> None:
        self._file = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter
            self._writer = SummaryWriter(str(self.run_dir / "tensorboard"))
        except ImportError:   # tensorboard is a dependency; degrade rather than lose the run
            self._writer = None

    def log(self, step: int, values: dict) -> None:
        if self.enabled:
            self._guarded(self._write, step, values)

    def _write(self, step: int, values: dict) -> None:
        record = {"step": step, **values, "time": round(time.time(), 3)}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and key != "epoch":
                    self._writer.add_scalar(f"train/{key}", value, step)

    def _guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except OSError as exc:
            self.error = f"could not write the metrics in {self.run_dir}: {os_error_message(exc)}"
            self.close()

    def close(self) -> None:
        """Close the files; a failure to flush them is already reported by ``error``."""
        self.enabled = False
        for handle in (self._file, self._writer):
            try:
                if handle is not None:
                    handle.close()
            except OSError as exc:
                self.error = self.error or f"could not write the metrics in {self.run_dir}: {os_error_message(exc)}"
        self._file = self._writer = None


class Throughput:
    """Samples and model FLOPs per second over the steps since the last reading."""

    def __init__(self):
        self._start = time.perf_counter()
        self._samples = 0
        self._flops = 0.0

    def add(self, samples: int, flops: float = 0.0) -> None:
        self._samples += samples
        self._flops += flops

    def read(self) -> tuple[float, float]:
        """(samples/s, FLOP/s) since the last reading."""
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        rates = self._samples / elapsed, self._flops / elapsed
        self._start, self._samples, self._flops = now, 0, 0.0
        return rates


# Dense bf16 tensor-core peaks in TFLOP/s (no sparsity), by a substring of the device name;
# the first match wins, so the more specific names come first.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0), ("A100", 312.0),
               ("L40S", 362.0), ("4090", 165.2))


def peak_tflops(device_name: str | None, override: float = 0.0) -> float | None:
    """The peak MFU is measured against: ``train.peak_tflops`` if set, else the table's entry
    for this GPU, else None (a CPU, or a GPU not in the table: no MFU is reported)."""
    if override > 0:
        return override
    if not device_name:
        return None
    return next((peak for name, peak in PEAK_TFLOPS if name.lower() in device_name.lower()), None)
