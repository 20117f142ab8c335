"""Bucket assignment: the flat bucket table, and which bucket each clip lands in.

``assign_buckets`` puts every clip (num_frames, height, width) into one bucket, or drops it,
following Open-Sora 1.2's ``Bucket.get_bucket_id`` rule for rule; it is vectorized over
numpy arrays. ``assign_buckets_reference`` (``reference.py``) is the same rules written row
by row. The rules, worked examples and every deliberate difference from Open-Sora are in
``docs/buckets.md``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from videodit.data.buckets.config import (BucketConfig, BucketEntry, is_int, parse_bucket_config,
                                          short_repr)
from videodit.data.buckets.hashing import GATE, KEEP, row_hashes, uniform_np
from videodit.data.buckets.tables import ASPECT_RATIOS, RESOLUTION_PIXELS
from videodit.errors import UserError


class DropReason(enum.IntEnum):
    """Why a row has no bucket; a row keeps the furthest stage it reached anywhere."""

    KEPT = 0
    BELOW_EVERY_RESOLUTION = 1
    NO_IMAGE_BUCKET = 2
    NO_VIDEO_BUCKET = 3
    TOO_SHORT = 4
    FRAME_DRAW = 5
    ZERO_KEEP_PROB = 6
    KEEP_DRAW = 7


DROP_REASON_TEXT: dict[DropReason, str] = {
    DropReason.KEPT: "assigned to a bucket",
    DropReason.BELOW_EVERY_RESOLUTION:
        "below every resolution (height x width < 0.8 x the smallest configured resolution)",
    DropReason.NO_IMAGE_BUCKET:
        "image, but no resolution it reaches has a num_frames=1 entry",
    DropReason.NO_VIDEO_BUCKET:
        "video, but no resolution it reaches has a num_frames > 1 entry",
    DropReason.TOO_SHORT:
        "too short for every frame count (needs num_frames > bucket frames x frame_interval)",
    DropReason.FRAME_DRAW:
        "skipped by the p_frames draw of every frame count it fits",
    DropReason.ZERO_KEEP_PROB:
        "only reached entries with keep probability 0, e.g. (0.0, None)",
    DropReason.KEEP_DRAW:
        "lost the keep-probability draw at every resolution it reached",
}


class Bucket(NamedTuple):
    """One cell of the flat bucket table: clips in it are resized to (num_frames, height, width)."""

    resolution: str
    num_frames: int
    ratio: str
    height: int
    width: int
    batch_size: int


@dataclass(frozen=True)
class Assignment:
    """Per-row result of ``assign_buckets``.

    bucket: (N,) int32 index into ``buckets``, -1 where the row is dropped.
    reason: (N,) int8 ``DropReason`` code, 0 (KEPT) where the row has a bucket.
    buckets: the flat table, in Open-Sora's order (resolution, num_frames, ratio).
    """

    bucket: np.ndarray
    reason: np.ndarray
    buckets: tuple[Bucket, ...]

    @property
    def kept(self) -> np.ndarray:
        return self.bucket >= 0

    def bucket_counts(self) -> np.ndarray:
        """Rows per bucket, aligned with ``buckets``."""
        return np.bincount(self.bucket[self.kept], minlength=len(self.buckets))

    def reason_counts(self) -> dict[DropReason, int]:
        counts = np.bincount(self.reason, minlength=len(DropReason))
        return {r: int(counts[r]) for r in DropReason if counts[r]}

    def target_sizes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(num_frames, height, width) each row is resized to; -1 where dropped."""
        table = np.array([(b.num_frames, b.height, b.width) for b in self.buckets] + [(-1, -1, -1)],
                         dtype=np.int64)
        sizes = table[self.bucket]  # -1 picks the sentinel row appended last
        return sizes[:, 0], sizes[:, 1], sizes[:, 2]

    def summary(self) -> str:
        """A few lines for users: kept count and each drop reason."""
        n = len(self.bucket)
        used = int((self.bucket_counts() > 0).sum())
        lines = [f"kept {int(self.kept.sum()):,} of {n:,} rows in {used} of {len(self.buckets)} buckets"]
        for r, count in self.reason_counts().items():
            if r != DropReason.KEPT:
                lines.append(f"  dropped {count:,} ({100 * count / n:.1f}%): {DROP_REASON_TEXT[r]}")
        return "\n".join(lines)


