"""Reading a feature cache: samples by ``(index, epoch, bucket)`` key, as ``VideoDataset`` has
them, but from stored latents and caption embeddings (and the first-frame conditions a model
asks for, where the cache holds them: conditions.py).

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
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file as load_safetensors
from torch.utils.data import Dataset

from videodit.data.feature_cache.audio import TENSORS as AUDIO_TENSORS
from videodit.data.feature_cache.audio import collate_audio
from videodit.data.feature_cache.conditions import EMPTY_CAPTION, FIRST_FRAME, IMAGE, POOLED
from videodit.data.feature_cache.format import (FAILED, INDEX, SHARDS, read_manifest, regular, shard_name,
                                                tensor_key)
from videodit.data.feature_cache.verify import ShardCheck, ShardDamaged, damaged_message, records_of, top_folder
from videodit.data.feature_cache.writer import FAILED_COLUMNS, INDEX_SCHEMA
from videodit.errors import UserError
from videodit.user_files import NotRegularFile, check_regular_file

_OPEN_SHARDS = 16   # shard files a process keeps open


class FeatureCache:
    """A complete cache folder: its manifest, its index as arrays, and its tensors on demand."""

    def __init__(self, folder: str | Path, option: str = "data.cache"):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder, option)
        columns, self.records = read_index(self.folder, self.manifest, option)   # records: shard -> SHA-256
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

    def condition(self, row: int, name: str) -> torch.Tensor:
        """The stored first-frame condition ``name`` (conditions.py) of one index row."""
        handle = self._open(int(self.shard[row]))
        return handle.get_tensor(tensor_key(int(self.clip[row]), int(self.view[row]), name))

    def _open(self, shard: int):
        handle = self._handles.pop(shard, None)
        if handle is None:
            path = self.folder / SHARDS / f"{shard_name(shard)}.safetensors"
            self._check.verify(self, shard)   # checksum and header, at the shard's first read
            try:
                check_regular_file(path)   # safetensors would block on a FIFO put there since
                handle = safe_open(str(path), framework="pt")
            except NotRegularFile as exc:
                raise ShardDamaged(damaged_message(path, f"it is {exc.strerror.split(';')[0]}",
                                                   top_folder(self.folder))) from None
            except Exception as exc:   # OSError, or safetensors' own error types
                raise UserError(f"{path} cannot be read ({str(exc).splitlines()[0] if str(exc) else exc}); "
                                "rebuild the cache (delete the shard and its .parquet, then run cache build again)") \
                    from None
            while len(self._handles) >= _OPEN_SHARDS:
                self._handles.popitem(last=False)
        self._handles[shard] = handle
        return handle


# --------------------------------------------------------------------------- the index


_INDEX_TYPES = {f.name: f.type for f in INDEX_SCHEMA if f.name not in ("ok", "path", "reason")}
_FAILED_TYPES = {f.name: f.type for f in INDEX_SCHEMA if f.name in FAILED_COLUMNS}


class IndexDamaged(Exception):
    """Why a cache's ``index.parquet`` or ``failed.parquet`` cannot be used."""


def _read_parquet(path: Path, types: dict, max_rows: int):
    """The table at ``path`` with the columns ``types`` (name -> Arrow type), or IndexDamaged."""
    try:
        check_regular_file(path)   # pyarrow would block on a FIFO
        rows = pq.read_metadata(path).num_rows
        if rows > max_rows:   # read nothing more of a file the manifest cannot account for
            raise IndexDamaged(f"{rows} rows, more than the manifest's {max_rows} samples")
        table = pq.read_table(path)
    except IndexDamaged:
        raise
    except FileNotFoundError:
        raise IndexDamaged("the file is missing") from None
    except NotRegularFile as exc:
        raise IndexDamaged(f"it is {exc.strerror.split(';')[0]}") from None
    except Exception as exc:   # pyarrow's own error types (ArrowInvalid: not Parquet), OSError
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise IndexDamaged(f"not a Parquet file it can read: {reason}") from None
    for name, kind in types.items():
        if name not in table.column_names:
            raise IndexDamaged(f"no column {name!r}")
        if table.schema.field(name).type != kind:
            raise IndexDamaged(f"column {name!r} is {table.schema.field(name).type}, not {kind}")
        if table.column(name).null_count and name not in ("path", "reason"):
            raise IndexDamaged(f"column {name!r} has empty values")
    return table


