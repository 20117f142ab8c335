"""``videodit tune``: find each bucket's largest batch size on the real GPU.

For every (resolution, num_frames) bucket at its worst aspect ratio: a few training steps
per trial batch size with the real Trainer (model, parallelism, levers, optimizer), an
out-of-memory error counts as "does not fit" and is recovered from, and a batch also fails
when its peak (``torch.cuda.max_memory_allocated``) leaves less than the margin free.
"""

from __future__ import annotations

import gc
import tempfile
from dataclasses import dataclass
from typing import Iterator

import torch

from videodit.config import Config
from videodit.planner.measure import synthetic_batch
from videodit.planner.plan import BucketFit, Planner
from videodit.planner.tune import Trial, search_max_batch
from videodit.train.trainer import Trainer


class GpuTrials:
    """Runs trial steps of one Trainer at chosen batch shapes and recovers from OOM."""

    def __init__(self, trainer, steps: int, budget_bytes: float):
        self.trainer, self.steps, self.budget = trainer, steps, budget_bytes
        self.log: list[tuple[str, Trial]] = []

    def fits(self, label: str, batch: int, num_frames: int, height: int, width: int) -> bool:
        trainer = self.trainer
        self._clean()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        try:
            data = synthetic_batch(batch, num_frames, height, width, trainer.cfg.sample.fps)
            start.record()
            for _ in range(self.steps):
                trainer.train_step([data])
            end.record()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            trial = Trial(batch, peak <= self.budget, peak, start.elapsed_time(end) / 1000 / self.steps)
        except torch.cuda.OutOfMemoryError:
            trial = Trial(batch, False, torch.cuda.max_memory_allocated(), float("nan"))
        self._clean()
        self.log.append((label, trial))
        return trial.fits

    def _clean(self) -> None:
        self.trainer.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()


@dataclass
class TunedBucket:
    fit: BucketFit                 # its batch sizes set to the tuned maximum
    planned_max: int
    best: Trial | None             # the largest trial that fitted
    predicted_peak: float


def tune_buckets(cfg: Config, planner: Planner, fits: list[BucketFit], steps: int) -> Iterator[TunedBucket]:
    """Search each bucket's largest batch on this GPU with a Trainer built from ``cfg``;
    yields one result per bucket as soon as it is known."""
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir)
        trials = GpuTrials(trainer, steps, planner.budget)
        try:
            for p in fits:
                label = f"{p.resolution}/{p.num_frames}"
                p.max_batch_size = search_max_batch(
                    lambda b: trials.fits(label, b, p.num_frames, p.height, p.width),
                    start=max(p.max_batch_size, 1), multiple=planner.batch_multiple)
                p.batch_size = p.max_batch_size
                best = max((t for name, t in trials.log if name == label and t.fits), key=lambda t: t.batch,
                           default=None)
                yield TunedBucket(p, planner.max_batch(p.num_frames, p.height, p.width), best,
                                  planner.estimate(max(p.batch_size, 1), p.num_frames, p.height, p.width).peak)
        finally:
            trainer.ctx.close()
