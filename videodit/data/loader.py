"""Assembly only: the training data (metadata, bucket plan, dataset, sampler, loader) and the
fixed validation set, each built from a data config by the modules that own the parts."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from torch.utils.data import DataLoader

from videodit.config import DataConfig
from videodit.data import shared_slots
from videodit.data.audio import AudioSpec
from videodit.data.buckets.plan import BucketPlan
from videodit.data.dataset import KEEP_DECODED_BYTES, VideoDataset, collate, decoded_bytes
from videodit.data.decoder_choice import decoding_workers, resolve_decoder, use_decoder
from videodit.data.in_flight import prefetch_factor
from videodit.data.metadata import Metadata, read_metadata
from videodit.data.sampler import BucketBatchSampler
from videodit.errors import UserError


@dataclass
class TrainData:
    meta: Metadata
    plan: BucketPlan
    dataset: VideoDataset
    sampler: BucketBatchSampler
    loader: DataLoader


def build_training_data(data: DataConfig, *, batch_size: int, seed: int, dp_rank: int = 0,
                        dp_size: int = 1, pin_memory: bool = False, notice=print, audio: bool = False) -> TrainData:
    """``pin_memory`` (on GPUs): the loader hands over batches in page-locked memory, so that
    their host-to-device copy is asynchronous (``non_blocking``); with workers a thread of the
    loader pins each batch while the previous step runs.

    Workers stay for the whole run (``persistent_workers``): each epoch's iteration reads the
    sampler's position afresh in this process (``Trainer.batches`` sets it before iterating), so
    only the keys travel to the workers; the workers hold nothing of the epoch.

    ``data.decoder`` is resolved first (a one-line error before any file is read) and becomes
    this process's decoder, for validation too; ``notice`` prints why ``auto`` fell back. ``audio``
    (``model.train_audio``): every sample carries its soundtrack as LTX-2's log-mel (docs/audio.md)."""
    decoder = resolve_decoder(data.decoder, data.decode_device, notice=notice)
    use_decoder(decoder)
    meta = read_metadata(data.csv, bad_rows=data.bad_rows, cache=data.metadata_cache, progress=True)
    plan = BucketPlan(meta, data, batch_size, seed)
    dataset = VideoDataset(meta, plan, data.frame_interval, seed=seed, max_pixels=data.max_pixels,
                           caption_suffix=data.caption_suffix,
                           keep_decoded=decoded_bytes(meta) <= KEEP_DECODED_BYTES,   # the toy set: decoded once
                           audio=AudioSpec.from_config(data) if audio else None)
    sampler = BucketBatchSampler(plan.assign, [b.batch_size for b in plan.buckets], seed=seed,
                                 dp_rank=dp_rank, dp_size=dp_size, fingerprint=plan.fingerprint,
                                 legacy_fingerprint=plan.legacy_fingerprint, share=meta.shared,
                                 share_key=plan.assign_key)
    if sampler.steps_in_epoch(0) == 0:
        counts = plan.assignment(0).bucket_counts()
        raise UserError(f"no full batch in epoch 0: {len(meta)} samples, {int(counts.sum())} in buckets, "
                        f"none with a batch size's worth x {dp_size} rank(s); lower the batch sizes or add data "
                        "(videodit buckets META.csv --config CONFIG shows where samples go)")
    prefetch = prefetch_factor(plan.buckets, data.num_workers)
    if data.num_workers and shared_slots.available():
        # Per worker: its batches in flight, the one the pin thread or the step holds, one spare.
        dataset.slots = shared_slots.SlotBoard(data.num_workers, keep=prefetch + 2)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=data.num_workers,
                        persistent_workers=data.num_workers > 0, pin_memory=pin_memory, prefetch_factor=prefetch,
                        **decoding_workers(decoder, data.num_workers))
    return TrainData(meta, plan, dataset, sampler, loader)


def build_validation_data(data: DataConfig, csv: str, *, batch_size: int, seed: int,
                          max_samples: int) -> tuple[DataLoader, int]:
    """A loader over a fixed validation set, and its size: the first ``max_samples`` samples
    that epoch 0 puts in a bucket, batched per bucket in order, the same set every time."""
    meta = read_metadata(csv, bad_rows="skip", option="validation.csv", cache=data.metadata_cache)
    plan = BucketPlan(meta, data, batch_size, seed=seed)
    dataset = VideoDataset(meta, plan, data.frame_interval, seed=seed, max_pixels=data.max_pixels,
                           caption_suffix=data.caption_suffix)
    buckets = plan.assign(0)
    chosen = np.flatnonzero(buckets >= 0)[:max_samples]
    keys = [(i, 0, b) for i, b in zip(chosen.tolist(), buckets[chosen].tolist())]
    by_bucket = defaultdict(list)
    for key in keys:
        by_bucket[key[2]].append(key)
    batches = [group[i : i + batch_size] for group in by_bucket.values() for i in range(0, len(group), batch_size)]
    return DataLoader(dataset, batch_sampler=batches, collate_fn=collate, num_workers=0), len(keys)
