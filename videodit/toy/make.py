"""Synthetic toy dataset: one coloured shape moving across a black frame.

Every clip is described by a three-word grammar, ``a {colour} {shape} moving
{direction}``. Six (colour, shape, direction) combinations (``HELDOUT``) never appear
in training, so a model that generates them correctly has learned to compose the
words rather than memorise clips. ``videodit.toy.metrics`` measures colour and
direction of generated clips to score exactly that.

Layout written by ``make_toy_dataset(out_dir)``::

    out_dir/train.csv      seen combinations only
    out_dir/val.csv        seen + held-out combinations, with a ``heldout`` column
    out_dir/videos/*.mp4   (and *.png when ``image_fraction > 0``)

With ``audio=True`` every mp4 also carries a stereo soundtrack (``videodit.toy.audio``):
a tone whose pitch names the colour and a click when the shape hits an edge. For that the
shape's motion ends against the edge it moves towards, at a frame in the second half of
the clip, and rests there; without ``audio`` the clips are exactly as before.

CSV columns follow Open-Sora: ``path,text,num_frames,height,width,aspect_ratio,fps``
with ``path`` relative to the CSV's folder and ``aspect_ratio = height / width``.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import numpy as np

from videodit.data.metadata import write_csv
from videodit.data.video import IMAGE_FPS
from videodit.data.video_write import write_video
from videodit.config import Config
from videodit.errors import UserError
from videodit.toy.audio import SAMPLE_RATE, ClipWithAudio, soundtrack
from videodit.toy.vocabulary import (COLOURS, DIRECTIONS, HELDOUT, SHAPES, all_combinations, caption,
                                     parse_caption, seen_combinations)

__all__ = [
    "COLOURS",
    "SHAPES",
    "DIRECTIONS",
    "HELDOUT",
    "CSV_COLUMNS",
    "caption",
    "parse_caption",
    "all_combinations",
    "seen_combinations",
    "render_clip",
    "render_clip_with_audio",
    "edge_hit_frames",
    "make_toy_dataset",
]

CSV_COLUMNS = ("path", "text", "num_frames", "height", "width", "aspect_ratio", "fps")

# (row step, column step) per direction: "up" decreases the row index, "left" the column.
_STEP = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}

# Radius is about min(H, W) / 6; travel is 40-50% of the frame along the motion axis.
_RADIUS_FRACTION = 1 / 6
_RADIUS_JITTER = (0.9, 1.1)
_TRAVEL_FRACTION = (0.40, 0.50)
_MIN_SIDE = 8  # smaller frames leave no room for a visible shape to move

_VAL_CLIPS_PER_SEEN = 2
_TOUCH_EPS = 1e-6  # px: a box this close to an edge touches it (the track's rounding)


# --------------------------------------------------------------------------- rendering


def render_clip(colour: str, shape: str, direction: str, num_frames: int,
                height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """Render one clip as uint8 ``[T, H, W, 3]``: a filled shape moving on black.

    The shape (radius ~ min(H, W)/6, jittered +-10%) travels 40-50% of the frame along
    the motion axis at constant speed, from a random start chosen so that it stays
    fully inside the frame in every frame. With ``num_frames == 1`` it is a still image
    of the shape at a random position.
    """
    _check_combo(colour, shape, direction)
    if num_frames < 1:
        raise UserError(f"num_frames={num_frames} must be at least 1")
    if min(height, width) < _MIN_SIDE:
        raise UserError(f"frame {height}x{width} is too small; use at least "
                        f"{_MIN_SIDE}x{_MIN_SIDE}")

    radius = _draw_radius(height, width, rng)
    centres = _centre_track(direction, num_frames, height, width, radius, rng)
    return _draw(colour, shape, centres, radius, height, width)


def render_clip_with_audio(colour: str, shape: str, direction: str, num_frames: int, height: int,
                           width: int, fps: float, rng: np.random.Generator) -> tuple[ClipWithAudio, np.ndarray]:
    """Render one clip that hits an edge, with its soundtrack; return it and the hit times (s).

    The shape moves as in ``render_clip`` but its track ends against the edge it moves
    towards, at a random frame of the second half of the clip, and stays there. The
    soundtrack (``videodit.toy.audio.soundtrack``) clicks at the hit times
    ``edge_hit_frames(...) / fps`` and pans with the shape's column.
    """
    _check_combo(colour, shape, direction)
    if num_frames < 2:
        raise UserError(f"num_frames={num_frames} must be at least 2 for a clip that hits an edge")
    if not fps > 0:
        raise UserError(f"fps={fps} must be positive; use e.g. fps=8")
    if min(height, width) < _MIN_SIDE:
        raise UserError(f"frame {height}x{width} is too small; use at least {_MIN_SIDE}x{_MIN_SIDE}")
    radius = _draw_radius(height, width, rng)
    hit_frame = int(rng.integers(max(1, -(-num_frames // 2)), num_frames))
    centres = _centre_track(direction, num_frames, height, width, radius, rng, hit_frame=hit_frame)
    frames = _draw(colour, shape, centres, radius, height, width)
    hit_times = edge_hit_frames(centres, radius, height, width) / fps
    waveform = soundtrack(colour, num_frames / fps, hit_times, pan=centres[:, 1] / width, rng=rng)
    return ClipWithAudio(frames, float(fps), waveform, SAMPLE_RATE), hit_times


def edge_hit_frames(centres: np.ndarray, radius: float, height: int, width: int) -> np.ndarray:
    """Frames in which the shape's box comes to touch an edge it did not touch the frame before.

    ``centres`` is a track ``[T, 2]`` (row, col) of a shape of ``radius``; the first frame
    is never a hit (nothing came before it).
    """
    sides = np.array([height, width], dtype=np.float64)
    touching = np.concatenate([centres - radius <= _TOUCH_EPS, centres + radius >= sides - _TOUCH_EPS], axis=1)
    return np.flatnonzero((touching[1:] & ~touching[:-1]).any(axis=1)) + 1


def _draw_radius(height: int, width: int, rng: np.random.Generator) -> float:
    return min(height, width) * _RADIUS_FRACTION * rng.uniform(*_RADIUS_JITTER)


def _draw(colour: str, shape: str, centres: np.ndarray, radius: float, height: int, width: int) -> np.ndarray:
    rows = np.arange(height, dtype=np.float64)[:, None] + 0.5  # pixel centres
    cols = np.arange(width, dtype=np.float64)[None, :] + 0.5
    frames = np.zeros((len(centres), height, width, 3), dtype=np.uint8)
    for t, (cy, cx) in enumerate(centres):
        frames[t][_shape_mask(shape, rows - cy, cols - cx, radius)] = COLOURS[colour]
    return frames


def _check_combo(colour: str, shape: str, direction: str) -> None:
    if colour not in COLOURS or shape not in SHAPES or direction not in DIRECTIONS:
        raise UserError(
            f"({colour!r}, {shape!r}, {direction!r}) is not in the toy grammar; colour in "
            f"{sorted(COLOURS)}, shape in {list(SHAPES)}, direction in {list(DIRECTIONS)}"
        )


def _centre_track(direction: str, num_frames: int, height: int, width: int,
                  radius: float, rng: np.random.Generator, hit_frame: int | None = None) -> np.ndarray:
    """Shape centres ``[T, 2]`` as (row, col), moving linearly and always in frame.

    Coordinates are continuous with pixel ``i`` spanning ``[i, i + 1)``, so the shape's
    bounding box ``[c - r, c + r]`` must lie within ``[0, side]``. With ``hit_frame`` the
    whole travel is done by that frame, ending with the box against the edge ahead.
    """
    step = np.array(_STEP[direction], dtype=np.float64)
    sides = np.array([height, width], dtype=np.float64)
    moving_axis = int(np.argmax(np.abs(step)))

    travel = 0.0
    if num_frames > 1:
        travel = sides[moving_axis] * rng.uniform(*_TRAVEL_FRACTION)
        travel = min(travel, sides[moving_axis] - 2 * radius)  # tiny frames: still fits

    # Free room for the start centre on each axis; the motion uses up `travel` of it.
    room = sides - 2 * radius
    room[moving_axis] -= travel
    start = radius + rng.uniform(0.0, 1.0, size=2) * room
    if step[moving_axis] < 0:
        start[moving_axis] += travel  # moving towards 0: start on the far side

    progress = np.linspace(0.0, 1.0, num_frames) if num_frames > 1 else np.zeros(1)
    if hit_frame is not None:
        # Travel done at hit_frame, ending on the edge ahead: radius from 0 or from the side.
        end = radius if step[moving_axis] < 0 else sides[moving_axis] - radius
        start[moving_axis] = end - travel * step[moving_axis]
        progress = np.minimum(np.arange(num_frames) / hit_frame, 1.0)
    return start[None, :] + progress[:, None] * travel * step[None, :]


def _shape_mask(shape: str, dy: np.ndarray, dx: np.ndarray, radius: float) -> np.ndarray:
    """Boolean ``[H, W]`` mask of pixels inside ``shape`` given offsets from its centre.

    All shapes fit the same ``2r x 2r`` box, so the in-frame guarantee is shape-free.
    """
    if shape == "circle":
        return dy**2 + dx**2 <= radius**2
    if shape == "square":
        return (np.abs(dy) <= radius) & (np.abs(dx) <= radius)
    if shape == "triangle":
        # Apex at the top centre, base along the bottom of the box.
        from_top = dy + radius
        return (from_top >= 0) & (dy <= radius) & (np.abs(dx) <= from_top / 2)
    raise UserError(f"shape {shape!r} is not one of {list(SHAPES)}")


# --------------------------------------------------------------------------- dataset


def make_toy_dataset(out_dir: str | os.PathLike, clips_per_combination: int = 10,
                     num_frames: int = 16, height: int = 32, width: int = 32,
                     fps: float = 8, seed: int = 0,
                     sizes: list[tuple[int, int]] | None = None,
                     image_fraction: float = 0.0, audio: bool = False) -> dict:
    """Write the toy dataset under ``out_dir`` and return a summary dict.

    * ``train.csv``: ``clips_per_combination`` clips of each of the 54 seen combinations.
    * ``val.csv``: 2 clips of each seen combination plus ``clips_per_combination // 2``
      of each held-out one, with an extra ``heldout`` column (``true``/``false``).
    * ``sizes``: optional list of ``(height, width)``; clips cycle through it (overrides
      ``height``/``width``). Sizes must be even because clips are H.264.
    * ``image_fraction``: this fraction of *training* clips is written as one-frame PNG
      images (``num_frames=1``, ``fps=IMAGE_FPS`` as in Open-Sora). Validation stays
      all-video because direction cannot be measured on a single frame.
    * ``audio``: every mp4 gets a soundtrack (tone by colour, click at the edge hit; see
      the module doc), made by ``render_clip_with_audio``. Images stay silent.

    The output is a pure function of the arguments: the same seed gives byte-identical
    CSVs and identical decoded frames. Returns ``{"train_csv", "val_csv", "num_train",
    "num_val", "num_videos", "num_images", "seconds"}``.
    """
    sizes = _check_dataset_args(clips_per_combination, num_frames, fps, sizes or [(height, width)],
                                image_fraction)
    start_time = time.perf_counter()
    out_dir = Path(out_dir)
    taken = [name for name in ("train.csv", "val.csv") if (out_dir / name).exists()]
    if taken:
        raise UserError(f"{out_dir} already holds {' and '.join(taken)}; make the toy dataset in a new folder "
                        "(nothing was written)")
    (out_dir / "videos").mkdir(parents=True, exist_ok=True)

    seen, heldout = seen_combinations(), list(HELDOUT)
    train_jobs = _split_jobs("train", [(c, False, clips_per_combination) for c in seen],
                             sizes, image_fraction)
    val_plan = ([(c, False, _VAL_CLIPS_PER_SEEN) for c in seen]
                + [(c, True, clips_per_combination // 2) for c in heldout])
    val_jobs = _split_jobs("val", val_plan, sizes, image_fraction=0.0)

    train_rows = [_write_clip(out_dir, job, num_frames, fps, seed, audio) for job in train_jobs]
    val_rows = [_write_clip(out_dir, job, num_frames, fps, seed, audio) for job in val_jobs]
    write_csv(out_dir / "val.csv", CSV_COLUMNS + ("heldout",), val_rows)
    write_csv(out_dir / "train.csv", CSV_COLUMNS, train_rows)   # last: its presence means the folder is whole

    all_rows = train_rows + val_rows
    num_images = sum(row["path"].endswith(".png") for row in all_rows)
    return {
        "train_csv": str(out_dir / "train.csv"),
        "val_csv": str(out_dir / "val.csv"),
        "num_train": len(train_rows),
        "num_val": len(val_rows),
        "num_videos": len(all_rows) - num_images,
        "num_images": num_images,
        "audio": bool(audio),
        "seconds": time.perf_counter() - start_time,
    }


def _check_dataset_args(clips_per_combination: int, num_frames: int, fps: float,
                        sizes: list[tuple[int, int]], image_fraction: float):
    if clips_per_combination < 1:
        raise UserError(f"clips_per_combination={clips_per_combination} must be at least 1")
    if num_frames < 2:
        raise UserError(f"num_frames={num_frames} must be at least 2 for a moving clip; "
                        "use image_fraction for still images")
    if not fps > 0:
        raise UserError(f"fps={fps} must be positive")
    if not 0.0 <= image_fraction <= 1.0:
        raise UserError(f"image_fraction={image_fraction} must be between 0 and 1")
    checked = []
    for size in sizes:
        h, w = (int(v) for v in size)
        if h % 2 or w % 2 or min(h, w) < _MIN_SIDE:
            raise UserError(f"size {h}x{w} is not usable: H.264 needs even sizes and "
                            f"shapes need at least {_MIN_SIDE}x{_MIN_SIDE}; use e.g. 32x32")
        checked.append((h, w))
    if not checked:
        raise UserError("sizes is empty; give at least one (height, width), e.g. [(32, 32)]")
    return checked


def _split_jobs(split: str, plan: list[tuple[tuple[str, str, str], bool, int]],
                sizes: list[tuple[int, int]], image_fraction: float) -> list[dict]:
    """Plan every clip of one split in a fixed order.

    ``plan`` lists ``(combination, heldout, number of clips)``; each job records the
    clip's name parts, its size (cycling through ``sizes``) and whether it is an image.
    """
    jobs = []
    for (colour, shape, direction), heldout, count in plan:
        for k in range(count):
            index = len(jobs)
            jobs.append({
                "split": split, "index": index, "k": k, "heldout": heldout,
                "colour": colour, "shape": shape, "direction": direction,
                "size": sizes[index % len(sizes)],
                # Decide images per round of sizes so images and videos both cover
                # every size (deciding on `index` would tie images to one size).
                "image": _is_image_slot(index // len(sizes), image_fraction),
            })
    return jobs


def _is_image_slot(index: int, fraction: float) -> bool:
    # Spreads images evenly (every 1/fraction-th clip) so the realised fraction is
    # exact up to rounding and does not depend on random draws.
    return int((index + 1) * fraction) > int(index * fraction)


def _write_clip(out_dir: Path, job: dict, num_frames: int, fps: float, seed: int, audio: bool = False) -> dict:
    """Render and write one planned clip (with a soundtrack when ``audio`` and a video); return its CSV row."""
    height, width = job["size"]
    frames_wanted = 1 if job["image"] else num_frames
    # One independent stream per clip, keyed by (seed, split, index): a clip does not
    # change when other clips or options (e.g. image_fraction) change around it.
    split_id = 0 if job["split"] == "train" else 1
    rng = np.random.default_rng([seed, split_id, job["index"]])
    combo = (job["colour"], job["shape"], job["direction"])
    sound = None
    if audio and not job["image"]:
        clip, _ = render_clip_with_audio(*combo, frames_wanted, height, width, fps, rng)
        frames, sound = clip.frames, (clip.waveform, clip.sample_rate)
    else:
        frames = render_clip(*combo, frames_wanted, height, width, rng)

    suffix = ".png" if job["image"] else ".mp4"
    stem = "_".join((job["split"], job["colour"], job["shape"], job["direction"]))
    name = f"{stem}_{job['k']:03d}{suffix}"
    write_video(out_dir / "videos" / name, frames, fps, audio=sound)

    row = {
        "path": f"videos/{name}",
        "text": caption(job["colour"], job["shape"], job["direction"]),
        "num_frames": frames_wanted,
        "height": height,
        "width": width,
        "aspect_ratio": height / width,  # Open-Sora's convention
        "fps": IMAGE_FPS if job["image"] else float(fps),
    }
    if job["split"] == "val":
        row["heldout"] = "true" if job["heldout"] else "false"
    return row


TOY_FOLDER_PREFIX = "videodit-toy"   # the toy presets' data folders: videodit-toy, videodit-toy-buckets, ...


def ensure_toy_data(cfg: Config) -> None:
    """Generate the toy dataset for a toy config: its CSV is a missing ``train.csv`` in a
    ``videodit-toy*`` folder. Any other missing CSV is a mistake to report, not to paper over
    with toy data (``read_metadata`` names it)."""
    csv = Path(cfg.data.csv)
    if (csv.exists() or not cfg.data.make_toy_if_missing or csv.name != "train.csv"
            or not csv.parent.name.startswith(TOY_FOLDER_PREFIX)):
        return
    csv.parent.mkdir(parents=True, exist_ok=True)
    with open(csv.parent / ".generating.lock", "w") as lock:
        # torchrun's ranks all get here: one generates, the others wait for it and find train.csv.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if csv.exists():
            return
        print(f"generating the toy dataset in {csv.parent} ...", flush=True)
        toy = cfg.toy
        make_toy_dataset(csv.parent, clips_per_combination=toy.clips_per_combination, num_frames=toy.num_frames,
                         fps=toy.fps, sizes=[tuple(size) for size in toy.sizes],
                         image_fraction=toy.image_fraction, seed=cfg.train.seed,
                         audio=cfg.model.train_audio)   # a run that trains sound gets soundtracks
