"""Checking a cache's shards: the SHA-256 recorded for every shard file when it was written,
and the tensor names, shapes and dtypes of its safetensors header against the index.

A shard's record (``{"sha256", "bytes"}``) is computed from the bytes as they are written and
kept in the schema metadata of the shard's index part (``SHARD_KEY``) and, joined, of
``index.parquet`` (``INDEX_KEY``: shard number -> record). Caches built before checksums have
neither: their shards are checked by header only ("not verified" in ``cache info``).

Training checks a shard once per process tree, at its first read (``ShardCheck``): hashing is
~1 GB/s, a shard is read hundreds of times an epoch (once per sample), so hashing on every read
would cost the shard's whole size per sample; once, the cost is one extra pass over the cache.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import torch

from videodit.data.feature_cache.audio import ANY
from videodit.data.feature_cache.audio import tensor_shapes as audio_shapes
from videodit.data.feature_cache.conditions import tensor_shapes
from videodit.data.feature_cache.format import SHARDS, shard_name, tensor_key
from videodit.errors import UserError
from videodit.user_files import NotRegularFile, check_regular_file, open_user_file


def _sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    """The SHA-256 of a shard on disk (checkpoint/writer.py has the same for checkpoints; data/ sits
    below checkpoint/, so it keeps its own four lines)."""
    digest = hashlib.sha256()
    with open_user_file(path) as handle:   # never blocks: a FIFO is refused
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()

SHARD_KEY, INDEX_KEY = b"videodit.shard", b"videodit.shards"
_ST_DTYPE = {"bf16": "BF16", "fp32": "F32"}
_ST_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def shard_record(data: bytes) -> dict:
    """The record of a shard file about to be written from ``data``."""
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def shard_path(folder: Path, shard: int) -> Path:
    return Path(folder) / SHARDS / f"{shard_name(shard)}.safetensors"


def records_of(metadata: dict | None) -> dict[int, dict | None] | None:
    """Shard -> record from ``index.parquet``'s schema metadata; None for a cache built before
    checksums."""
    if not metadata or INDEX_KEY not in metadata:
        return None
    return {int(k): v for k, v in json.loads(metadata[INDEX_KEY]).items()}


def record_of_part(metadata: dict | None) -> dict | None | bool:
    """A shard index part's record: a dict, None (the shard has no tensors), or False (built
    before checksums)."""
    if not metadata or SHARD_KEY not in metadata:
        return False
    return json.loads(metadata[SHARD_KEY])


def _header(path: Path) -> tuple[dict, int]:
    with open_user_file(path) as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise ValueError("no valid safetensors header")
        raw = f.read(n)
    if len(raw) < n:
        raise ValueError("safetensors header cut short")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("no valid safetensors header")
    return header, 8 + n


def expected_tensors(manifest: dict, clip, view, bucket, text_len) -> dict[str, tuple[list[int], str]]:
    """Tensor name -> (shape, safetensors dtype) of a shard's samples, as the index and the
    manifest say (the first-frame conditions a cache holds included)."""
    dtype, dim = _ST_DTYPE[manifest["dtype"]], int(manifest["text_geometry"]["dim"])
    shapes = manifest["latent"]["shapes"]
    conditions = {str(b): tensor_shapes(manifest, shapes[str(b)]) for b in set(np.asarray(bucket).tolist())}
    out = {}
    for c, v, b, n in zip(*(np.asarray(a).tolist() for a in (clip, view, bucket, text_len))):
        out[tensor_key(c, v, "latent")] = (list(shapes[str(b)]), dtype)
        out[tensor_key(c, v, "text")] = ([n, dim], dtype)
        for condition, shape in conditions[str(b)].items():
            out[tensor_key(c, v, condition)] = (shape, dtype)
        for name, shape in audio_shapes(manifest, n).items():   # an audio cache's (audio.py)
            out[tensor_key(c, v, name)] = (shape, dtype)
    return out


def _shape_matches(shape, expected: list[int]) -> bool:
    """Whether a header's shape is ``expected`` (``audio.ANY``: any positive size there)."""
    return isinstance(shape, list) and len(shape) == len(expected) and all(
        isinstance(n, int) and (n == e or (e == ANY and n >= 1)) for n, e in zip(shape, expected))


