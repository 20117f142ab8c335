"""Training and validation data from a feature cache (``data.cache=DIR``): the counterparts of
``data/loader.py``'s ``build_training_data`` and ``build_validation_data``.

The bucket table (with the config's batch sizes, which may differ from the build's) must have
the shapes the cache was built with; ``check_compatible`` refuses anything else on start. What
the model takes beside latents and captions (an i2v model's given first frame) is known once the
model is built: the trainer then calls ``CachedTrainData.require_conditions``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader

from videodit.config import Config, DataConfig
from videodit.data.buckets.assign import Bucket, build_buckets
from videodit.data.buckets.config import resolve_bucket_config
from videodit.data.feature_cache.audio import require_audio
from videodit.data.feature_cache.conditions import require, wanted
from videodit.data.feature_cache.format import MANIFEST, VALIDATION, check_compatible
from videodit.data.feature_cache.reader import (CachedDataset, CachedTextEncoder, CachedVAE, Collate,
                                                FeatureCache)
from videodit.data.sampler import BucketBatchSampler, fingerprint
from videodit.errors import UserError


def config_buckets(data: DataConfig, batch_size: int) -> tuple[Bucket, ...]:
    """The config's flat bucket table, as ``BucketPlan`` builds it (one fixed bucket without a
    bucket_config)."""
    raw = resolve_bucket_config(data)
    if raw is None:
        return (Bucket("fixed", data.num_frames, "-", data.height, data.width, batch_size),)
    return build_buckets(raw)


@dataclass
class CachePlan:
    """The part of ``BucketPlan`` the trainer reads: the bucket table and the data's fingerprint."""

    buckets: tuple[Bucket, ...]
    fingerprint: str


class CacheSummary:
    """Stands in for ``Metadata`` in the trainer's start-up lines: the clip count, no CSV report."""

    read_report = None
    bad_rows: tuple = ()
    unit = "row"

    def __init__(self, cache: FeatureCache):
        self.cache = cache
        self.clips = int(len(np.unique(cache.clip)))

    def __len__(self) -> int:
        return self.clips

    def describe(self) -> str:
        m = self.cache.manifest
        return (f"data.cache={self.cache.folder}: {len(self.cache)} cached samples of {self.clips} clips "
                f"({m['views']} view(s), {m['dtype']}) from {m['source']['csv']}; no VAE or text encoder is built")


@dataclass
class CachedTrainData:
    meta: CacheSummary
    plan: CachePlan
    dataset: CachedDataset
    sampler: BucketBatchSampler
    loader: DataLoader
    vae: CachedVAE
    text: CachedTextEncoder

    def require_conditions(self, first_frame: bool, image: bool, pooled: bool = False) -> tuple[str, ...]:
        """Refuse, in one line, a cache without the given first frame's latents (``first_frame``),
        image features (``image``) or pooled caption vectors (``pooled``) the model takes; the
        loader then reads those, and nothing else the cache holds (an i2v cache trains a t2v model
        too). Returns the conditions read, for the validation set's loader."""
        needed = wanted(first_frame, image, pooled)
        cache = self.dataset.cache
        require(cache.manifest, needed, str(cache.folder))
        self.dataset.conditions = needed
        return needed


