"""Open-Sora 1.2 ``bucket_config``: resolution tables, parsing, and bucket assignment.

A bucket config maps a resolution name to frame counts, each with a keep probability and a
per-GPU batch size::

    {"240p": {1: (0.3, 297), 51: (0.4, 20), 102: ((0.4, 0.33), 10), 408: (0.0, None)}}

Modules, each importing only the ones above it:

* ``tables``: resolution names, pixel counts and aspect-ratio sizes;
* ``config``: reading and validating a bucket config (``parse_bucket_config``,
  ``resolve_bucket_config``);
* ``hashing``: the counter-based random stream, identical on every rank;
* ``assign``: the bucket table and the vectorized ``assign_buckets``;
* ``reference``: ``assign_buckets_reference``, the same rules row by row (tests, benchmark);
* ``plan``: ``BucketPlan``, a dataset's buckets per epoch.

The rules, worked examples and every deliberate difference from Open-Sora are in
``docs/buckets.md``. This module re-exports the public names for users; code inside
videodit imports from the submodules.
"""

from videodit.data.buckets.assign import (DROP_REASON_TEXT, Assignment, Bucket, DropReason,
                                          assign_buckets, build_buckets)
from videodit.data.buckets.config import (BucketConfig, BucketEntry, load_opensora_bucket_config,
                                          parse_bucket_config, resolve_bucket_config)
from videodit.data.buckets.hashing import uniform
from videodit.data.buckets.plan import BucketPlan
from videodit.data.buckets.reference import assign_buckets_reference
from videodit.data.buckets.tables import (ASPECT_RATIOS, OPENSORA_V12_STAGE1, RESOLUTION_NAMES,
                                          RESOLUTION_PIXELS)

__all__ = [
    "ASPECT_RATIOS", "Assignment", "Bucket", "BucketConfig", "BucketEntry", "BucketPlan",
    "DROP_REASON_TEXT", "DropReason", "OPENSORA_V12_STAGE1", "RESOLUTION_NAMES",
    "RESOLUTION_PIXELS", "assign_buckets", "assign_buckets_reference", "build_buckets",
    "load_opensora_bucket_config", "parse_bucket_config", "resolve_bucket_config", "uniform",
]
