"""Metadata tables with Open-Sora's columns, from CSV or Parquet, read column-wise.

Columns: ``path, text, num_frames, height, width, aspect_ratio, fps`` (``resolution`` and any
other columns are kept). Relative paths resolve against the file's folder, lazily:
``Metadata.path(i)`` builds one path when a sample is read; no Python object is made per row.

A read streams the file in blocks through pyarrow and checks each block column-wise: an empty
path, a size or rate that is not a positive number, a frame count or size that is not whole,
a row with more fields than the header. Bad rows are skipped and counted with their CSV line
(Parquet: row number), or refused all at once with ``bad_rows="error"``.

The node cache (``cache=FOLDER``, or ``"auto"``: ``~/.cache/videodit/metadata`` for files of 64
MiB or more). The checked table is written once, as Arrow IPC plus raw numeric columns, into
``FOLDER/KEY/`` (KEY: the file's size, mtime and a sampled content hash). The first local rank
(``LOCAL_RANK`` 0) builds it under a file lock; the other local ranks wait on the lock, then
every rank memory-maps the same files, so node memory holds one copy however many ranks read
it. ``Metadata.shared`` does the same for arrays derived from the table (an epoch's buckets).
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import hashlib
import io
import json
import operator
import os
import queue
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from videodit.errors import UserError, os_error_message

REQUIRED_COLUMNS = ("path", "text", "num_frames", "height", "width", "aspect_ratio", "fps")
_POSITIVE_INT = ("num_frames", "height", "width")
_POSITIVE_FLOAT = ("aspect_ratio", "fps")
_NUMERIC = _POSITIVE_INT + _POSITIVE_FLOAT
_STORED = {"num_frames": np.int64, "height": np.int64, "width": np.int64, "fps": np.float64}
PARQUET_SUFFIXES = (".parquet", ".pq")
AUTO_CACHE_BYTES = 64 << 20        # data.metadata_cache=auto caches files at least this large
_CACHE_VERSION = 1
_BLOCK_BYTES = 4 << 20
_MAX_WHOLE = 2.0 ** 53             # frame counts and sizes beyond this are not exact in float64
_WAIT_FOR_FIRST_RANK_S = 60.0
# What str.strip() removes: a path made only of these is empty (RE2 syntax).
_BLANK = r"^[\t\n\x0b\x0c\r\x1c-\x20\x85\xa0\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}]*$"


@dataclass(frozen=True)
class ReadReport:
    """What reading the metadata took: rows in the file, bad rows, seconds, file bytes, how."""

    source: str
    rows: int
    bad_rows: int
    seconds: float
    bytes: int
    how: str

    def describe(self) -> str:
        return (f"metadata: {self.rows:,} rows ({self.bad_rows:,} bad) from {self.source} "
                f"({self.bytes / 2**20:,.1f} MiB) in {self.seconds:.1f}s, {self.how}")


class Metadata:
    """Checked rows: ``num_frames``, ``heights``, ``widths`` (int64) and ``fps`` (float64) arrays;
    ``path(i)`` / ``text(i)``; ``paths``, ``texts`` and ``columns[name]`` (every column as stored,
    CSV columns as text) as read-only sequences that make one value at a time;
    ``bad_rows``: (CSV line or Parquet row, reason) of the rows skipped."""

    def __init__(self, source: Path, table: pa.Table, numbers: dict, bad: pa.Table, info: dict,
                 entry: Path | None = None):
        self.csv_path = self.source = Path(source)
        self.root = self.source.parent
        self.table, self._numbers, self._bad, self.info, self._entry = table, numbers, bad, info, entry
        self.num_frames, self.heights, self.widths, self.fps = (numbers[k] for k in _STORED)
        self.unit, self.digest = info["unit"], info["digest"]
        self.has_relative_paths = info["relative"] > 0
        self.read_report: ReadReport | None = None
        self.paths = Column(table.column("path"), self._resolve)
        self.texts = Column(table.column("text"), lambda v: "" if v is None else str(v))
        self.columns = {name: Column(table.column(name)) for name in table.column_names}
        self.bad_rows = BadRows(bad)

    def __len__(self) -> int:
        return len(self.num_frames)

    def path(self, index: int) -> str:
        return self.paths[index]

    def text(self, index: int) -> str:
        return self.texts[index]

    def _resolve(self, text: str) -> str:
        path = Path(text)
        return str(path if path.is_absolute() else self.root / path)

    def shared(self, name: str, build: Callable[[], dict]) -> dict:
        """Arrays made by ``build()`` once per cache (e.g. an epoch's bucket assignment) and
        memory-mapped by every rank; without a cache, ``build()``'s own arrays."""
        if self._entry is None:
            return build()
        folder = self._entry / "derived" / name

        def write(tmp: Path) -> None:
            for key, array in build().items():
                np.save(tmp / f"{key}.npy", np.ascontiguousarray(array))

        if _build_once(folder, write):
            _prune(folder.parent, keep=8)
        else:
            _touch(folder)
        return {p.stem: np.load(p, mmap_mode="r") for p in sorted(folder.glob("*.npy"))}

    def __reduce__(self):   # DataLoader workers: a cached table is mapped again, not copied
        if self._entry is not None:
            return _reopen, (str(self.source), str(self._entry), self.read_report)
        return _rebuild, (self.source, self.table, self._numbers, self._bad, self.info, self.read_report)


def _reopen(source: str, entry: str, report: ReadReport | None) -> Metadata:
    meta = _open_entry(Path(source), Path(entry))
    meta.read_report = report
    return meta


def _rebuild(source, table, numbers, bad, info, report) -> Metadata:
    meta = Metadata(source, table, numbers, bad, info)
    meta.read_report = report
    return meta


class Column(Sequence):
    """One column as a read-only sequence; a Python value is made only when one is asked for."""

    def __init__(self, column: pa.ChunkedArray, convert: Callable | None = None):
        self._chunks = [chunk for chunk in column.chunks if len(chunk)]
        self._starts = np.cumsum([0] + [len(chunk) for chunk in self._chunks])
        self._convert = convert

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = operator.index(index)
        index = index + len(self) if index < 0 else index
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} outside 0..{len(self) - 1}")
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        value = self._chunks[k][index - int(self._starts[k])].as_py()
        return value if self._convert is None else self._convert(value)

    def __iter__(self):
        for chunk in self._chunks:
            values = chunk.to_pylist()
            yield from (values if self._convert is None else map(self._convert, values))

    def __eq__(self, other):
        if not isinstance(other, (list, tuple, Column)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"Column({self[:3]}{' ...' if len(self) > 3 else ''}, {len(self)} values)"


class BadRows(Sequence):
    """(CSV line or Parquet row, reason) of every skipped row, made on access."""

    def __init__(self, table: pa.Table):
        self.lines, self.reasons = Column(table.column("line")), Column(table.column("reason"))

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.lines[index], self.reasons[index]

    def __iter__(self):
        return zip(self.lines, self.reasons)


# ---------------------------------------------------------------------------- reading


def read_metadata(path: str | Path, bad_rows: str = "skip", option: str = "data.csv", *,
                  cache: str | Path | None = None, progress: bool = False) -> Metadata:
    """Read and check a metadata CSV or Parquet file (``.parquet``).

    ``bad_rows="skip"`` drops invalid rows (listed in ``Metadata.bad_rows``); ``"error"``
    refuses the file, naming the bad rows. ``option`` is the config key named when the file
    is missing. ``cache``: None or ``"off"`` (read into memory), ``"auto"`` or a folder (see
    the module doc). ``progress`` shows a bar on stderr for reads longer than 2 s (local rank 0).
    """
    start = time.perf_counter()
    source = Source(Path(path), option)
    folder, meta = _cache_folder(cache, source.size), None
    show = progress and _local_rank() == 0
    if folder is not None:
        try:
            entry = folder / _entry_key(source.path)
            built = _build_once(entry, lambda tmp: _DiskSink(tmp, source).consume(source.chunks(show)))
            meta = _open_entry(source.path, entry)
            how = f"{'read and cached in' if built else 'mapped from'} {entry}"
            if built:
                _prune(folder, keep=None)
        except OSError as exc:
            if cache != "auto":
                raise UserError(f"metadata cache {folder}: {os_error_message(exc)}, or set "
                                "data.metadata_cache=off") from None
            print(f"warning: metadata cache {folder} not used ({os_error_message(exc)})", file=sys.stderr)
    if meta is None:
        meta, how = _MemorySink(source).consume(source.chunks(show)), "read into memory"
    meta.read_report = ReadReport(str(source.path), meta.info["rows"], len(meta.bad_rows),
                                  time.perf_counter() - start, source.size, how)
    if len(meta.bad_rows) and bad_rows == "error":
        shown = "; ".join(f"{meta.unit} {line}: {why}" for line, why in meta.bad_rows[:5])
        more = f" (and {len(meta.bad_rows) - 5} more)" if len(meta.bad_rows) > 5 else ""
        raise UserError(f"{source.path} has {len(meta.bad_rows)} bad row(s): {shown}{more}; fix them or "
                        "let videodit skip bad rows")
    if not len(meta):
        raise UserError(f"{source.path} has no usable rows")
    return meta


@dataclass
class Chunk:
    """One checked block: its good rows (every column as stored), their numbers, its bad rows."""

    rows: pa.Table           # zero-copy slices of the block around its bad rows
    numbers: dict            # _NUMERIC -> int64 / float64 array over the good rows
    bad: list                # (line, reason)


class Source:
    """A metadata file opened for a streaming read; ``chunks()`` yields checked ``Chunk``s."""

    def __init__(self, path: Path, option: str = "data.csv"):
        self.path, self.parquet = path, path.suffix.lower() in PARQUET_SUFFIXES
        if not path.is_file():
            kind = "file" if self.parquet else "CSV"
            raise UserError(f"metadata {kind} {str(path)!r} does not exist; set {option} to an existing file")
        try:
            open(path, "rb").close()
        except OSError as exc:
            raise UserError(f"metadata file {path}: {os_error_message(exc)}") from None
        self.size, self.unit = path.stat().st_size, "row" if self.parquet else "line"
        self.schema = self._parquet_schema() if self.parquet else self._csv_schema()
        names = self.schema.names
        missing = [c for c in REQUIRED_COLUMNS if c not in names]
        if missing:
            raise UserError(f"{path} is missing column(s) {', '.join(missing)}; Open-Sora metadata "
                            f"needs {', '.join(REQUIRED_COLUMNS)}")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise UserError(f"{path} has column(s) {', '.join(twice)} more than once; rename or drop the copies")
        self.index = {name: names.index(name) for name in names}

    def chunks(self, progress: bool = False) -> Iterator[Chunk]:
        from tqdm import tqdm

        total = self._rows if self.parquet else self.size
        with tqdm(total=total, unit="rows" if self.parquet else "B", unit_scale=True, leave=False, delay=2,
                  desc=f"reading {self.path.name}", file=sys.stderr, disable=not progress) as bar:
            batches = self._parquet_batches() if self.parquet else self._csv_batches()
            for batch, lines, bad, done in batches:
                bar.update(done - bar.n)
                yield _check(self, batch, lines, bad)

    # -- CSV

    def _csv_schema(self) -> pa.Schema:
        try:
            reader = pcsv.open_csv(str(self.path), read_options=pcsv.ReadOptions(use_threads=False),
                                   parse_options=pcsv.ParseOptions(newlines_in_values=True,
                                                                   invalid_row_handler=lambda row: "skip"))
        except pa.ArrowInvalid as exc:
            if "Empty CSV file" in str(exc):
                return pa.schema([])
            raise self._csv_error(exc) from None
        names = reader.schema.names
        reader.close()
        return pa.schema([(name, pa.string()) for name in names])

    def _csv_error(self, exc: Exception) -> UserError:
        text = " ".join(str(exc).split())
        if "UTF8" in text:
            return UserError(f"{self.path} is not UTF-8 text (byte {_first_bad_utf8(self.path)}); save it as UTF-8 CSV")
        return UserError(f"{self.path} is not a readable CSV ({text}); check its quoting")

    def _csv_batches(self):
        invalid: deque = deque()   # rows whose field count is off: (CSV line, raw text), checked one by one

        def handler(row):
            invalid.append((row.number, row.text))
            return "skip"

        stream = pa.OSFile(str(self.path))
        try:
            reader = pcsv.open_csv(
                stream, read_options=pcsv.ReadOptions(use_threads=False, block_size=_BLOCK_BYTES),
                parse_options=pcsv.ParseOptions(newlines_in_values=True, invalid_row_handler=handler),
                convert_options=pcsv.ConvertOptions(column_types=dict(zip(self.schema.names, self.schema.types))))
            next_line, pending = 2, deque()
            for batch in _read_ahead(reader):
                while invalid:   # what the parser set aside up to (and maybe past) this batch
                    pending.append(invalid.popleft())
                batch, lines, bad = self._place(batch, next_line, pending, final=False)
                next_line = int(lines[-1]) + 1 if len(lines) else next_line
                yield batch, lines, bad, stream.tell()
            pending.extend(invalid)
            if pending:
                empty = pa.RecordBatch.from_pylist([], schema=self.schema)
                yield (*self._place(empty, next_line, pending, final=True), self.size)
        except pa.ArrowInvalid as exc:
            raise self._csv_error(exc) from None
        finally:
            stream.close()

    def _place(self, batch, start: int, pending: deque, final: bool):
        """Line numbers of ``batch``'s rows, starting at ``start`` and stepping over the rows the
        parser set aside (``pending``, in file order), which are checked here one by one: a
        short row may still be good (a missing extra column), and goes back in its place."""
        lines = np.arange(start, start + batch.num_rows, dtype=np.int64)
        bad, good = [], []
        while pending and (final or (len(lines) and pending[0][0] <= lines[-1])):
            number, text = pending.popleft()
            lines[lines >= number] += 1
            fields = next(csv.reader(io.StringIO(text, newline="")), [])
            row = dict(zip(self.schema.names, fields))   # as csv.DictReader makes it
            if len(fields) > len(self.schema):
                row[None] = fields[len(self.schema):]
            row.update({name: None for name in self.schema.names[len(fields):]})
            problem = _row_problem(row)
            (bad.append((number, problem)) if problem else good.append((number, row)))
        if good:
            extra = pa.RecordBatch.from_pylist([row for _, row in good], schema=self.schema)
            lines = np.concatenate([lines, [number for number, _ in good]])
            order = np.argsort(lines, kind="stable")
            table = pa.Table.from_batches([batch, extra]).take(order).combine_chunks()
            batch, lines = table.to_batches()[0], lines[order]
        return batch, lines, bad

    # -- Parquet

    def _parquet_schema(self) -> pa.Schema:
        try:
            meta = pq.ParquetFile(self.path).metadata
            schema = pq.read_schema(self.path)
        except (pa.ArrowException, OSError) as exc:
            raise UserError(f"{self.path} is not a readable Parquet file ({' '.join(str(exc).split())}); "
                            "write it with pyarrow or pandas, or give a CSV") from None
        self._rows = meta.num_rows
        return pa.schema([pa.field(f.name, f.type.value_type if pa.types.is_dictionary(f.type) else f.type)
                          for f in schema])

    def _parquet_batches(self):
        row = 1
        try:
            for batch in pq.ParquetFile(self.path).iter_batches(batch_size=1 << 16):
                if batch.schema != self.schema:
                    batch = batch.cast(self.schema)
                lines = np.arange(row, row + batch.num_rows, dtype=np.int64)
                row += batch.num_rows
                yield batch, lines, [], row - 1
        except (pa.ArrowException, OSError) as exc:
            if isinstance(exc, UserError):
                raise
            raise UserError(f"{self.path} is not a readable Parquet file ({' '.join(str(exc).split())})") from None


def _read_ahead(reader, depth: int = 2) -> Iterator[pa.RecordBatch]:
    """``reader``'s batches, parsed ahead in a thread (pyarrow parses without the GIL) while the
    caller checks and stores the previous ones."""
    batches, stop = queue.Queue(depth), threading.Event()

    def parse():
        try:
            while not stop.is_set():
                item = reader.read_next_batch()
                while not stop.is_set():
                    with contextlib.suppress(queue.Full):
                        batches.put(item, timeout=0.1)
                        break
        except BaseException as exc:   # StopIteration at the end, or the parse error
            batches.put(exc)

    thread = threading.Thread(target=parse, name="metadata-parse", daemon=True)
    thread.start()
    try:
        while not isinstance(item := batches.get(), BaseException):
            yield item
        if not isinstance(item, StopIteration):
            raise item
    finally:
        stop.set()
        with contextlib.suppress(queue.Empty):
            batches.get_nowait()
        thread.join()


def _row_problem(row: dict) -> str | None:
    """The one-row check, for rows the column-wise check cannot take (field count off)."""
    if row.get(None):
        return "more fields than the header"
    if not (row.get("path") or "").strip():
        return "empty path"
    for name in _NUMERIC:
        text = row.get(name)
        value = _float(text)
        if value is None:
            return f"{name}={text!r} is not a number"
        if not value > 0:
            return f"{name}={text!r} must be positive"
        if name in _POSITIVE_INT and not value.is_integer():
            return f"{name}={text!r} must be a whole number"
        if name in _POSITIVE_INT and value >= _MAX_WHOLE:
            return f"{name}={text!r} is too large"
    return None


def _float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _numbers(source: Source, name: str, column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """float64 values of a column and where it holds no number, as ``float()`` reads text."""
    kind = column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        missing = column.is_null().to_numpy(zero_copy_only=False)
        try:   # Arrow parses a subset of what float() does, to the same value
            values = pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False)
        except pa.ArrowInvalid:   # the rest (' 1', '1_0', words): one by one
            parsed = [_float(v) for v in column.to_pylist()]
            return np.array([np.nan if v is None else v for v in parsed], np.float64), np.array(
                [v is None for v in parsed], bool)
        for i in np.flatnonzero(np.isnan(values) & ~missing):   # Arrow also takes 'nan(1)'
            missing[i] = _float(column[i].as_py()) is None
        return values, missing
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind):
        values = pc.cast(column, pa.float64(), safe=False).to_numpy(zero_copy_only=False)
        return values, column.is_null().to_numpy(zero_copy_only=False)
    raise UserError(f"{source.path}: column {name} holds {kind}, not numbers; store numbers or text")


