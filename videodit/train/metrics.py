"""Training metrics and sample videos, handed to the loggers of ``train.loggers``
(``train/loggers.py``: metrics.jsonl, always; TensorBoard; Weights & Biases), on rank 0 only.

Metrics are not worth a run: a write that fails (a full disk) turns logging off and leaves
the one-line reason in ``error``, for the trainer to save a checkpoint and stop."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from videodit.errors import os_error_message
from videodit.train.loggers import JsonlLogger, LoggerFailed, SampleVideo, TensorBoardLogger


class MetricsLogger:
    def __init__(self, run_dir: Path, enabled: bool = True, loggers: Sequence[str] = ("tensorboard", "jsonl"),
                 config: dict | None = None, resuming: bool = False):
        """``config``: the resolved config (as config.yaml holds it) for W&B; ``resuming``: the run
        continues from a checkpoint, so W&B continues the W&B run kept in the run folder."""
        self.run_dir = run_dir
        self.enabled = enabled
        self.error: str | None = None
        self._loggers: list = []
        if enabled:
            self._guarded(self._open, list(loggers), config or {}, resuming)

    def _open(self, names: list[str], config: dict, resuming: bool) -> None:
        """jsonl always, first; if a logger fails to open, those already open are closed again."""
        self._loggers = [JsonlLogger(self.run_dir)]
        try:
            if "tensorboard" in names:
                try:
                    self._loggers.append(TensorBoardLogger(self.run_dir))
                except ImportError:   # tensorboard is a dependency; degrade rather than lose the run
                    print("note: tensorboard is not installed; metrics go to metrics.jsonl only", file=sys.stderr)
            if "wandb" in names:
                from videodit.train.wandb_logger import WandbLogger
                self._loggers.append(WandbLogger(self.run_dir, config=config, resuming=resuming))
        except BaseException:
            for logger in self._loggers:
                with contextlib.suppress(OSError, LoggerFailed):   # the failure to open is the one to report
                    logger.close()
            self._loggers = []
            raise

    def log(self, step: int, values: dict) -> None:
        if self.enabled:
            self._guarded(self._each, "log", step, values)

    def log_samples(self, step: int, prompts: list[str], clips: np.ndarray, paths: list[Path], fps: float,
                    sounds: Sequence[tuple[np.ndarray, int] | None] | None = None) -> None:
        """The sample clips of ``step`` (uint8 [N, T, H, W, 3]), the files they were written to and,
        in an audio-trained run, each clip's soundtrack (waveform [channels, samples], rate) or None."""
        if self.enabled:
            sounds = sounds or [None] * len(paths)
            videos = [SampleVideo(prompt, clip, path, fps, sound)
                      for prompt, clip, path, sound in zip(prompts, clips, paths, sounds)]
            self._guarded(self._each, "log_videos", step, videos)

    def _each(self, method: str, *args) -> None:
        for logger in self._loggers:
            getattr(logger, method)(*args)

    def _guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except (OSError, LoggerFailed) as exc:
            self._failed(exc)
            self.close()

    def close(self) -> None:
        """Close the loggers; a failure to flush them is already reported by ``error``."""
        self.enabled = False
        for logger in self._loggers:
            try:
                logger.close()
            except (OSError, LoggerFailed) as exc:
                self._failed(exc)
        self._loggers = []

    def _failed(self, exc: OSError | LoggerFailed) -> None:
        if self.error is None:   # the first failure is the cause; later ones follow from it
            why = os_error_message(exc) if isinstance(exc, OSError) else str(exc)
            self.error = f"could not write the metrics in {self.run_dir}: {why}"


class Throughput:
    """Samples and model FLOPs per second over the steps since the last reading, and the share of
    that time the loop sat waiting for its next batch (the device idles then: a step ends on the
    loss read back, so nothing is queued while the loop waits)."""

    def __init__(self):
        self._start = time.perf_counter()
        self._samples = 0
        self._flops = 0.0
        self._waited = 0.0

    def add(self, samples: int, flops: float = 0.0, waited: float = 0.0) -> None:
        self._samples += samples
        self._flops += flops
        self._waited += waited

    def read(self) -> tuple[float, float, float]:
        """(samples/s, FLOP/s, fraction of the time spent waiting for data) since the last reading."""
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        rates = self._samples / elapsed, self._flops / elapsed, min(1.0, self._waited / elapsed)
        self._start, self._samples, self._flops, self._waited = now, 0, 0.0, 0.0
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


def significant(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant digits: TFLOP/s of a tiny CPU model are ~1e-5."""
    return float(f"{value:.{digits}g}")
