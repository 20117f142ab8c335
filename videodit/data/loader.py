"""Everything the trainer needs from the data: metadata, bucket plan, dataset, sampler, loader."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from torch.utils.data import DataLoader

from videodit.config import DataConfig
from videodit.data.buckets import (Assignment, Bucket, assign_buckets, build_buckets,
                                   load_opensora_bucket_config, parse_bucket_config)
from videodit.data.dataset import VideoDataset, collate
from videodit.data.metadata import Metadata, read_metadata
from videodit.data.sampler import BucketBatchSampler, fingerprint
from videodit.errors import UserError


def resolve_bucket_config(data: DataConfig) -> dict | None:
    """The bucket_config dict from ``data.bucket_config`` or ``data.bucket_config_file``."""
    if data.bucket_config is not None:
        return data.bucket_config
    if data.bucket_config_file is None:
        return None
    path = Path(data.bucket_config_file)
    if not path.is_file():
        raise UserError(f"data.bucket_config_file {str(path)!r} does not exist")
    if path.suffix == ".py":
        return load_opensora_bucket_config(path)
    loaded = yaml.safe_load(path.read_text())
    if isinstance(loaded, dict) and "bucket_config" in loaded:
        loaded = loaded["bucket_config"]
    if not isinstance(loaded, dict):
        raise UserError(f"{path} holds no bucket_config mapping")
    return loaded


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


@dataclass
class TrainData:
    meta: Metadata
    plan: BucketPlan
    dataset: VideoDataset
    sampler: BucketBatchSampler
    loader: DataLoader


def build_training_data(data: DataConfig, *, batch_size: int, seed: int, dp_rank: int = 0,
                        dp_size: int = 1) -> TrainData:
    meta = read_metadata(data.csv, bad_rows=data.bad_rows)
    plan = BucketPlan(meta, data, batch_size, seed)
    dataset = VideoDataset(meta, plan, data.frame_interval, seed=seed)
    sampler = BucketBatchSampler(plan.assign, [b.batch_size for b in plan.buckets], seed=seed,
                                 dp_rank=dp_rank, dp_size=dp_size, fingerprint=plan.fingerprint)
    if sampler.steps_in_epoch(0) == 0:
        counts = plan.assignment(0).bucket_counts()
        raise UserError(f"no full batch in epoch 0: {len(meta)} samples, {int(counts.sum())} in buckets, "
                        f"none with a batch size's worth x {dp_size} rank(s); lower the batch sizes or add data "
                        "(videodit buckets META.csv --config CONFIG shows where samples go)")
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=data.num_workers,
                        persistent_workers=False)
    return TrainData(meta, plan, dataset, sampler, loader)
