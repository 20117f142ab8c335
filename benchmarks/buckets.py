"""Bucket assignment: vectorized ``assign_buckets`` against the row-by-row reference.

    python benchmarks/buckets.py [--rows 1000000] [--ref-rows 50000] [--repeats 3]

Synthetic metadata (mixed images and videos, common and odd sizes in landscape and
portrait, lengths from 1 frame to minutes) goes through Open-Sora 1.2's stage-1
``bucket_config``. The vectorized path runs on every row; the reference runs on the first
``--ref-rows`` rows and its time is scaled linearly to the full count (it does the same
fixed work per row). Both must give identical buckets and reasons on the shared rows.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from videodit.data.buckets import (DROP_REASON_TEXT, DropReason, assign_buckets,
                                   assign_buckets_reference, parse_bucket_config,
                                   OPENSORA_V12_STAGE1)

STAGE1 = OPENSORA_V12_STAGE1

# (height, width) of common sources; each row picks one, maybe flips it to portrait, and
# jitters it a little so sizes and aspect ratios spread between the table entries.
COMMON_SIZES = [
    (144, 256), (180, 320), (240, 426), (240, 320), (270, 480), (360, 640), (360, 480),
    (480, 854), (480, 640), (540, 960), (576, 720), (720, 1280), (720, 960), (1080, 1920),
    (1080, 1440), (1440, 2560), (2160, 3840), (256, 256), (512, 512), (1024, 1024),
    (800, 1920), (1038, 1920), (1080, 2560), (100, 100), (120, 160),
]


def synthetic_rows(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = np.array(COMMON_SIZES)[rng.integers(0, len(COMMON_SIZES), n)]
    jittered = rng.random((n, 1)) < 0.3
    jitter = np.where(jittered, rng.uniform(0.9, 1.1, (n, 2)), 1.0)
    sizes = np.maximum(16, np.round(sizes * jitter)).astype(np.int64)
    portrait = rng.random(n) < 0.2
    heights = np.where(portrait, sizes[:, 1], sizes[:, 0])
    widths = np.where(portrait, sizes[:, 0], sizes[:, 1])
    lengths = np.clip(np.round(rng.lognormal(np.log(150), 1.0, n)), 2, 5000).astype(np.int64)
    num_frames = np.where(rng.random(n) < 0.35, 1, lengths)  # 35% images
    return num_frames, heights, widths


def best_time(fn, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--ref-rows", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg = parse_bucket_config(STAGE1)
    frames, heights, widths = synthetic_rows(args.rows)
    m = min(args.ref_rows, args.rows)
    kwargs = dict(seed=42, epoch=3, frame_interval=1)

    vec_s, vec = best_time(lambda: assign_buckets(frames, heights, widths, cfg, **kwargs), args.repeats)
    ref_s, ref = best_time(lambda: assign_buckets_reference(
        frames[:m], heights[:m], widths[:m], cfg, **kwargs), 1)
    same = (np.array_equal(vec.bucket[:m], ref.bucket) and np.array_equal(vec.reason[:m], ref.reason))
    ref_full_s = ref_s * args.rows / m

    print(f"Open-Sora 1.2 stage-1 bucket_config, {args.rows:,} synthetic rows "
          f"({(frames == 1).mean():.0%} images), {len(vec.buckets)} buckets")
    print(f"vectorized: best of {args.repeats} on all rows; reference: 1 run on the first {m:,} rows, "
          f"scaled x{args.rows / m:g} to {args.rows:,} rows (linear: same work per row)\n")
    print(f"| implementation | rows timed | seconds | rows/s | seconds for {args.rows:,} rows |")
    print("|---|---:|---:|---:|---:|")
    print(f"| assign_buckets (vectorized) | {args.rows:,} | {vec_s:.3f} | {args.rows / vec_s:,.0f} | {vec_s:.3f} |")
    print(f"| assign_buckets_reference | {m:,} | {ref_s:.3f} | {m / ref_s:,.0f} | {ref_full_s:.2f} (scaled) |")
    print(f"\nspeed-up: {ref_full_s / vec_s:.1f}x  (target >= 50x)")
    print(f"identical buckets and reasons on the shared {m:,} rows: {same}\n")
    print(vec.summary())
    counts = vec.reason_counts()
    assert sum(counts.values()) == args.rows and set(counts) <= set(DROP_REASON_TEXT)
    if not same:
        raise SystemExit("vectorized and reference assignments differ")
    kept_by_res: dict[str, int] = {}
    for b, count in zip(vec.buckets, vec.bucket_counts()):
        key = f"{b.resolution} x {'image' if b.num_frames == 1 else f'{b.num_frames} frames'}"
        kept_by_res[key] = kept_by_res.get(key, 0) + int(count)
    print("\nrows per (resolution, num_frames):")
    for key, count in kept_by_res.items():
        if count:
            print(f"  {key:<22} {count:>9,}")
    assert DropReason.KEPT in counts


if __name__ == "__main__":
    main()
