"""``BucketPlan``: a dataset's bucket table and, per epoch, which bucket each sample lands in.

Building a plan parses the bucket config, so a bad ``data.bucket_config`` is reported here,
when the data is built (the trainer builds its data before any model). An epoch's assignment
is computed once per metadata cache (``Metadata.shared``): with several local ranks, local
rank 0 computes it and the others map the same arrays.
"""

from __future__ import annotations

import hashlib
from itertools import islice
from pathlib import Path

import numpy as np

import videodit.data.buckets.assign as assign
import videodit.data.buckets.hashing as hashing
import videodit.data.buckets.tables as tables
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
        self._cached: tuple[int, Assignment] | None = None
        self._config_repr = self.config.to_dict() if self.config is not None else self.buckets
        # The rows' digest (paths, frames, heights, widths; made while reading), the folder
        # relative paths resolve against, and the config. "m2-" tells it from the fingerprint
        # of the row-by-row reader, which ``legacy_fingerprint`` recomputes.
        root = str(meta.root) if meta.has_relative_paths else ""
        self.fingerprint = "m2-" + fingerprint(meta.digest, root, self._config_repr, data.frame_interval)
        # Cached assignments are keyed by the config and by the code that assigns (changed rules
        # assign again).
        code = [Path(module.__file__).read_bytes() for module in (assign, hashing, tables)]
        self.assign_key = fingerprint(self._config_repr, seed, data.frame_interval, *code)

    def assignment(self, epoch: int) -> Assignment:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = None
            arrays = self.meta.shared(f"buckets-{self.assign_key}-epoch{epoch}", lambda: self._assign(epoch))
            self._cached = (epoch, Assignment(arrays["bucket"], arrays["reason"], self.buckets))
        return self._cached[1]

    def _assign(self, epoch: int) -> dict:
        if self.config is None:
            n = len(self.meta)
            return {"bucket": np.zeros(n, np.int32), "reason": np.zeros(n, np.int8)}
        result = assign_buckets(self.meta.num_frames, self.meta.heights, self.meta.widths, self.config,
                                seed=self.seed, epoch=epoch, frame_interval=self.frame_interval)
        return {"bucket": result.bucket, "reason": result.reason}

    def __getstate__(self):   # DataLoader workers map the assignment again rather than copy it
        return {**self.__dict__, "_cached": None}

    def assign(self, epoch: int) -> np.ndarray:
        return self.assignment(epoch).bucket

    def legacy_fingerprint(self) -> str:
        """The fingerprint the row-by-row reader gave this data (``fingerprint`` of whole Python
        lists), streamed in blocks: checked only when a checkpoint written by it is resumed."""
        digest = hashlib.sha256()
        columns = (iter(self.meta.paths), *(a.tolist() for a in (self.meta.num_frames, self.meta.heights,
                                                                  self.meta.widths)))
        for values in columns:   # repr(list) == "[" + ", ".join(map(repr, items)) + "]"
            values, sep = iter(values), b"["
            while block := list(islice(values, 1 << 16)):
                digest.update(sep + ", ".join(map(repr, block)).encode())
                sep = b", "
            digest.update(b"[]\x00" if sep == b"[" else b"]\x00")
        for part in (self._config_repr, self.frame_interval):
            digest.update(repr(part).encode())
            digest.update(b"\x00")
        return digest.hexdigest()[:16]