def _check(source: Source, batch: pa.RecordBatch, lines: np.ndarray, bad: list) -> Chunk:
    """The column-wise checks of ``_row_problem``, same order, same messages."""
    first = np.full(batch.num_rows, -1, np.int16)   # per row: the first check it fails
    problems: list = ["empty path"]

    def fail(mask, problem):
        first[mask & (first < 0)] = len(problems)
        problems.append(problem)

    path = batch.column(source.index["path"])
    if not (pa.types.is_string(path.type) or pa.types.is_large_string(path.type)):
        raise UserError(f"{source.path}: column path holds {path.type}, not text; store the paths as text")
    lengths, lead = _lead_bytes(path)   # only a path that starts with a space (or non-ASCII) can be blank
    maybe = np.flatnonzero((lengths == 0) | ((lead >= 9) & (lead <= 13)) | ((lead >= 0x1c) & (lead <= 0x20))
                           | (lead >= 0x80))
    blank = pc.match_substring_regex(path.take(maybe), _BLANK).fill_null(True).to_numpy(zero_copy_only=False)
    first[maybe[blank]] = 0
    numbers = {}
    for name in _NUMERIC:
        values, missing = _numbers(source, name, batch.column(source.index[name]))
        fail(missing, (name, "is not a number"))
        with np.errstate(invalid="ignore"):
            fail(~(values > 0), (name, "must be positive"))
            if name in _POSITIVE_INT:
                fail(~(np.floor(values) == values) | ~np.isfinite(values), (name, "must be a whole number"))
                fail(values >= _MAX_WHOLE, (name, "is too large"))
        numbers[name] = values
    failed = np.flatnonzero(first >= 0)
    for i in failed:
        problem = problems[first[i]]
        if isinstance(problem, str):
            bad.append((int(lines[i]), problem))
        else:
            text = batch.column(source.index[problem[0]])[i].as_py()
            bad.append((int(lines[i]), f"{problem[0]}={text!r} {problem[1]}"))
    rows = pa.Table.from_batches([batch])
    if len(failed):
        keep = first < 0
        numbers = {k: v[keep] for k, v in numbers.items()}
        if len(failed) > 64:   # many bad rows: one copy of the good ones
            rows = pa.Table.from_batches([batch.filter(pa.array(keep))])
        else:                  # a few: the good runs in between, without copying
            edges = np.concatenate([[-1], failed, [batch.num_rows]])
            rows = pa.Table.from_batches([batch.slice(a + 1, b - a - 1) for a, b in zip(edges[:-1], edges[1:])
                                          if b - a > 1], schema=batch.schema)
    numbers.update({k: numbers[k].astype(np.int64) for k in _POSITIVE_INT})
    return Chunk(rows, numbers, sorted(bad))


