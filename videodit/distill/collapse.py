"""What a collapsing student looks like, measured on its sample clips (uint8 [N, T, H, W, 3]).

DMD is mode-seeking: a student can settle on one clip per prompt whatever the seed, or on clips
that barely move (users of step-distilled Wan LoRAs report slowed motion and near-zero seed
variance). Two numbers make both visible in the run's metrics, both in [0, 1] of the pixel range:

* ``sample_diversity``: the mean absolute difference between the clips of the same prompts from
  two seeds (0: every seed gives the same clip);
* ``sample_motion``: the mean absolute difference between successive frames (0: a still image).
"""

from __future__ import annotations

import numpy as np


def motion(clips: np.ndarray) -> float:
    """Mean |frame[t+1] - frame[t]| over the clips, in units of the pixel range."""
    if clips.shape[1] < 2:
        return 0.0
    return float(np.abs(np.diff(clips.astype(np.float32), axis=1)).mean() / 255)


def diversity(clips: np.ndarray, other_seed: np.ndarray) -> float:
    """Mean |clip - the same prompt's clip from another seed|, in units of the pixel range."""
    return float(np.abs(clips.astype(np.float32) - other_seed.astype(np.float32)).mean() / 255)


def collapse_metrics(clips: np.ndarray, other_seed: np.ndarray) -> dict[str, float]:
    return {"sample_diversity": round(diversity(clips, other_seed), 5), "sample_motion": round(motion(clips), 5)}
