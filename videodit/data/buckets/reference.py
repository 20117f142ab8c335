"""``assign_buckets_reference``: Open-Sora 1.2's bucket rules written one row at a time.

The same rules and the same random draws as the vectorized ``assign_buckets``, in plain
Python; kept for tests and the benchmark, which check the two give identical results.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from videodit.data.buckets.assign import (Assignment, DropReason, bucket_table, check_stream_args,
                                          validated_rows)
from videodit.data.buckets.config import BucketConfig, BucketEntry, parse_bucket_config
from videodit.data.buckets.hashing import GATE, KEEP, chain, draw_key, row_prefix, to_unit
from videodit.data.buckets.tables import ASPECT_RATIOS, RESOLUTION_PIXELS


def _video_miss(entries: tuple[BucketEntry, ...], fits_any: bool) -> DropReason:
    if all(e.num_frames == 1 for e in entries):
        return DropReason.NO_VIDEO_BUCKET
    return DropReason.FRAME_DRAW if fits_any else DropReason.TOO_SHORT


def _reference_row(cfg: BucketConfig, t: int, h: int, w: int, frame_interval: int,
                   draw, first: dict[tuple[str, int], int]) -> tuple[int, DropReason]:
    """One clip through Open-Sora's get_bucket_id loop; returns (bucket, reason)."""
    progress = DropReason.BELOW_EVERY_RESOLUTION
    for res in cfg.resolutions():
        if h * w < RESOLUTION_PIXELS[res] * 0.8:
            continue
        entries = cfg.entries_for(res)
        chosen = None
        if t == 1:
            chosen = next((e for e in entries if e.num_frames == 1), None)
            if chosen is None:
                progress = max(progress, DropReason.NO_IMAGE_BUCKET)
                continue
        else:
            fits_any = False
            for e in entries:
                if e.num_frames == 1:
                    continue
                fits = t > e.num_frames * frame_interval
                fits_any = fits_any or fits
                # Open-Sora draws the p_frames gate before it checks the length.
                if e.frame_prob < 1.0 and draw(res, e.num_frames, GATE) > e.frame_prob:
                    continue
                if fits:
                    chosen = e
                    break
            if chosen is None:
                progress = max(progress, _video_miss(entries, fits_any))
                continue
        if chosen.keep_prob >= 1.0 or draw(res, chosen.num_frames, KEEP) < chosen.keep_prob:
            ratio = h / w
            table = ASPECT_RATIOS[res]
            key = min(table, key=lambda k: abs(float(k) - ratio))
            return first[(res, chosen.num_frames)] + list(table).index(key), DropReason.KEPT
        zero = chosen.keep_prob == 0.0
        progress = max(progress, DropReason.ZERO_KEEP_PROB if zero else DropReason.KEEP_DRAW)
    return -1, progress


def assign_buckets_reference(num_frames: Any, heights: Any, widths: Any, config: Any, *,
                             seed: int, epoch: int, frame_interval: int = 1,
                             sample_ids: Any = None) -> Assignment:
    """``assign_buckets`` written one row at a time in plain Python (same draws, same result)."""
    cfg = parse_bucket_config(config)
    check_stream_args(seed, epoch, frame_interval)
    frames, h, w, ids = validated_rows(num_frames, heights, widths, sample_ids)
    buckets, first = bucket_table(cfg)
    prefix = row_prefix(seed, epoch)
    keys = {(e.resolution, e.num_frames, s): draw_key(e.resolution, e.num_frames, s)
            for e in cfg.entries for s in (GATE, KEEP)}
    bucket = np.full(len(frames), -1, dtype=np.int32)
    reason = np.zeros(len(frames), dtype=np.int8)
    for i, (t, hh, ww, sid) in enumerate(zip(frames.tolist(), h.tolist(), w.tolist(), ids.tolist())):
        row = chain(prefix, sid)

        def draw(res: str, n: int, slot: int, row: int = row) -> float:
            return to_unit(chain(row, keys[(res, n, slot)]))

        bucket[i], reason[i] = _reference_row(cfg, t, hh, ww, frame_interval, draw, first)
    return Assignment(bucket, reason, buckets)
