"""Training metrics: one JSON object per logged step in metrics.jsonl, plus TensorBoard."""

from __future__ import annotations

import json
import time
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool = True):
        self.enabled = enabled
        self._writer = None
        if enabled:
            self._file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._writer = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:   # tensorboard is a dependency; degrade rather than lose the run
                self._writer = None

    def log(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **values, "time": round(time.time(), 3)}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and key != "epoch":
                    self._writer.add_scalar(f"train/{key}", value, step)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._writer is not None:
                self._writer.close()


class Throughput:
    """Samples per second over the steps since the last reading."""

    def __init__(self):
        self._start = time.perf_counter()
        self._samples = 0

    def add(self, samples: int) -> None:
        self._samples += samples

    def read(self) -> float:
        now = time.perf_counter()
        rate = self._samples / max(now - self._start, 1e-9)
        self._start, self._samples = now, 0
        return rate