def build_cached_training_data(cfg: Config, *, batch_size: int, seed: int, dp_rank: int = 0, dp_size: int = 1,
                               pin_memory: bool = False) -> CachedTrainData:
    """The training loader over ``cfg.data.cache``, checked against the config."""
    cache = FeatureCache(cfg.data.cache)
    buckets = config_buckets(cfg.data, batch_size)
    check_compatible(cache.manifest, cfg, buckets, cfg.data.cache)
    audio = bool(cfg.model.train_audio)   # the soundtracks' latents: read for an audio run only
    if audio:
        require_audio(cache.manifest, cfg.data.cache)
    sizes = [b.batch_size for b in buckets]
    plan = CachePlan(buckets, "fc-" + fingerprint(cache.manifest["items_digest"], cache.manifest["layout"], sizes,
                                                  cache.views))
    sampler = BucketBatchSampler(_ViewAssign(cache), sizes, seed=seed, dp_rank=dp_rank, dp_size=dp_size,
                                 fingerprint=plan.fingerprint)
    if sampler.steps_in_epoch(0) == 0:
        counts = np.bincount(cache.buckets_of_view(0) + 1, minlength=len(buckets) + 1)[1:]
        raise UserError(f"no full batch in epoch 0: {int(counts.sum())} cached samples in view 0, none of the "
                        f"buckets has a batch size's worth x {dp_size} rank(s); lower the batch sizes "
                        f"(`videodit cache info {cache.folder}` shows the samples per bucket)")
    vae, text = CachedVAE(cache.manifest), CachedTextEncoder(cache.manifest, cache.folder)
    audio_dim = int(cache.manifest["audio"]["text_dim"]) if audio else 0
    loader = DataLoader(CachedDataset(cache, audio=audio), batch_sampler=sampler,
                        collate_fn=Collate(text.max_length, text.dim, audio_dim),
                        num_workers=cfg.data.num_workers, persistent_workers=cfg.data.num_workers > 0,
                        pin_memory=pin_memory)
    return CachedTrainData(CacheSummary(cache), plan, loader.dataset, sampler, loader, vae, text)


class _ViewAssign:
    """epoch -> bucket per clip: the cache's view ``epoch % views`` (picklable, computed once per view)."""

    def __init__(self, cache: FeatureCache):
        self.cache = cache
        self.memo: dict[int, np.ndarray] = {}

    def __call__(self, epoch: int) -> np.ndarray:
        view = epoch % self.cache.views
        if view not in self.memo:
            self.memo[view] = self.cache.buckets_of_view(view)
        return self.memo[view]


def build_cached_validation_data(cfg: Config, csv: str, *, batch_size: int, max_samples: int,
                                 needed: tuple[str, ...] = ()) -> tuple[DataLoader, int]:
    """The fixed validation set from the cache's ``validation/`` part: the same samples, in the
    same batches, as ``build_validation_data`` takes from ``csv``; with the first-frame
    conditions ``needed`` (conditions.py) the model takes."""
    folder = Path(cfg.data.cache) / VALIDATION
    fix = f"run `videodit cache build CONFIG --out {cfg.data.cache}` with validation.csv={csv} (it keeps the " \
          "finished training shards), or set validation.csv=null"
    if not (folder / MANIFEST).exists():   # a FIFO or a folder there: refused by FeatureCache
        raise UserError(f"data.cache={cfg.data.cache} holds no validation set, and no encoder is built to encode "
                        f"validation.csv: {fix}")
    cache = FeatureCache(folder, option="data.cache (validation)")
    if cache.manifest["source"]["csv"] != str(Path(csv).expanduser().resolve()):
        raise UserError(f"data.cache={cfg.data.cache} holds the validation set of {cache.manifest['source']['csv']}, "
                        f"not of validation.csv={csv}: {fix}")
    check_compatible(cache.manifest, cfg, config_buckets(cfg.data, batch_size), cfg.data.cache)
    require(cache.manifest, needed, str(folder))
    order = np.argsort(cache.clip[cache.view == 0], kind="stable")
    rows = np.flatnonzero(cache.view == 0)[order][:max_samples]
    by_bucket = defaultdict(list)
    for row in rows.tolist():
        by_bucket[int(cache.bucket[row])].append((int(cache.clip[row]), 0, int(cache.bucket[row])))
    batches = [group[i : i + batch_size] for group in by_bucket.values() for i in range(0, len(group), batch_size)]
    text = CachedTextEncoder(cache.manifest)
    return DataLoader(CachedDataset(cache, needed), batch_sampler=batches,
                      collate_fn=Collate(text.max_length, text.dim), num_workers=0), len(rows)
