"""Writing a feature cache: which samples go in which shard, one shard at a time, and the
index last.

The samples are the (clip, view, bucket) triples a bucket plan gives: view ``v`` is what
epoch ``v`` of on-the-fly training would draw (its bucket and its frame window), so a cache
of K views replays the first K epochs exactly. They are cut into shards of ``shard_size``
consecutive samples; shard ``s`` goes to rank ``s % world``, so a build on any number of
processes writes the same shards.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save as save_safetensors

from videodit.data.feature_cache.format import (FAILED, FORMAT, INDEX, SHARDS, atomic_write_bytes, shard_name,
                                                tensor_key)
from videodit.data.feature_cache.verify import (INDEX_KEY, SHARD_KEY, expected_tensors, record_of_part,
                                                shard_path, shard_problem, shard_record)
from videodit.errors import UserError
from videodit.user_files import check_regular_file

INDEX_SCHEMA = pa.schema([
    ("clip", pa.int64()), ("view", pa.int16()), ("bucket", pa.int32()), ("shard", pa.int32()),
    ("ok", pa.bool_()), ("fps", pa.float32()), ("text_offset", pa.int32()), ("text_len", pa.int32()),
    ("latent_bytes", pa.int64()), ("text_bytes", pa.int64()), ("path", pa.string()), ("reason", pa.string()),
])
FAILED_COLUMNS = ("clip", "view", "bucket", "path", "reason")


@dataclass
class Items:
    """The samples of a cache, in shard order."""

    clip: np.ndarray     # int64 source row
    view: np.ndarray     # int16
    bucket: np.ndarray   # int32

    def __len__(self) -> int:
        return len(self.clip)

    def digest(self) -> str:
        import hashlib
        digest = hashlib.sha256()
        for array in (self.clip, self.view, self.bucket):
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()[:16]


def plan_items(assign, views: int, limit: int | None = None) -> Items:
    """Every (clip, view, bucket) with a bucket: view-major, clips in order. ``assign(v)`` is
    the bucket per clip of epoch ``v`` (-1: dropped); ``limit`` keeps the first samples only."""
    clips, view_ids, buckets = [], [], []
    for view in range(views):
        bucket = np.asarray(assign(view))
        kept = np.flatnonzero(bucket >= 0)
        clips.append(kept.astype(np.int64))
        view_ids.append(np.full(len(kept), view, np.int16))
        buckets.append(bucket[kept].astype(np.int32))
    items = Items(np.concatenate(clips), np.concatenate(view_ids), np.concatenate(buckets))
    if limit is not None:
        items = Items(items.clip[:limit], items.view[:limit], items.bucket[:limit])
    return items


def shard_count(items: int, shard_size: int) -> int:
    return math.ceil(items / shard_size)


def shard_slice(shard: int, shard_size: int) -> slice:
    return slice(shard * shard_size, (shard + 1) * shard_size)


def shard_done(folder: Path, shard: int) -> bool:
    return (folder / SHARDS / f"{shard_name(shard)}.parquet").is_file()


def valid_run(mask: torch.Tensor) -> tuple[int, int]:
    """(offset, length) of a caption's real tokens; they must be one run (right- or left-padded)."""
    positions = torch.nonzero(mask).flatten()
    if not len(positions):
        return 0, 0
    first, last = int(positions[0]), int(positions[-1])
    if last - first + 1 != len(positions):
        raise UserError("the text encoder's token mask has gaps; the cache stores one run of valid tokens per "
                        "caption and cannot hold such captions")
    return first, last - first + 1


