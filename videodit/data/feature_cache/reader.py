"""Reading a feature cache: samples by ``(index, epoch, bucket)`` key, as ``VideoDataset`` has
them, but from stored latents and caption embeddings.

The index table is read once (numbers only: a few dozen bytes per sample); the tensors stay in
the shards, opened lazily and memory-mapped by safetensors, a few at a time per process (also
in DataLoader workers). Epoch ``e`` reads view ``e % views``: its bucket per clip feeds the
bucket sampler, so batches, resume and data-parallel dealing work as on decoded videos.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from videodit.data.feature_cache.format import INDEX, SHARDS, read_manifest, shard_name, tensor_key
from videodit.data.feature_cache.verify import ShardCheck, records_of
from videodit.errors import UserError

_OPEN_SHARDS = 16   # shard files a process keeps open


class FeatureCache:
    """A complete cache folder: its manifest, its index as arrays, and its tensors on demand."""

    def __init__(self, folder: str | Path, option: str = "data.cache"):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder, option)
        if not (self.folder / INDEX).is_file():
            done = len(list((self.folder / SHARDS).glob("shard-*.parquet"))) if (self.folder / SHARDS).is_dir() else 0
            raise UserError(f"{option}={self.folder} is not complete ({done} of {self.manifest['shards']} shards "
                            f"written); finish it with `videodit cache build CONFIG --out {self.folder}` (it resumes)")
        table = pq.read_table(self.folder / INDEX)
        self.records = records_of(table.schema.metadata)   # shard -> SHA-256 record; None: built before checksums
        columns = {name: table.column(name).to_numpy() for name in table.column_names}
        self.clip, self.view, self.bucket, self.shard = (columns[k] for k in ("clip", "view", "bucket", "shard"))
        self.fps, self.text_len = columns["fps"], columns["text_len"]
        self.text_offset = columns["text_offset"]
        self.latent_bytes, self.text_bytes = columns["latent_bytes"], columns["text_bytes"]
        self.views = int(self.manifest["views"])
        self.num_clips = int(self.manifest["source"]["rows"])
        self.shapes = [tuple(b[1:2] + b[3:5]) for b in self.manifest["layout"]["buckets"]]   # (T, H, W)
        self._rows: np.ndarray | None = None
        self._handles: OrderedDict = OrderedDict()
        self._check = ShardCheck(int(self.manifest["shards"]))   # shared with DataLoader workers

    def __len__(self) -> int:
        return len(self.clip)

    def __getstate__(self):   # DataLoader workers open their own shard handles and make their own row table
        return {**self.__dict__, "_handles": OrderedDict(), "_rows": None}

    @property
    def rows(self) -> np.ndarray:
        """[views, clips]: the index row of each clip's view, -1 where it has none."""
        if self._rows is None:
            dtype = np.int32 if len(self) < 2**31 else np.int64
            rows = np.full((self.views, self.num_clips), -1, dtype)
            rows[self.view.astype(np.int64), self.clip] = np.arange(len(self), dtype=dtype)
            self._rows = rows
        return self._rows

    def buckets_of_view(self, view: int) -> np.ndarray:
        """The bucket of every source clip in ``view`` (-1: dropped, unreadable or not cached)."""
        rows = self.rows[view]
        buckets = np.full(self.num_clips, -1, np.int32)
        present = rows >= 0
        buckets[present] = self.bucket[rows[present]]
        return buckets

    def row(self, clip: int, view: int) -> int:
        row = int(self.rows[view, clip])
        if row < 0:
            raise KeyError(f"clip {clip} has no view {view} in {self.folder}")
        return row

    def tensors(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored latent [C, T', H', W'] and valid caption tokens [n, D] of one index row."""
        handle = self._open(int(self.shard[row]))
        clip, view = int(self.clip[row]), int(self.view[row])
        return handle.get_tensor(tensor_key(clip, view, "latent")), handle.get_tensor(tensor_key(clip, view, "text"))

    def _open(self, shard: int):
        handle = self._handles.pop(shard, None)
        if handle is None:
            path = self.folder / SHARDS / f"{shard_name(shard)}.safetensors"
            self._check.verify(self, shard)   # checksum and header, at the shard's first read
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as exc:   # OSError, or safetensors' own error types
                raise UserError(f"{path} cannot be read ({str(exc).splitlines()[0] if str(exc) else exc}); "
                                "rebuild the cache (delete the shard and its .parquet, then run cache build again)") \
                    from None
            while len(self._handles) >= _OPEN_SHARDS:
                self._handles.popitem(last=False)
        self._handles[shard] = handle
        return handle


@dataclass
class CachedBatch:
    """One collated batch of cached samples: what the encoders would have produced."""

    latents: torch.Tensor        # [B, C, T', H', W'] float32
    y: torch.Tensor              # [B, L, D] float32, zero at padded positions
    y_mask: torch.Tensor         # [B, L] bool, True at real tokens
    fps: torch.Tensor            # [B]
    pixels: tuple[int, int, int]   # (frames, height, width) the latents were encoded from
    failed: list[tuple[str, str]] = field(default_factory=list)   # always empty: the build skipped those
    noise_seed: int = 0

    def __len__(self) -> int:
        return self.latents.shape[0]

    def features(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x0, y, y_mask) on ``device``."""
        return (self.latents.to(device, non_blocking=True), self.y.to(device, non_blocking=True),
                self.y_mask.to(device, non_blocking=True))

    def pin_memory(self) -> "CachedBatch":
        return replace(self, latents=self.latents.pin_memory(), y=self.y.pin_memory(),
                       y_mask=self.y_mask.pin_memory(), fps=self.fps.pin_memory())


class CachedDataset(Dataset):
    """Cached samples by ``(index, epoch, bucket)`` key (``index``: the source clip)."""

    def __init__(self, cache: FeatureCache):
        self.cache = cache

    def __len__(self) -> int:
        return self.cache.num_clips

    def __getitem__(self, key: tuple[int, int, int]) -> dict:
        index, epoch, bucket = key
        row = self.cache.row(index, epoch % self.cache.views)
        latent, tokens = self.cache.tensors(row)
        return {"latent": latent, "tokens": tokens, "offset": int(self.cache.text_offset[row]),
                "fps": float(self.cache.fps[row]), "pixels": self.cache.shapes[int(self.cache.bucket[row])]}

    def __getitems__(self, keys: list[tuple[int, int, int]]) -> list[dict]:
        return [self[key] for key in keys]


def collate_cached(samples: list[dict], max_length: int, dim: int) -> CachedBatch:
    """Stack latents (as float32) and pad captions back to ``max_length`` tokens with zeros."""
    y = torch.zeros(len(samples), max_length, dim)
    mask = torch.zeros(len(samples), max_length, dtype=torch.bool)
    for i, s in enumerate(samples):
        n, offset = s["tokens"].shape[0], s["offset"]
        y[i, offset : offset + n] = s["tokens"].float()
        mask[i, offset : offset + n] = True
    return CachedBatch(latents=torch.stack([s["latent"] for s in samples]).float(), y=y, y_mask=mask,
                       fps=torch.tensor([s["fps"] for s in samples], dtype=torch.float32),
                       pixels=samples[0]["pixels"])


class Collate:
    """A picklable ``collate_fn`` (DataLoader workers) for one caption geometry."""

    def __init__(self, max_length: int, dim: int):
        self.max_length, self.dim = max_length, dim

    def __call__(self, samples: list[dict]) -> CachedBatch:
        return collate_cached(samples, self.max_length, self.dim)


# --------------------------------------------------------------------------- encoder stand-ins


class CachedVAE:
    """What training needs of a VAE when the latents are cached: its geometry. Encoding or
    decoding says the VAE was not built."""

    def __init__(self, manifest: dict):
        latent = manifest["latent"]
        self.latent_channels = int(latent["channels"])
        self.spatial_compression = int(latent["spatial_compression"])
        self.temporal_compression = int(latent["temporal_compression"])
        self._frames = list(latent["frames"])   # latent frames of 1, 2, ... pixel frames

    def latent_size(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        if not 1 <= num_frames <= len(self._frames) or self._frames[num_frames - 1] < 0:
            raise UserError(f"the cached VAE geometry has no latent size for {num_frames} frames")
        s = self.spatial_compression
        return self._frames[num_frames - 1], height // s, width // s

    def encode(self, video):
        raise UserError("training from data.cache builds no VAE, so nothing can be encoded")

    def decode(self, latents, num_frames=None):
        raise UserError("training from data.cache builds no VAE, so nothing can be decoded; sample with "
                        "`videodit sample --ckpt RUN`, which loads the run's encoders")

    def to(self, *args, **kwargs) -> "CachedVAE":
        return self


class CachedTextEncoder:
    """The caption geometry of a cache (``dim``, ``max_length``); encoding says it was not built."""

    def __init__(self, manifest: dict):
        self.dim = int(manifest["text_geometry"]["dim"])
        self.max_length = int(manifest["text_geometry"]["max_length"])

    def encode(self, captions):
        raise UserError("training from data.cache builds no text encoder, so captions cannot be encoded")

    def to(self, *args, **kwargs) -> "CachedTextEncoder":
        return self