def build_buckets(config: Any) -> tuple[Bucket, ...]:
    """The flat bucket table: every entry with keep probability > 0, times its ratios."""
    return bucket_table(parse_bucket_config(config))[0]


def bucket_table(cfg: BucketConfig) -> tuple[tuple[Bucket, ...], dict[tuple[str, int], int]]:
    """Buckets, and the index of each (resolution, num_frames) entry's first bucket."""
    buckets: list[Bucket] = []
    first: dict[tuple[str, int], int] = {}
    for e in cfg.entries:
        if e.keep_prob == 0.0:  # unreachable: nothing can land there
            continue
        first[(e.resolution, e.num_frames)] = len(buckets)
        for key, (h, w) in ASPECT_RATIOS[e.resolution].items():
            buckets.append(Bucket(e.resolution, e.num_frames, key, h, w, e.batch_size))
    return tuple(buckets), first


def _int_column(name: str, values: Any) -> np.ndarray:
    a = np.asarray(values)
    if a.ndim != 1:
        raise UserError(f"{name} must be a 1-D array of integers, got shape {a.shape}; "
                        "pass one value per row")
    if a.dtype.kind in "iu":
        return a.astype(np.int64, copy=False)
    if a.dtype.kind == "O":  # e.g. pandas nullable ints: missing values become NaN below
        try:
            a = np.array([np.nan if v is None or v != v else v for v in a], dtype=np.float64)
        except (TypeError, ValueError):
            raise UserError(f"{name} must be integers, got values such as {short_repr(a[:3].tolist())}; "
                            "convert the metadata column") from None
    if a.dtype.kind == "f":
        bad = ~np.isfinite(a) | (a != np.round(a))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise UserError(f"{name} has {int(bad.sum())} missing or non-integer values "
                            f"(first at row {i}: {a[i].item()!r}); fix or drop those metadata rows")
        return a.astype(np.int64)
    raise UserError(f"{name} must be integers, got dtype {a.dtype}; convert the metadata column")


_MAX_SIDE = 2**31 - 1


def validated_rows(num_frames: Any, heights: Any, widths: Any,
                   sample_ids: Any) -> tuple[np.ndarray, ...]:
    """(num_frames, heights, widths, sample_ids) as int64 arrays of one length, or a UserError
    naming the bad column and its first bad row."""
    cols = {"num_frames": num_frames, "heights": heights, "widths": widths}
    arrays = {name: _int_column(name, v) for name, v in cols.items()}
    n = len(arrays["num_frames"])
    ids = np.arange(n, dtype=np.int64) if sample_ids is None else _int_column("sample_ids", sample_ids)
    arrays["sample_ids"] = ids
    for name, a in arrays.items():
        if len(a) != n:
            raise UserError(f"{name} has {len(a)} rows but num_frames has {n}; "
                            "pass equal-length columns")
    for name in cols:
        # The cap keeps height x width inside int64 and ratios far from float ties.
        bad = (arrays[name] < 1) | (arrays[name] > _MAX_SIDE)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise UserError(f"{name} has {int(bad.sum())} values outside [1, {_MAX_SIDE}] "
                            f"(first at row {i}: {int(arrays[name][i])}); "
                            "fix or drop those metadata rows")
    return arrays["num_frames"], arrays["heights"], arrays["widths"], ids


def check_stream_args(seed: Any, epoch: Any, frame_interval: Any) -> None:
    """Raise a UserError unless seed, epoch and frame_interval are usable integers."""
    if not is_int(seed):
        raise UserError(f"seed must be an integer, got {seed!r}; pass e.g. seed=42")
    if not is_int(epoch) or epoch < 0:
        raise UserError(f"epoch must be an integer >= 0, got {epoch!r}; pass the epoch number")
    if not is_int(frame_interval) or frame_interval < 1:
        raise UserError(f"frame_interval must be an integer >= 1, got {frame_interval!r}; "
                        "use 1 to take consecutive frames")