class ShardWriter:
    """Collects one shard's samples, then writes its tensors and its index rows atomically."""

    def __init__(self, folder: Path, shard: int, dtype: torch.dtype):
        self.folder, self.shard, self.dtype = folder, shard, dtype
        self.tensors: dict[str, torch.Tensor] = {}
        self.rows: list[dict] = []

    def add(self, clip: int, view: int, bucket: int, fps: float, latent: torch.Tensor, text: torch.Tensor,
            mask: torch.Tensor, conditions: dict[str, torch.Tensor] | None = None) -> None:
        """One sample: its latent [C, T', H', W'] and caption embedding [L, D] with its mask [L];
        ``conditions``: its first-frame conditions by name (conditions.py), for a cache that holds them."""
        offset, length = valid_run(mask.cpu())
        latent = latent.detach().to("cpu", self.dtype).contiguous()
        tokens = text.detach()[offset : offset + length].to("cpu", self.dtype).contiguous()
        self.tensors[tensor_key(clip, view, "latent")] = latent
        self.tensors[tensor_key(clip, view, "text")] = tokens
        for name, tensor in (conditions or {}).items():
            self.tensors[tensor_key(clip, view, name)] = tensor.detach().to("cpu", self.dtype).contiguous()
        self.rows.append(dict(clip=clip, view=view, bucket=bucket, shard=self.shard, ok=True, fps=fps,
                              text_offset=offset, text_len=length,
                              latent_bytes=latent.numel() * latent.element_size(),
                              text_bytes=tokens.numel() * tokens.element_size(), path=None, reason=None))

    def fail(self, clip: int, view: int, bucket: int, path: str, reason: str) -> None:
        """A sample whose video could not be read: kept in the index as not ok, with the reason."""
        self.rows.append(dict(clip=clip, view=view, bucket=bucket, shard=self.shard, ok=False, fps=0.0,
                              text_offset=0, text_len=0, latent_bytes=0, text_bytes=0, path=path, reason=reason))

    def write(self) -> None:
        """Tensors first, then the index part: the part's presence marks the shard complete."""
        shards = self.folder / SHARDS
        shards.mkdir(parents=True, exist_ok=True)
        name = shard_name(self.shard)
        record = None
        if self.tensors:
            # One metadata entry: safetensors keeps them in a hash map, whose order varies between runs.
            data = save_safetensors(self.tensors, metadata={"format": f"{FORMAT} shard {self.shard}"})
            record = shard_record(data)   # the SHA-256 of the bytes written, checked when training reads them
            atomic_write_bytes(shards / f"{name}.safetensors", data)
        order = sorted(range(len(self.rows)), key=lambda i: (self.rows[i]["view"], self.rows[i]["clip"]))
        table = pa.Table.from_pylist([self.rows[i] for i in order], schema=INDEX_SCHEMA)
        table = table.replace_schema_metadata({SHARD_KEY: json.dumps(record, sort_keys=True)})
        atomic_write_bytes(shards / f"{name}.parquet", _parquet_bytes(table))


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def finish_index(folder: Path, shards: int) -> pa.Table:
    """Join the shards' index parts into ``index.parquet`` (the samples) and ``failed.parquet``
    (the unreadable videos): the last files a build writes."""
    paths = [folder / SHARDS / f"{shard_name(s)}.parquet" for s in range(shards)]
    parts = [pq.read_table(path, schema=INDEX_SCHEMA) for path in paths]
    table = pa.concat_tables(parts) if parts else INDEX_SCHEMA.empty_table()
    records = {str(s): record_of_part(pq.read_schema(path).metadata) for s, path in enumerate(paths)}
    if all(r is not False for r in records.values()):   # every part has its checksum (not a build of before)
        table = table.replace_schema_metadata({INDEX_KEY: json.dumps(records, sort_keys=True)})
    ok = table.column("ok").to_numpy(zero_copy_only=False)
    failed = table.filter(pa.array(~ok)).select(list(FAILED_COLUMNS))
    index = table.filter(pa.array(ok)).drop_columns(["ok", "path", "reason"])
    failed = failed.replace_schema_metadata(None)
    atomic_write_bytes(folder / FAILED, _parquet_bytes(failed))
    atomic_write_bytes(folder / INDEX, _parquet_bytes(index))
    return table


def part_problem(folder: Path, shard: int, manifest: dict) -> str | None:
    """Why finished shard ``shard`` of ``folder`` is damaged (its tensors against its index part
    and its recorded SHA-256), or None. A build of before checksums is checked by header only."""
    path = folder / SHARDS / f"{shard_name(shard)}.parquet"
    try:
        check_regular_file(path)   # pyarrow would block on a FIFO
        part = pq.read_table(path, schema=INDEX_SCHEMA)
        record = record_of_part(pq.read_schema(path).metadata)
        ok = part.column("ok").to_numpy(zero_copy_only=False).astype(bool)
        rows = {k: part.column(k).to_numpy(zero_copy_only=False)[ok] for k in ("clip", "view", "bucket", "text_len")}
        expected = expected_tensors(manifest, rows["clip"], rows["view"], rows["bucket"], rows["text_len"]) \
            if ok.any() else {}
    except Exception as exc:   # pyarrow's own error types, a bucket the manifest lacks, not JSON
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        return f"its index part {path.name} cannot be read ({reason})"
    if not ok.any():
        return None   # every video of the shard was unreadable: no tensors file
    if record is None:
        return "its index part lists samples but no tensors file"
    return shard_problem(shard_path(folder, shard), expected, record)