def _first_bad_utf8(path: Path) -> int | None:
    """Byte offset of the first byte that is not UTF-8 (the slow path of an error message)."""
    offset, carry = 0, b""
    with open(path, "rb") as handle:
        while True:
            block = handle.read(1 << 24)
            data = carry + block
            try:
                data.decode("utf-8")
                offset, carry = offset + len(data), b""
            except UnicodeDecodeError as exc:
                if block and exc.reason == "unexpected end of data":
                    offset, carry = offset + exc.start, data[exc.start:]
                else:
                    return offset + exc.start
            if not block:
                return None


# ---------------------------------------------------------------------------- sinks


class _Sink:
    """Takes checked chunks; counts rows, keeps bad rows and the digest of what the bucket plan
    depends on (paths, frames, heights, widths); subclasses keep the rows."""

    def __init__(self, source: Source):
        self.source, self.rows, self.relative = source, 0, 0
        self.bad_lines, self.bad_reasons = [], []
        self._hashes = [hashlib.sha256() for _ in range(5)]

    def consume(self, chunks: Iterator[Chunk]):
        for chunk in chunks:
            self.rows += chunk.rows.num_rows + len(chunk.bad)
            self.bad_lines += [line for line, _ in chunk.bad]
            self.bad_reasons += [why for _, why in chunk.bad]
            for path in chunk.rows.column(self.source.index["path"]).chunks:
                self.relative += int((_lead_bytes(path)[1] != ord("/")).sum())
                lengths, data = _string_parts(path)
                self._hashes[0].update(lengths.astype(np.int64).data)
                self._hashes[1].update(data)
            for digest, key in zip(self._hashes[2:], _POSITIVE_INT):
                digest.update(np.ascontiguousarray(chunk.numbers[key]).data)
            self.add(chunk)
        info = {"version": _CACHE_VERSION, "unit": self.source.unit, "rows": self.rows, "relative": self.relative,
                "digest": hashlib.sha256(b"".join(h.digest() for h in self._hashes)).hexdigest()[:32]}
        bad = pa.table({"line": pa.array(self.bad_lines, pa.int64()), "reason": pa.array(self.bad_reasons, pa.string())})
        return self.finish(info, bad)


