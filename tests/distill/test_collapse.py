"""The collapse metrics of a student's samples: seed diversity and motion."""

import numpy as np
import pytest

from videodit.distill.collapse import collapse_metrics


@pytest.mark.parametrize("case", ["same clip for both seeds", "still frames", "moving, varied"])
def test_collapse_metrics_read_zero_exactly_where_the_student_collapsed(case):
    rng = np.random.default_rng(0)
    clips = rng.integers(0, 256, (2, 4, 8, 8, 3), dtype=np.uint8)
    other = rng.integers(0, 256, clips.shape, dtype=np.uint8)
    if case == "same clip for both seeds":
        other = clips.copy()
    if case == "still frames":
        clips = np.repeat(clips[:, :1], 4, axis=1)
    got = collapse_metrics(clips, other)
    assert (got["sample_diversity"] == 0) == (case == "same clip for both seeds")
    assert (got["sample_motion"] == 0) == (case == "still frames")
    # uniform random pixels differ by a third of the range on average
    assert got["sample_diversity"] in (0, pytest.approx(1 / 3, abs=0.02))
