"""Measure colour and motion direction of (generated) toy clips.

This is the evaluation instrument for the toy dataset (``videodit.toy.make``): it must
read the colour and direction of real clips essentially perfectly, so that errors on
generated clips are the model's, not the ruler's.

Object pixels are those whose brightest channel exceeds ``OBJECT_THRESHOLD``; the
background is black. Two details make the colour robust to H.264 at 32x32:

* yuv420p stores chroma at half resolution, so pixels on a shape's edge get colours
  blended with black (a red edge may read ``(117, 53, 54)``, a yellow edge
  ``(232, 230, 168)``, i.e. almost white). We therefore take the per-channel *median*
  over object pixels, which the many interior pixels dominate, not the mean.
* Each pixel is first rescaled so its brightest channel is 255. That compares hue
  rather than brightness, so a dim generated red still reads as red, and it separates
  yellow from white by the blue channel alone.

Soundtracks (``make_toy_dataset(..., audio=True)``) are judged by ``audio_pitch_correct``
and ``audio_timing_score`` (defined in ``videodit.toy.audio``, re-exported here); the hits a
clip's own frames imply come from ``hit_frames``.
"""

from __future__ import annotations

import numpy as np

from videodit.toy.audio import audio_pitch_correct, audio_timing_score
from videodit.toy.vocabulary import COLOURS

__all__ = [
    "OBJECT_THRESHOLD",
    "dominant_colour",
    "motion_direction",
    "measure_clip",
    "hit_frames",
    "audio_pitch_correct",
    "audio_timing_score",
    "score",
]

OBJECT_THRESHOLD = 96
_MIN_OBJECT_PIXELS = 8  # fewer pixels over the whole clip: nothing was drawn
_MIN_FRAME_PIXELS = 3  # fewer in one frame: the object is not visible in it
_MIN_VISIBLE_FRACTION = 0.5  # of frames, for a trustworthy motion estimate
_MIN_TRAVEL_PX = 1.5  # total displacement below this counts as "not moving"
_EDGE_BAND_PX = 2  # rim pixels in the outermost two rows/columns touch that edge

_COLOUR_NAMES = tuple(COLOURS)
_COLOUR_TABLE = np.array([COLOURS[name] for name in _COLOUR_NAMES], dtype=np.float64)


def _object_mask(frames: np.ndarray) -> np.ndarray:
    """Boolean ``[T, H, W]``: pixels bright enough to belong to the object."""
    return frames.max(axis=-1) > OBJECT_THRESHOLD


def _as_clip(frames: np.ndarray) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.ndim == 3:  # a single [H, W, 3] image
        frames = frames[None]
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must have shape [T, H, W, 3], got {list(frames.shape)}")
    return frames


def dominant_colour(frames: np.ndarray) -> str | None:
    """Name of the object's colour (a key of ``COLOURS``), or None if nothing is visible.

    ``frames`` is uint8 ``[T, H, W, 3]`` RGB on a dark background.
    """
    frames = _as_clip(frames)
    pixels = frames[_object_mask(frames)].astype(np.float64)  # [N, 3]
    if len(pixels) < _MIN_OBJECT_PIXELS:
        return None
    # Normalise brightness per pixel, then take the robust centre (see module doc).
    hue = pixels * (255.0 / pixels.max(axis=1, keepdims=True))
    centre = np.median(hue, axis=0)
    distances = np.linalg.norm(_COLOUR_TABLE - centre, axis=1)
    return _COLOUR_NAMES[int(np.argmin(distances))]


def motion_direction(frames: np.ndarray) -> str | None:
    """``"left"``, ``"right"``, ``"up"`` or ``"down"``, or None if no clear motion.

    Fits a least-squares line to the object's centroid over time on each axis; the
    axis with the larger |slope| decides and its sign gives the direction ("up" is
    decreasing row index). Returns None when the object is visible in fewer than half
    of the frames (or two), or when it travels less than 1.5 pixels in total.
    """
    frames = _as_clip(frames)
    times, rows, cols = _centroid_track(_object_mask(frames))
    needed = max(2, int(np.ceil(_MIN_VISIBLE_FRACTION * len(frames))))
    if len(times) < needed:
        return None

    row_slope = np.polyfit(times, rows, 1)[0]
    col_slope = np.polyfit(times, cols, 1)[0]
    span = times[-1] - times[0]
    if abs(col_slope) >= abs(row_slope):
        slope, direction = col_slope, ("right" if col_slope > 0 else "left")
    else:
        slope, direction = row_slope, ("down" if row_slope > 0 else "up")
    if abs(slope) * span < _MIN_TRAVEL_PX:
        return None
    return direction