class _MemorySink(_Sink):
    def __init__(self, source: Source):
        super().__init__(source)
        self.batches, self.numbers = [], {k: [] for k in _STORED}

    def add(self, chunk: Chunk) -> None:
        self.batches += chunk.rows.to_batches()
        for key in _STORED:
            self.numbers[key].append(chunk.numbers[key])

    def finish(self, info: dict, bad: pa.Table) -> Metadata:
        table = pa.Table.from_batches(self.batches, schema=self.source.schema)
        numbers = {}
        for key in _STORED:   # one column at a time: the parts of only one are held twice
            parts = self.numbers.pop(key)
            numbers[key] = np.concatenate(parts) if parts else np.zeros(0, _STORED[key])
            del parts
        return Metadata(self.source.path, table, numbers, bad, info)


class _DiskSink(_Sink):
    """Writes ``rows.arrow`` (Arrow IPC, every column), ``<number>.bin`` (raw), ``bad.arrow`` and
    ``manifest.json`` into a folder."""

    def __init__(self, folder: Path, source: Source):
        super().__init__(source)
        self.folder, self.kept = folder, 0
        self.writer = ipc.new_file(str(folder / "rows.arrow"), source.schema)
        self.files = {key: open(folder / f"{key}.bin", "wb") for key in _STORED}

    def add(self, chunk: Chunk) -> None:
        self.writer.write_table(chunk.rows)
        self.kept += chunk.rows.num_rows
        for key, dtype in _STORED.items():
            self.files[key].write(np.ascontiguousarray(chunk.numbers[key], dtype).data)

    def finish(self, info: dict, bad: pa.Table) -> None:
        self.writer.close()
        for handle in self.files.values():
            handle.close()
        with ipc.new_file(str(self.folder / "bad.arrow"), bad.schema) as writer:
            writer.write_table(bad)
        info = {**info, "kept": self.kept, "source_bytes": self.source.size}
        (self.folder / "manifest.json").write_text(json.dumps(info, indent=1))