def _load_index(folder: Path, manifest: dict) -> tuple[dict[str, np.ndarray], dict | None]:
    """The index's columns, every value in range of the manifest, and its shard records."""
    table = _read_parquet(folder / INDEX, _INDEX_TYPES, int(manifest["items"]))
    try:
        records = records_of(table.schema.metadata)
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise IndexDamaged(f"its shard checksums cannot be read ({type(exc).__name__})") from None
    if records is not None and (set(records) != set(range(manifest["shards"])) or not all(r is None or (
            isinstance(r, dict) and isinstance(r.get("sha256"), str) and isinstance(r.get("bytes"), int))
            for r in records.values())):   # a deleted record would turn that shard's check off
        raise IndexDamaged("its shard checksums are not one {sha256, bytes} record per shard")
    columns = {name: table.column(name).to_numpy() for name in _INDEX_TYPES}
    limits = {"clip": manifest["source"]["rows"], "view": manifest["views"],
              "bucket": len(manifest["layout"]["buckets"]), "shard": manifest["shards"],
              "text_len": manifest["text_geometry"]["max_length"] + 1,
              "text_offset": manifest["text_geometry"]["max_length"] + 1}
    for name, limit in limits.items():
        values = columns[name]
        if len(values) and (values.min() < 0 or values.max() >= limit):
            bad = values[(values < 0) | (values >= limit)][0]
            raise IndexDamaged(f"column {name!r} holds {bad}, outside 0..{limit - 1} of the manifest")
    if len(columns["text_len"]) and (columns["text_offset"].astype(np.int64) + columns["text_len"]).max() > \
            manifest["text_geometry"]["max_length"]:
        raise IndexDamaged("a caption's tokens run past text_geometry.max_length")
    return columns, records


def _index_message(path: Path, problem: str, folder: Path) -> str:
    return (f"{path} is damaged ({problem}); run `videodit cache build CONFIG --out {top_folder(folder)}` again with "
            "the config it was built with: it checks every shard and writes the index again")


def read_index(folder: Path, manifest: dict, option: str = "data.cache") -> tuple[dict[str, np.ndarray],
                                                                                 dict | None]:
    """The columns of a complete cache's index (refused in one line: missing, damaged, or
    inconsistent with the manifest) and its shard records (None: built before checksums)."""
    path = folder / INDEX
    try:
        complete = regular(path)
    except NotRegularFile as exc:
        raise UserError(_index_message(path, f"it is {exc.strerror.split(';')[0]}", folder)) from None
    if not complete:
        done = len(list((folder / SHARDS).glob("shard-*.parquet"))) if (folder / SHARDS).is_dir() else 0
        raise UserError(f"{option}={folder} is not complete ({done} of {manifest['shards']} shards "
                        f"written); finish it with `videodit cache build CONFIG --out {folder}` (it resumes)")
    try:
        return _load_index(folder, manifest)
    except IndexDamaged as exc:
        raise UserError(_index_message(path, str(exc), folder)) from None


def read_failed(folder: Path, manifest: dict):
    """``failed.parquet`` (None where there is none), refused in one line when damaged."""
    path = folder / FAILED
    try:
        if not regular(path):
            return None
        return _read_parquet(path, _FAILED_TYPES, int(manifest["items"]))
    except NotRegularFile as exc:
        raise UserError(_index_message(path, f"it is {exc.strerror.split(';')[0]}", folder)) from None
    except IndexDamaged as exc:
        raise UserError(_index_message(path, str(exc), folder)) from None


