"""The search behind ``videodit tune``: the largest batch size for which a trial fits.

The search doubles from the planner's prediction until a trial fails, then bisects. The
trials themselves run the real Trainer on the GPU (``train/tune.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from videodit.errors import UserError
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
