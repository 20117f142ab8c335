"""How many batches the DataLoader's workers may prepare ahead, from the bytes of a batch.

Each worker keeps ``prefetch_factor`` batches in flight. A toy batch is a few MB, a 720p x 121
frame batch of 4 is 1.3 GB (uint8), so one fixed factor either starves small buckets or holds
gigabytes of shared memory for large ones; the factor is chosen so the largest bucket's
batches in flight stay within ``IN_FLIGHT_BYTES``.
"""

from __future__ import annotations

from collections.abc import Iterable

# Host memory the workers' prepared batches may hold together (shared memory, then pinned).
IN_FLIGHT_BYTES = 2**30
# Beyond a few batches per worker, prefetching only smooths decode-time jitter further.
MAX_PREFETCH = 4


def batch_bytes(bucket) -> int:
    """Bytes of one uint8 batch of ``bucket`` (a ``Bucket``: batch_size clips of 3 x T x H x W)."""
    return (bucket.batch_size or 0) * 3 * bucket.num_frames * bucket.height * bucket.width


def prefetch_factor(buckets: Iterable, num_workers: int, budget: int = IN_FLIGHT_BYTES) -> int | None:
    """``DataLoader(prefetch_factor=...)``: batches per worker, 1 to ``MAX_PREFETCH``, so that
    ``num_workers`` x it batches of the largest bucket fit in ``budget`` (at least one each);
    None without workers (the DataLoader refuses a factor then)."""
    if num_workers == 0:
        return None
    largest = max((batch_bytes(b) for b in buckets), default=0)
    if largest == 0:
        return MAX_PREFETCH
    return max(1, min(MAX_PREFETCH, budget // (num_workers * largest)))
