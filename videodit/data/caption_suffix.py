"""Open-Sora 2.0's caption suffixes: the frame rate and motion score its captions end with.

Training (``opensora/datasets/datasets.py`` ``getitem``) appends ``" {fps} FPS, {motion} motion
score."`` to each caption: the fps the sampled frames have, and the CSV column ``score_vmafmotion``
(VMAF motion) rounded half up; a part it cannot know is left out, and with neither nothing is
appended. Its sampler (``opensora/utils/inference.py``) writes the prompt differently: a final
period, then ``" {fps} FPS."`` (unless the prompt already ends so) and ``" {motion} motion score."``.
Both are reproduced here, each where Open-Sora applies it (``data.caption_suffix=opensora2`` and
``sample.prompt_style=opensora2``).
"""

from __future__ import annotations

import math
import re

MOTION_COLUMN = "score_vmafmotion"   # Open-Sora's metadata column
_ENDS_WITH_FPS = re.compile(r"\d+ FPS\.$")


def _number(value) -> float | None:
    """A finite float from a CSV cell or a Parquet value; None for empty, NaN or non-numbers."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def fps_text(fps: float) -> str:
    """24.0 -> "24", 23.976 -> "23.976" (Open-Sora prints its fps value as Python does)."""
    return f"{fps:g}"


def training_caption(caption: str, fps, motion) -> str:
    """``caption`` with Open-Sora 2.0's training suffix; ``fps``: of the frames the model sees,
    ``motion``: the row's motion score (None, NaN or empty: unknown)."""
    parts = []
    fps, motion = _number(fps), _number(motion)
    if fps is not None and fps > 0:
        parts.append(f"{fps_text(fps)} FPS")
    if motion is not None:
        parts.append(f"{int(motion + 0.5)} motion score")
    return f"{caption} {', '.join(parts)}." if parts else caption


def sampling_prompt(prompt: str, fps: float, motion: int | None) -> str:
    """``prompt`` as Open-Sora 2.0's sampler writes it (``add_fps_info_to_text``, then
    ``add_motion_score_to_text`` when a motion score is set)."""
    prompt = prompt.strip()
    if not prompt.endswith("."):
        prompt += "."
    if not _ENDS_WITH_FPS.search(prompt):
        prompt += f" {fps_text(fps)} FPS."
    return prompt if motion is None else f"{prompt} {motion} motion score."
