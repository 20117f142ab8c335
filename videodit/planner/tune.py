"""``videodit tune``: find each bucket's largest batch size on the real GPU.

For every (resolution, num_frames) bucket at its worst aspect ratio: a few training steps
per trial batch size with the real Trainer (model, parallelism, levers, optimizer), an
out-of-memory error counts as "does not fit" and is recovered from, and a batch also fails
when its peak (``torch.cuda.max_memory_allocated``) leaves less than the margin free. The
search doubles from the planner's prediction until a trial fails, then bisects.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable

import torch

from videodit.errors import UserError
from videodit.planner.measure import synthetic_batch
from videodit.planner.plan import MAX_BATCH


def search_max_batch(fits: Callable[[int], bool], start: int = 1, limit: int = MAX_BATCH, multiple: int = 1) -> int:
    """The largest multiple of ``multiple`` up to ``limit`` for which ``fits`` holds (it must hold
    below some size and fail above it); 0 if even ``multiple`` fails. ``start`` is a first guess."""
    top = limit // multiple
    if top < 1 or not fits(multiple):
        return 0
    low, high = 1, None                     # in units of `multiple`: low fits, high fails
    guess = min(max(1, start // multiple), top)
    if guess > 1:
        if fits(guess * multiple):
            low = guess
        else:
            high = guess
    while high is None:                     # double until something fails (or the limit)
        if low == top:
            return low * multiple
        probe = min(low * 2, top)
        if fits(probe * multiple):
            low = probe
        else:
            high = probe
    while high - low > 1:                   # then bisect
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * multiple) else (low, mid)
    return low * multiple


@dataclass
class Trial:
    batch: int
    fits: bool
    peak_bytes: int
    step_seconds: float


def require_gpu() -> None:
    if not torch.cuda.is_available():
        raise UserError("videodit tune measures on a CUDA GPU and none is visible; run it on the training machine, "
                        "or use `videodit plan CONFIG --gpu-mem SIZE` for a prediction without a GPU")


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