def _centroid_track(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Frame indices where the object is visible, and its centroid (row, col) there."""
    counts = mask.sum(axis=(1, 2))
    visible = np.flatnonzero(counts >= _MIN_FRAME_PIXELS)
    row_index = np.arange(mask.shape[1], dtype=np.float64)
    col_index = np.arange(mask.shape[2], dtype=np.float64)
    rows = mask[visible].sum(axis=2) @ row_index / counts[visible]
    cols = mask[visible].sum(axis=1) @ col_index / counts[visible]
    return visible.astype(np.float64), rows, cols


def hit_frames(frames: np.ndarray) -> np.ndarray:
    """The frame (as a 0- or 1-element int array) in which the object hits an edge.

    The toy world's physics (``make_toy_dataset(..., audio=True)``): the shape moves at a
    constant speed until it touches the edge ahead and rests there. So the hit is the knee
    of the centroid's track along the axis of motion, fitted as ``a + b * min(t, k)`` by
    least squares over every ``k`` (robust to sub-pixel speeds and H.264's blurred rims,
    where pixel tests are off by several frames), and it counts only when the object moved
    towards an edge (at least 1.5 pixels) and touches it in the last frame. On real toy
    clips it finds the generator's hit frame, rarely one frame off.
    """
    frames = _as_clip(frames)
    times, rows, cols = _centroid_track(_object_mask(frames))
    needed = max(3, int(np.ceil(_MIN_VISIBLE_FRACTION * len(frames))))
    if len(times) < needed:
        return np.zeros(0, dtype=np.int64)
    row_slope, col_slope = np.polyfit(times, rows, 1)[0], np.polyfit(times, cols, 1)[0]
    horizontal = abs(col_slope) >= abs(row_slope)
    track = cols if horizontal else rows
    fits = [_knee_fit(times, track, knee) for knee in range(1, int(times[-1]) + 1)]
    _, knee, slope = min(fits, key=lambda fit: fit[0])
    if abs(slope) * (knee - times[0]) < _MIN_TRAVEL_PX:
        return np.zeros(0, dtype=np.int64)
    # The edge ahead, in the last frame; the shape's rim, dimmed by chroma subsampling,
    # counts at half the object threshold.
    rim = frames[-1].max(axis=-1) > OBJECT_THRESHOLD / 2
    band = slice(-_EDGE_BAND_PX, None) if slope > 0 else slice(0, _EDGE_BAND_PX)
    touching = rim[:, band].any() if horizontal else rim[band, :].any()
    return np.array([knee] if touching else [], dtype=np.int64)


def _knee_fit(times: np.ndarray, track: np.ndarray, knee: int) -> tuple[float, int, float]:
    """``(squared error, knee, slope)`` of ``track ~ a + slope * min(times, knee)``."""
    design = np.stack([np.ones_like(times), np.minimum(times, knee)], axis=1)
    coef = np.linalg.lstsq(design, track, rcond=None)[0]
    return float(((design @ coef - track) ** 2).sum()), knee, float(coef[1])


def measure_clip(frames: np.ndarray) -> dict:
    """``{"colour": dominant_colour(frames), "direction": motion_direction(frames)}``."""
    return {"colour": dominant_colour(frames), "direction": motion_direction(frames)}


def score(results: list[dict]) -> dict:
    """Accuracy of predicted colour and direction, overall and split seen/held-out.

    Each result holds the targets ``colour`` and ``direction``, the measurements
    ``pred_colour`` and ``pred_direction`` (None counts as wrong) and ``heldout``
    (bool, or the ``"true"``/``"false"`` text of val.csv). Returns
    ``{"colour_accuracy", "direction_accuracy", "n", "seen": {...}, "heldout": {...}}``
    where the groups have the same three keys. Accuracies of an empty group are None
    (not NaN, so the dict stays valid JSON).
    """
    summary = _accuracies(results)
    summary["seen"] = _accuracies([r for r in results if not _is_heldout(r["heldout"])])
    summary["heldout"] = _accuracies([r for r in results if _is_heldout(r["heldout"])])
    return summary


def _is_heldout(value) -> bool:
    # val.csv stores the flag as the text "true"/"false"; accept that as well as bools.
    if isinstance(value, str):
        return value.strip().lower() == "true"
    return bool(value)


def _accuracies(results: list[dict]) -> dict:
    n = len(results)
    if n == 0:
        return {"colour_accuracy": None, "direction_accuracy": None, "n": 0}
    colour_hits = sum(r["pred_colour"] == r["colour"] for r in results)
    direction_hits = sum(r["pred_direction"] == r["direction"] for r in results)
    return {"colour_accuracy": colour_hits / n, "direction_accuracy": direction_hits / n, "n": n}
