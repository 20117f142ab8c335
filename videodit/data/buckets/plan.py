"""``BucketPlan``: a dataset's bucket table and, per epoch, which bucket each sample lands in.

Building a plan parses the bucket config, so a bad ``data.bucket_config`` is reported here,
when the data is built (the trainer builds its data before any model).
"""

from __future__ import annotations

import numpy as np

from videodit.config import DataConfig
from videodit.data.buckets.assign import Assignment, Bucket, assign_buckets, build_buckets
from videodit.data.buckets.config import parse_bucket_config, resolve_bucket_config
from videodit.data.metadata import Metadata
from videodit.data.sampler import fingerprint


class BucketPlan:
    """The flat bucket table and, per epoch, which bucket each sample lands in.

    Without a bucket_config there is one bucket, (data.num_frames, data.height,
    data.width) at train.batch_size, and every sample lands in it.
    """

    def __init__(self, meta: Metadata, data: DataConfig, batch_size: int, seed: int):
        self.meta = meta
        self.seed = seed
        self.frame_interval = data.frame_interval
        self.config = resolve_bucket_config(data)
        if self.config is not None:
            self.config = parse_bucket_config(self.config)
            self.buckets: tuple[Bucket, ...] = build_buckets(self.config)
        else:
            self.buckets = (Bucket("fixed", data.num_frames, "-", data.height, data.width, batch_size),)
        self._frames = np.asarray(meta.num_frames)
        self._heights = np.asarray(meta.heights)
        self._widths = np.asarray(meta.widths)
        self._cached: tuple[int, Assignment] | None = None
        config_repr = self.config.to_dict() if self.config is not None else self.buckets
        self.fingerprint = fingerprint(meta.paths, meta.num_frames, meta.heights, meta.widths,
                                       config_repr, data.frame_interval)

    def assignment(self, epoch: int) -> Assignment:
        if self._cached is None or self._cached[0] != epoch:
            if self.config is None:
                n = len(self.meta)
                result = Assignment(np.zeros(n, np.int32), np.zeros(n, np.int8), self.buckets)
            else:
                result = assign_buckets(self._frames, self._heights, self._widths, self.config,
                                        seed=self.seed, epoch=epoch, frame_interval=self.frame_interval)
            self._cached = (epoch, result)
        return self._cached[1]

    def assign(self, epoch: int) -> np.ndarray:
        return self.assignment(epoch).bucket