def index_problem(folder: Path, manifest: dict) -> str | None:
    """Why a complete cache's ``index.parquet`` or ``failed.parquet`` is damaged, or None: for
    ``cache build``, which writes them again."""
    for name, check in ((INDEX, lambda: _load_index(folder, manifest)),
                        (FAILED, lambda: _read_parquet(folder / FAILED, _FAILED_TYPES, int(manifest["items"])))):
        try:
            check()
        except IndexDamaged as exc:
            return f"{name}: {exc}"
    return None


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
    # The given first frame of a model that takes one (conditions.py), None where not asked for:
    first_frame: torch.Tensor | None = None   # [B, C, T', H', W'] float32: latents of the clip with only that frame
    image: torch.Tensor | None = None         # [B, tokens, dim] float32: its image features
    pooled: torch.Tensor | None = None        # [B, dim] float32: the pooled caption vectors of an encoder with them
    # The soundtrack of a model.train_audio run from an audio cache (audio.py), None otherwise:
    audio_latents: torch.Tensor | None = None   # [B, C, T', F] float32, zero after each clip's own frames
    audio_frames: torch.Tensor | None = None    # [B] int64: each clip's latent frames
    audio_mask: torch.Tensor | None = None      # [B] bool: False for a clip without a soundtrack (silence)
    audio_context: torch.Tensor | None = None   # [B, L, D_audio] float32: the audio stream's caption tokens

    def __len__(self) -> int:
        return self.latents.shape[0]

    def features(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x0, y, y_mask) on ``device``."""
        return (self.latents.to(device, non_blocking=True), self.y.to(device, non_blocking=True),
                self.y_mask.to(device, non_blocking=True))

    def conditions(self, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(the given first frame's latents, its image features) on ``device``, each None where absent."""
        return tuple(None if t is None else t.to(device, non_blocking=True) for t in (self.first_frame, self.image))

    def pooled_on(self, device: torch.device) -> torch.Tensor | None:
        """The pooled caption vectors on ``device``, None where the cache holds none."""
        return None if self.pooled is None else self.pooled.to(device, non_blocking=True)

    def pin_memory(self) -> "CachedBatch":
        def pin(t):
            return None if t is None else t.pin_memory()
        return replace(self, latents=self.latents.pin_memory(), y=self.y.pin_memory(),
                       y_mask=self.y_mask.pin_memory(), fps=self.fps.pin_memory(), first_frame=pin(self.first_frame),
                       image=pin(self.image), pooled=pin(self.pooled), audio_latents=pin(self.audio_latents),
                       audio_frames=pin(self.audio_frames), audio_mask=pin(self.audio_mask),
                       audio_context=pin(self.audio_context))


class CachedDataset(Dataset):
    """Cached samples by ``(index, epoch, bucket)`` key (``index``: the source clip), with the
    first-frame ``conditions`` (names, conditions.py) the model takes; others the cache holds
    are not read; with ``audio`` also each sample's soundtrack tensors (audio.py)."""

    def __init__(self, cache: FeatureCache, conditions: tuple[str, ...] = (), audio: bool = False):
        self.cache, self.conditions, self.audio = cache, tuple(conditions), audio

    def __len__(self) -> int:
        return self.cache.num_clips

    def __getitem__(self, key: tuple[int, int, int]) -> dict:
        index, epoch, bucket = key
        row = self.cache.row(index, epoch % self.cache.views)
        latent, tokens = self.cache.tensors(row)
        return {"latent": latent, "tokens": tokens, "offset": int(self.cache.text_offset[row]),
                "fps": float(self.cache.fps[row]), "pixels": self.cache.shapes[int(self.cache.bucket[row])],
                **{name: self.cache.condition(row, name) for name in self.conditions + (AUDIO_TENSORS if self.audio
                                                                                          else ())}}

    def __getitems__(self, keys: list[tuple[int, int, int]]) -> list[dict]:
        return [self[key] for key in keys]