def shard_problem(path: Path, expected: dict, record: dict | None | bool) -> str | None:
    """Why the shard file at ``path`` is damaged, or None. ``record``: its checksum record
    (False: none recorded, check the header only)."""
    try:
        size = check_regular_file(path).stat().st_size
        if record:
            if size != record["bytes"]:
                return f"{size} bytes, {record['bytes']} written"
        header, start = _header(path)
        header.pop("__metadata__", None)
        if set(header) != set(expected):
            missing = sorted(set(expected) - set(header))[:1] or sorted(set(header) - set(expected))[:1]
            return f"its tensors are not the index's (e.g. {missing[0]!r})"
        end = 0
        for name, (shape, dtype) in expected.items():
            entry = header[name]
            if not _shape_matches(entry.get("shape"), shape) or entry.get("dtype") != dtype:
                return (f"tensor {name!r} is {entry.get('dtype')} {entry.get('shape')}, the index says {dtype} "
                        f"{shape}")
            lo, hi = entry["data_offsets"]
            if hi - lo != int(np.prod(entry["shape"])) * _ST_SIZE[dtype]:
                return f"tensor {name!r} has {hi - lo} bytes for its shape"
            end = max(end, hi)
        if start + end != size:
            return f"{size} bytes, its header describes {start + end}"
        if record and _sha256_file(path) != record["sha256"]:
            return "its SHA-256 is not the one recorded when it was written"
    except FileNotFoundError:
        return "the file is missing"
    except NotRegularFile as exc:   # a FIFO would block the reader forever
        return f"it is {exc.strerror.split(';')[0]}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        return f"it cannot be read ({exc})"
    return None


class ShardDamaged(UserError):
    """A damaged shard, in one line also when a DataLoader worker found it: the DataLoader
    re-raises a worker's error as ``type(error)(worker traceback)``, whose last line is ours."""

    def __init__(self, message: str):
        if "Original Traceback" in message:
            last = message.rstrip().splitlines()[-1]
            message = last.split(": ", 1)[1] if ": " in last else last
        super().__init__(message)


def damaged_message(path: Path, problem: str, folder: Path) -> str:
    return (f"feature cache shard {path} is damaged ({problem}); run `videodit cache build CONFIG --out {folder}` "
            "again with the config it was built with: it checks every shard and re-encodes the damaged ones")


class ShardCheck:
    """Which shards of a cache have been checked, shared by the process and its DataLoader
    workers (a shared-memory flag per shard), so each shard is hashed once per training process
    tree, at its first read."""

    def __init__(self, shards: int):
        self.ok = torch.zeros(max(shards, 1), dtype=torch.uint8).share_memory_()

    def verify(self, cache, shard: int) -> None:
        if self.ok[shard]:
            return
        rows = np.flatnonzero(cache.shard == shard)
        expected = expected_tensors(cache.manifest, cache.clip[rows], cache.view[rows], cache.bucket[rows],
                                    cache.text_len[rows])
        record = False if cache.records is None else cache.records.get(shard)
        path = shard_path(cache.folder, shard)
        problem = shard_problem(path, expected, record)
        if problem:
            raise ShardDamaged(damaged_message(path, problem, top_folder(cache.folder)))
        self.ok[shard] = 1


def top_folder(folder: Path) -> Path:
    """The cache folder the build writes (``DIR`` for ``DIR/validation``)."""
    from videodit.data.feature_cache.format import MANIFEST, VALIDATION

    folder = Path(folder)
    if folder.name == VALIDATION and (folder.parent / MANIFEST).is_file():
        return folder.parent
    return folder