def _string_parts(array: pa.Array) -> tuple[np.ndarray, memoryview]:
    """(byte length of each value, the values' bytes back to back) of a string array."""
    width = 8 if pa.types.is_large_string(array.type) else 4
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int64 if width == 8 else np.int32,
                            count=len(array) + 1, offset=array.offset * width)
    data = array.buffers()[2]
    view = memoryview(data)[int(offsets[0]) : int(offsets[-1])] if data is not None else memoryview(b"")
    return np.diff(offsets), view


def _lead_bytes(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(byte length, first byte or 0) of each value of a string array."""
    lengths, data = _string_parts(array)
    starts = np.concatenate([[0], np.cumsum(lengths[:-1])]) if len(lengths) else lengths
    lead = np.zeros(len(lengths), np.uint8)
    filled = lengths > 0
    lead[filled] = np.frombuffer(data, np.uint8)[starts[filled]]
    return lengths, lead


def _open_entry(source: Path, entry: Path) -> Metadata:
    info = json.loads((entry / "manifest.json").read_text())
    _touch(entry / "manifest.json")
    table = ipc.open_file(pa.memory_map(str(entry / "rows.arrow"))).read_all()
    bad = ipc.open_file(pa.memory_map(str(entry / "bad.arrow"))).read_all()
    numbers = {key: (np.memmap(entry / f"{key}.bin", dtype=dtype, mode="r").view(np.ndarray) if info["kept"]
                     else np.zeros(0, dtype)) for key, dtype in _STORED.items()}
    return Metadata(source, table, numbers, bad, info, entry)


# ---------------------------------------------------------------------------- the node cache


def _touch(path: Path) -> None:
    try:
        os.utime(path)   # last use, for pruning
    except OSError:
        pass


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK") or 0)


def _cache_folder(setting, size: int) -> Path | None:
    if setting is None or str(setting) in ("off", ""):
        return None
    if str(setting) == "auto":
        if size < AUTO_CACHE_BYTES:
            return None
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "videodit" / "metadata"
    return Path(setting).expanduser()


def _entry_key(path: Path, sample: int = 1 << 16, blocks: int = 64) -> str:
    """The file's size, mtime and a content hash of up to ``blocks`` evenly spread 64 KiB
    blocks (the whole file when it is smaller than that), as a folder name."""
    stat = path.stat()
    digest = hashlib.sha256(f"videodit metadata v{_CACHE_VERSION}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    with open(path, "rb") as handle:
        if stat.st_size <= sample * blocks:
            digest.update(handle.read())
        else:
            for offset in np.linspace(0, stat.st_size - sample, blocks).astype(np.int64):
                handle.seek(int(offset))
                digest.update(handle.read(sample))
    return digest.hexdigest()[:32]


def _build_once(entry: Path, build: Callable[[Path], None]) -> bool:
    """Make the folder ``entry`` with ``build(tmp)`` unless it exists; True if this process made it.

    One process builds at a time (an exclusive lock on ``.<entry>.lock``); ranks other than
    local rank 0 first give rank 0 up to a minute to take the lock, then queue behind it. The
    folder appears complete or not at all (built aside, renamed into place). A builder that
    fails or dies releases the lock and the next waiter builds instead.
    """
    if entry.is_dir():
        return False
    entry.parent.mkdir(parents=True, exist_ok=True)
    lock = entry.parent / f".{entry.name}.lock"
    deadline = time.monotonic() + (_WAIT_FOR_FIRST_RANK_S if _local_rank() > 0 else 0)
    while time.monotonic() < deadline and not entry.is_dir() and not _locked(lock):
        time.sleep(0.05)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if entry.is_dir():
            return False
        tmp = entry.parent / f".{entry.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            build(tmp)
            os.rename(tmp, entry)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if entry.is_dir():   # another node's builder won a race over a shared folder
                return False
            raise
        return True
    finally:
        os.close(fd)


def _locked(lock: Path) -> bool:
    """Whether some process holds ``lock`` (is building) right now."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _prune(folder: Path, keep: int | None, max_age_s: float = 30 * 86400) -> None:
    """Remove cache entries unused for ``max_age_s`` (or all but the ``keep`` most recently
    used), and locks and half-built folders left more than a day ago."""
    try:
        now, entries = time.time(), []
        for child in folder.iterdir():
            if child.name.startswith("."):   # a lock, or what a build that died left behind
                stale = child.name.endswith(".tmp") or not (folder / child.name[1:-len(".lock")]).is_dir()
                if stale and now - child.stat().st_mtime > 86400:
                    shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink()
            elif child.is_dir():
                used = child / "manifest.json"
                entries.append(((used if used.exists() else child).stat().st_mtime, child))
        entries.sort(reverse=True)
        for i, (used, child) in enumerate(entries):
            if now - used > max_age_s or (keep is not None and i >= keep):
                shutil.rmtree(child, ignore_errors=True)
    except OSError:
        pass


# ---------------------------------------------------------------------------- writing


def write_csv(path: str | Path, columns: tuple[str, ...] | list[str], rows: list[dict]) -> None:
    """Write ``rows`` as CSV atomically, with ``\\n`` line ends for stable bytes."""
    from videodit.data.video import atomic_output   # video.py pulls in PyAV; metadata stays light

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    with atomic_output(path) as tmp:
        tmp.write_text(buffer.getvalue(), encoding="utf-8", newline="")


class TableWriter:
    """Writes record batches to ``path`` atomically: Parquet for ``.parquet``/``.pq``, else CSV."""

    def __init__(self, path: str | Path, schema: pa.Schema):
        from videodit.data.video import atomic_output

        self._context = atomic_output(path)
        tmp = self._context.__enter__()
        parquet = Path(path).suffix.lower() in PARQUET_SUFFIXES
        self._writer = pq.ParquetWriter(str(tmp), schema) if parquet else pcsv.CSVWriter(str(tmp), schema)

    def write(self, table: pa.Table) -> None:
        self._writer.write(table)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._writer.close()
        self._context.__exit__(*exc)


def convert_metadata(src: str | Path, dst: str | Path, progress: bool = True) -> dict:
    """Write a metadata file in another format (``.parquet`` or CSV by ``dst``'s suffix): the
    good rows, with num_frames/height/width as int64 and aspect_ratio/fps as float64; bad rows
    are left out and counted."""
    source = Source(Path(src), option="the input")
    if Path(dst).resolve() == source.path.resolve():
        raise UserError(f"{dst} is the input file; write the converted table to another file")
    types = {name: pa.int64() if name in _POSITIVE_INT else pa.float64() for name in _NUMERIC}
    schema = pa.schema([pa.field(f.name, types.get(f.name, f.type)) for f in source.schema])
    rows = bad = 0
    first_bad = None
    with TableWriter(dst, schema) as writer:
        for chunk in source.chunks(progress):
            columns = [pa.chunked_array([chunk.numbers[f.name]], types[f.name]) if f.name in types else
                       chunk.rows.column(i) for i, f in enumerate(source.schema)]
            writer.write(pa.Table.from_arrays(columns, schema=schema))
            rows, bad = rows + chunk.rows.num_rows, bad + len(chunk.bad)
            first_bad = first_bad or (chunk.bad[0] if chunk.bad else None)
    return {"rows": rows, "bad_rows": bad, "first_bad": first_bad, "unit": source.unit, "out": str(dst)}