def collate_cached(samples: list[dict], max_length: int, dim: int, audio_dim: int = 0) -> CachedBatch:
    """Stack latents (and first-frame conditions, where the samples have them) as float32 and
    pad captions back to ``max_length`` tokens with zeros."""
    y = torch.zeros(len(samples), max_length, dim)
    mask = torch.zeros(len(samples), max_length, dtype=torch.bool)
    for i, s in enumerate(samples):
        n, offset = s["tokens"].shape[0], s["offset"]
        y[i, offset : offset + n] = s["tokens"].float()
        mask[i, offset : offset + n] = True

    def stacked(name: str) -> torch.Tensor | None:
        return torch.stack([s[name] for s in samples]).float() if name in samples[0] else None

    return CachedBatch(latents=stacked("latent"), y=y, y_mask=mask,
                       fps=torch.tensor([s["fps"] for s in samples], dtype=torch.float32),
                       pixels=samples[0]["pixels"], first_frame=stacked(FIRST_FRAME), image=stacked(IMAGE),
                       pooled=stacked(POOLED), **collate_audio(samples, max_length, audio_dim))


class Collate:
    """A picklable ``collate_fn`` (DataLoader workers) for one caption geometry."""

    def __init__(self, max_length: int, dim: int, audio_dim: int = 0):
        self.max_length, self.dim, self.audio_dim = max_length, dim, audio_dim

    def __call__(self, samples: list[dict]) -> CachedBatch:
        return collate_cached(samples, self.max_length, self.dim, self.audio_dim)


# --------------------------------------------------------------------------- encoder stand-ins


def _read_empty_caption(path: Path, max_length: int, dim: int, pooled_dim: int):
    """(y [1, max_length, dim], mask [1, max_length], pooled [1, pooled_dim]) of a cache's
    ``empty_caption.safetensors``, refused in one line when missing or of other shapes."""
    fix = "rebuild the cache with `videodit cache build CONFIG --out NEW_DIR`"
    try:
        check_regular_file(path)
        tensors = load_safetensors(str(path))
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise UserError(f"{path} (the empty caption that caption dropout trains on) cannot be read "
                        f"({type(exc).__name__}): {fix}") from None
    want = {"y": (1, max_length, dim), "mask": (1, max_length), "pooled": (1, pooled_dim)}
    if {k: tuple(t.shape) for k, t in tensors.items()} != want:
        raise UserError(f"{path} does not hold the empty caption's y, mask and pooled vector of this cache's sizes "
                        f"{want}: {fix}")
    return tensors["y"].float(), tensors["mask"].bool(), tensors["pooled"].float()


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
    """The caption geometry of a cache (``dim``, ``max_length``, ``pooled_dim``); encoding says it
    was not built, except for the empty caption that a cache of pooled vectors stores
    (``conditions.EMPTY_CAPTION``, what caption dropout trains on)."""

    def __init__(self, manifest: dict, folder: Path | None = None):
        self.dim = int(manifest["text_geometry"]["dim"])
        self.max_length = int(manifest["text_geometry"]["max_length"])
        pooled = POOLED in manifest.get("conditions", ())
        self.pooled_dim = int(manifest["pooled_geometry"]["dim"]) if pooled else None
        self.folder = folder
        self._empty = None

    def encode(self, captions):
        return self._stored(captions)[:2]

    def encode_pooled(self, captions):
        return None if self.pooled_dim is None else self._stored(captions)[2]

    def _stored(self, captions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if list(captions) != [""] or self.pooled_dim is None or self.folder is None:
            raise UserError("training from data.cache builds no text encoder, so captions cannot be encoded")
        if self._empty is None:
            self._empty = _read_empty_caption(self.folder / EMPTY_CAPTION, self.max_length, self.dim, self.pooled_dim)
        return self._empty

    def to(self, *args, **kwargs) -> "CachedTextEncoder":
        return self