def _nearest_ratio(ratios: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Index of the closest of the ascending ``keys`` for each ratio; ties take the lower
    (first) key, as Python's min over the table does. Only the two neighbouring keys can
    be closest: distances to the keys on one side are monotone, and with sides below 2**31
    rounding cannot make two of those distances equal (keys are 0.01 apart)."""
    hi = np.searchsorted(keys, ratios).clip(0, len(keys) - 1)
    lo = (hi - 1).clip(0, None)
    closer_hi = np.abs(keys[hi] - ratios) < np.abs(keys[lo] - ratios)
    return np.where(closer_hi, hi, lo)


class _Progress:
    """How far each row got, as one "reached" mask per DropReason; the final reason of a
    dropped row is the furthest stage it reached at any resolution. OR-ing masks is far
    cheaper than a running elementwise max."""

    def __init__(self, n: int):
        self.reached = {r: np.zeros(n, dtype=bool) for r in DropReason if r > DropReason.KEPT}

    def mark(self, where: np.ndarray, reason: DropReason) -> None:
        """Record ``reason`` for rows in ``where`` (a boolean mask or positions)."""
        if where.dtype == bool:
            self.reached[reason] |= where
        else:
            self.reached[reason][where] = True

    def reasons(self, unassigned: np.ndarray) -> np.ndarray:
        out = np.where(unassigned, np.int8(DropReason.BELOW_EVERY_RESOLUTION), np.int8(0))
        for reason, mask in self.reached.items():  # ascending, so later stages overwrite
            out[mask & unassigned] = reason
        return out.astype(np.int8)


def _length_levels(frames: np.ndarray, cfg: BucketConfig,
                   frame_interval: int) -> tuple[np.ndarray, list[int]]:
    """Each row's length as a small integer: how many of the config's bucket lengths
    (num_frames x frame_interval) it strictly exceeds; plus those lengths, ascending."""
    lengths = sorted({e.num_frames * frame_interval for e in cfg.entries})
    return np.searchsorted(np.array(lengths), frames, side="left").astype(np.int16), lengths


def _first_fit_table(videos: list[BucketEntry], lengths: list[int],
                     frame_interval: int) -> np.ndarray:
    """level -> index (into ``videos``, longest first) of the longest entry a row fits.

    A row fits entry e when T > e.num_frames x frame_interval (strict, as in Open-Sora),
    i.e. when its level exceeds that length's rank; len(videos) means none fits.
    """
    ranks = [lengths.index(e.num_frames * frame_interval) for e in videos]
    return np.array([sum(rank >= level for rank in ranks) for level in range(len(lengths) + 1)],
                    dtype=np.int8)


def _choose_videos(res: str, videos: list[BucketEntry], pos: np.ndarray, levels: np.ndarray,
                   lengths: list[int], frame_interval: int, hashes: np.ndarray,
                   progress: _Progress) -> tuple[np.ndarray, np.ndarray]:
    """(positions, index into ``videos``) of the videos that pick a length here."""
    first = _first_fit_table(videos, lengths, frame_interval)[levels[pos]]
    pick = first.copy()
    for k, e in enumerate(videos):  # longest first; a failed p_frames draw moves one shorter
        if e.frame_prob < 1.0:
            at = np.flatnonzero(pick == k)
            gate = uniform_np(hashes[pos[at]], res, e.num_frames, GATE)
            pick[at[gate > e.frame_prob]] += 1
    missed = pick == len(videos)
    progress.mark(pos[missed & (first == len(videos))], DropReason.TOO_SHORT)
    progress.mark(pos[missed & (first < len(videos))], DropReason.FRAME_DRAW)
    return pos[~missed], pick[~missed]


def _keep_coin(res: str, entries: list[BucketEntry], pos: np.ndarray, pick: np.ndarray,
               hashes: np.ndarray, progress: _Progress) -> tuple[np.ndarray, np.ndarray]:
    """(positions, entry index) of rows that keep their pick; losers fall through to the
    next resolution."""
    won_pos, won_pick = [], []
    for k, e in enumerate(entries):
        at = pos[pick == k]
        if e.keep_prob == 0.0:
            progress.mark(at, DropReason.ZERO_KEEP_PROB)
            continue
        if e.keep_prob < 1.0:
            won = uniform_np(hashes[at], res, e.num_frames, KEEP) < e.keep_prob
            progress.mark(at[~won], DropReason.KEEP_DRAW)
            at = at[won]
        won_pos.append(at)
        won_pick.append(np.full(len(at), k, dtype=np.int64))
    if not won_pos:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(won_pos), np.concatenate(won_pick)


def assign_buckets(num_frames: Any, heights: Any, widths: Any, config: Any, *, seed: int,
                   epoch: int, frame_interval: int = 1, sample_ids: Any = None) -> Assignment:
    """Open-Sora 1.2 bucket assignment for every row at once (see docs/buckets.md).

    ``sample_ids`` (default: row positions) key the random draws; pass stable ids when
    the rows are a filtered or reordered view of the dataset.
    """
    cfg = parse_bucket_config(config)
    check_stream_args(seed, epoch, frame_interval)
    frames, h, w, ids = validated_rows(num_frames, heights, widths, sample_ids)
    buckets, first = bucket_table(cfg)
    n = len(frames)
    hashes, pixels, ratios, is_image = row_hashes(seed, epoch, ids), h * w, h / w, frames == 1
    levels, lengths = _length_levels(frames, cfg, frame_interval)
    bucket = np.full(n, -1, dtype=np.int32)
    progress = _Progress(n)
    unassigned = np.ones(n, dtype=bool)
    for res in cfg.resolutions():  # largest first; the first resolution a row wins is final
        pos = np.flatnonzero(unassigned & (pixels >= RESOLUTION_PIXELS[res] * 0.8))
        if pos.size == 0:
            continue
        entries = _image_entry(cfg, res) + _video_entries(cfg, res)
        pos, pick = _pick_entries(res, entries, pos, is_image, levels, lengths, frame_interval,
                                  hashes, progress)
        won, pick = _keep_coin(res, entries, pos, pick, hashes, progress)
        offsets = np.array([first.get((res, e.num_frames), -1) for e in entries], dtype=np.int64)
        keys = np.array([float(k) for k in ASPECT_RATIOS[res]])
        bucket[won] = offsets[pick] + _nearest_ratio(ratios[won], keys)
        unassigned[won] = False
    return Assignment(bucket, progress.reasons(unassigned), buckets)


def _image_entry(cfg: BucketConfig, res: str) -> list[BucketEntry]:
    return [e for e in cfg.entries_for(res) if e.num_frames == 1]


def _video_entries(cfg: BucketConfig, res: str) -> list[BucketEntry]:
    return [e for e in cfg.entries_for(res) if e.num_frames > 1]  # longest first


def _pick_entries(res: str, entries: list[BucketEntry], pos: np.ndarray, is_image: np.ndarray,
                  levels: np.ndarray, lengths: list[int], frame_interval: int,
                  hashes: np.ndarray, progress: _Progress) -> tuple[np.ndarray, np.ndarray]:
    """(positions, index into ``entries``) of the rows at ``pos`` that pick an entry here,
    before the keep coin. ``entries`` is [image entry, if any] + video entries."""
    has_image = bool(entries) and entries[0].num_frames == 1
    videos = entries[1:] if has_image else entries
    image_pos, video_pos = pos[is_image[pos]], pos[~is_image[pos]]
    out_pos, out_pick = [], []
    if has_image:
        out_pos.append(image_pos)
        out_pick.append(np.zeros(len(image_pos), dtype=np.int64))
    else:
        progress.mark(image_pos, DropReason.NO_IMAGE_BUCKET)
    if videos:
        vpos, vpick = _choose_videos(res, videos, video_pos, levels, lengths, frame_interval,
                                     hashes, progress)
        out_pos.append(vpos)
        out_pick.append(vpick.astype(np.int64) + has_image)
    else:
        progress.mark(video_pos, DropReason.NO_VIDEO_BUCKET)
    if not out_pos:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(out_pos), np.concatenate(out_pick)

