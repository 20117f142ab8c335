"""Metadata tables with Open-Sora's columns, from CSV or Parquet, read column-wise.

Columns: ``path, text, num_frames, height, width, aspect_ratio, fps`` (``resolution`` and any
other columns are kept). Relative paths resolve against the file's folder, lazily:
``Metadata.path(i)`` builds one path when a sample is read; no Python object is made per row.

A read streams the file in blocks through pyarrow and checks each block column-wise, with the
row-by-row reader's rules and messages: an empty path, a size or rate that is not a positive
number, a frame count or size that is not whole, a row with more fields than the header. Bad
rows are skipped and counted with their CSV line (Parquet: row number), or refused all at
once with ``bad_rows="error"``; a Parquet column of the wrong type (numbers stored as text) is
refused whole. A FIFO, socket, device or folder is refused, never waited on (``user_files``).

The node cache (``cache=FOLDER``, or ``"auto"``: ``~/.cache/videodit/metadata`` for files of 64
MiB or more). The checked table is written once, as Arrow IPC plus raw numeric columns, into
``FOLDER/KEY/`` (KEY: the file's inode, ctime, size, mtime, a sampled content hash and this reader's code;
``data/node_cache.py``). The first local rank
(``LOCAL_RANK`` 0) builds it under a file lock; the other local ranks wait on the lock, then
every rank memory-maps the same files, so node memory holds one copy however many ranks read
it. ``Metadata.shared`` does the same for arrays derived from the table (an epoch's buckets).
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import hashlib
import io
import json
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
from tqdm import tqdm

from videodit.data.columns import Column
from videodit.data.node_cache import build_once, cache_folder, entry_key, local_rank, prune, touch
from videodit.errors import UserError, os_error_message
from videodit.user_files import NotRegularFile, check_regular_file, open_user_file

REQUIRED_COLUMNS = ("path", "text", "num_frames", "height", "width", "aspect_ratio", "fps")
_POSITIVE_INT = ("num_frames", "height", "width")
_NUMERIC = _POSITIVE_INT + ("aspect_ratio", "fps")
_STORED = {"num_frames": np.int64, "height": np.int64, "width": np.int64, "fps": np.float64}
PARQUET_SUFFIXES = (".parquet", ".pq")
AUTO_CACHE_BYTES = 64 << 20        # data.metadata_cache=auto caches files at least this large
_CACHE_VERSION = 1
_CODE = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()   # a changed reader reads again
BLOCK_BYTES = 4 << 20             # a CSV is parsed and checked in blocks of this many bytes
_MAX_WHOLE = 2.0 ** 53             # frame counts and sizes beyond this are not exact in float64
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
    CSV columns as text) as read-only sequences that make one value at a time; ``bad_rows``:
    (CSV line or Parquet row, reason) of the rows skipped; ``read_report``."""

    def __init__(self, source: Path, table: pa.Table, numbers: dict, bad: pa.Table, info: dict,
                 entry: Path | None = None):
        self.csv_path = self.source = Path(source)
        self.root = self.source.parent
        self.table, self._numbers, self._bad, self.info, self._entry = table, numbers, bad, info, entry
        self.num_frames, self.heights, self.widths, self.fps = (numbers[k] for k in _STORED)
        self.unit, self.digest, self.has_relative_paths = info["unit"], info["digest"], info["relative"] > 0
        self.read_report: ReadReport | None = None
        self.paths = Column(table.column("path"), self._resolve)
        self.texts = Column(table.column("text"), lambda v: "" if v is None else str(v))
        self.columns = {name: Column(table.column(name)) for name in table.column_names}
        self.bad_rows = Column(pc.make_struct(bad.column("line"), bad.column("reason"), field_names=("l", "r")),
                               lambda row: (row["l"], row["r"]))

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

        prune(folder.parent, keep=8) if build_once(folder, write) else touch(folder)
        return {p.stem: np.load(p, mmap_mode="r") for p in sorted(folder.glob("*.npy"))}

    def __reduce__(self):   # DataLoader workers: a cached table is mapped again, not copied
        state = (self.source, None, None, None, self.info, self._entry) if self._entry else (
            self.source, self.table, self._numbers, self._bad, self.info, None)
        return _unpickle, (state, self.read_report)


def _unpickle(state: tuple, report: ReadReport | None) -> Metadata:
    meta = _open_entry(state[0], state[5]) if state[5] else Metadata(*state[:5])
    meta.read_report = report
    return meta


# ---------------------------------------------------------------------------- reading


def read_metadata(path: str | Path, bad_rows: str = "skip", option: str = "data.csv", *,
                  cache: str | Path | None = None, progress: bool = False) -> Metadata:
    """Read and check a metadata CSV or Parquet file (``.parquet``).

    ``bad_rows="skip"`` drops invalid rows (listed in ``Metadata.bad_rows``); ``"error"``
    refuses the file, naming the bad rows. ``option`` is the config key named when the file
    is missing. ``cache``: None or ``"off"`` (not shared), ``"auto"`` or a folder (see the
    module doc). ``progress``: a bar on stderr for reads over 2 s (on local rank 0).
    """
    start, meta = time.perf_counter(), None
    source = Source(Path(path), option)
    folder, show = cache_folder(cache, source.size, AUTO_CACHE_BYTES), progress and local_rank() == 0
    if folder is not None:
        try:
            entry = folder / entry_key(source.path, _CODE)
            built = build_once(entry, lambda tmp: _Sink(source, tmp).consume(source.chunks(show)))
            meta = _open_entry(source.path, entry)
            how = f"{'read and cached in' if built else 'mapped from'} {entry}"
            prune(folder) if built else None
        except OSError as exc:
            if cache != "auto":
                raise UserError(f"metadata cache {folder}: {os_error_message(exc)}, or set "
                                "data.metadata_cache=null") from None
            print(f"warning: metadata cache {folder} not used ({os_error_message(exc)})", file=sys.stderr)
    if meta is None:   # this process's own copy: written aside, mapped, the files deleted at once
        tmp = Path(tempfile.mkdtemp(prefix="videodit-metadata-"))
        try:
            _Sink(source, tmp).consume(source.chunks(show))
            meta, how = _open_entry(source.path, tmp, shared=False), "read (not cached)"
        except OSError as exc:
            raise UserError(f"reading {source.path}: {os_error_message(exc)} (TMPDIR), or set "
                            "data.metadata_cache to a folder") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
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
        if not path.exists():
            kind = "file" if self.parquet else "CSV"
            raise UserError(f"metadata {kind} {str(path)!r} does not exist; set {option} to an existing file")
        try:   # a FIFO, socket, device or folder is refused here, never waited on
            open_user_file(path).close()
        except OSError as exc:
            where = option if isinstance(exc, NotRegularFile) else f"metadata file {path}"
            raise UserError(f"{where}: {os_error_message(exc)}") from None
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
        if self.parquet:
            self._check_parquet_types()

    def _check_parquet_types(self) -> None:
        """A Parquet column has one type for all its rows: numbers stored as text (or bool, dates)
        are refused whole, in one line, as a CSV missing a column is, not parsed value by value
        ('1e1', ' 16'); stored numbers get the CSV's per-value checks (bad rows, per bad_rows)."""
        for name in ("path", "text", *_NUMERIC):
            kind = self.schema.field(name).type
            held, want = _kind(kind), "numbers" if name in _NUMERIC else "text"
            if held != want and not (name == "text" and pa.types.is_null(kind)):
                fix = (f"write it as {'int64' if name in _POSITIVE_INT else 'float64'} (videodit data convert writes a "
                       "CSV as such Parquet), or give the metadata as CSV") if want == "numbers" else \
                    f"store the {'paths' if name == 'path' else 'captions'} as text"
                raise UserError(f"{self.path}: column {name} holds {held}, not {want}; {fix}")

    def chunks(self, progress: bool = False) -> Iterator[Chunk]:
        total = self._rows if self.parquet else self.size
        with tqdm(total=total, unit="rows" if self.parquet else "B", unit_scale=True, leave=False, delay=2,
                  desc=f"reading {self.path.name}", file=sys.stderr, disable=not progress) as bar:
            for batch, lines, bad, done in self._parquet_batches() if self.parquet else self._csv_batches():
                bar.update(done - bar.n)
                yield _check(self, batch, lines, bad)

    def _error(self, exc: Exception) -> UserError:
        text = " ".join(str(exc).split())
        if self.parquet:
            return UserError(f"{self.path} is not a readable Parquet file ({text}); write it with pyarrow or "
                             "pandas, or give a CSV")
        if "UTF8" in text:
            return UserError(f"{self.path} is not UTF-8 text (byte {_first_bad_utf8(self.path)}); save it as UTF-8 CSV")
        return UserError(f"{self.path} is not a readable CSV ({text}); check its quoting")

    def _csv_schema(self) -> pa.Schema:
        try:
            check_regular_file(self.path)   # pyarrow opens by path: never a FIFO it would block on
            reader = pcsv.open_csv(str(self.path), read_options=pcsv.ReadOptions(use_threads=False),
                                   parse_options=pcsv.ParseOptions(newlines_in_values=True,
                                                                   invalid_row_handler=lambda row: "skip"))
        except pa.ArrowInvalid as exc:
            if "Empty CSV file" in str(exc):
                return pa.schema([])
            raise self._error(exc) from None
        with contextlib.closing(reader):
            return pa.schema([(name, pa.string()) for name in reader.schema.names])

    def _csv_batches(self):
        invalid: deque = deque()   # rows whose field count is off: (CSV line, text), checked one by one
        stream = pa.OSFile(str(check_regular_file(self.path)))
        try:
            reader = pcsv.open_csv(
                stream, read_options=pcsv.ReadOptions(use_threads=False, block_size=BLOCK_BYTES),
                parse_options=pcsv.ParseOptions(newlines_in_values=True, invalid_row_handler=lambda row: (
                    invalid.append((row.number, row.text)), "skip")[1]),
                convert_options=pcsv.ConvertOptions(column_types=dict(zip(self.schema.names, self.schema.types))))
            next_line, pending = 2, deque()
            with contextlib.closing(_read_ahead(reader)) as batches:   # the parser stops before the file closes
                for batch in batches:
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
            raise self._error(exc) from None
        finally:
            stream.close()

    def _place(self, batch, start: int, pending: deque, final: bool):
        """Line numbers of ``batch``'s rows, from ``start``, stepping over the rows the parser set
        aside (``pending``, in file order), which are checked here one by one as csv.DictReader
        would give them: a short row may still be good (only extra columns missing) and goes
        back in its place."""
        lines, bad, good = np.arange(start, start + batch.num_rows, dtype=np.int64), [], []
        while pending and (final or (len(lines) and pending[0][0] <= lines[-1])):
            number, text = pending.popleft()
            lines[lines >= number] += 1
            fields = next(csv.reader(io.StringIO(text, newline="")), [])
            row = {**dict.fromkeys(self.schema.names), **dict(zip(self.schema.names, fields))}
            if len(fields) > len(self.schema):
                row[None] = fields[len(self.schema):]
            problem = _row_problem(row)
            (bad.append((number, problem)) if problem else good.append((number, row)))
        if good:
            lines = np.concatenate([lines, [number for number, _ in good]])
            order = np.argsort(lines, kind="stable")
            extra = pa.RecordBatch.from_pylist([row for _, row in good], schema=self.schema)
            merged = pa.Table.from_batches([batch, extra]).take(order).combine_chunks()
            batch, lines = merged.to_batches()[0], lines[order]
        return batch, lines, bad

    def _parquet_schema(self) -> pa.Schema:
        try:
            parquet = pq.ParquetFile(check_regular_file(self.path))
            self._rows, schema = parquet.metadata.num_rows, parquet.schema_arrow
        except (pa.ArrowException, OSError) as exc:
            raise self._error(exc) from None
        return pa.schema([pa.field(f.name, f.type.value_type if pa.types.is_dictionary(f.type) else f.type)
                          for f in schema])

    def _parquet_batches(self):
        row = 1
        try:
            for batch in pq.ParquetFile(check_regular_file(self.path)).iter_batches(batch_size=1 << 16):
                batch = batch if batch.schema == self.schema else batch.cast(self.schema)
                row += batch.num_rows
                yield batch, np.arange(row - batch.num_rows, row, dtype=np.int64), [], row - 1
        except (pa.ArrowException, OSError) as exc:
            raise self._error(exc) from None


def _read_ahead(reader, depth: int = 2) -> Iterator[pa.RecordBatch]:
    """``reader``'s batches, parsed ahead in a thread (pyarrow parses without the GIL) while the
    caller checks and stores the previous ones."""
    batches, stop = queue.Queue(depth), threading.Event()

    def parse():
        try:
            while not stop.is_set():
                batches.put(reader.read_next_batch())
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
        while thread.is_alive():   # a put blocked on the full queue
            with contextlib.suppress(queue.Empty):
                batches.get(timeout=0.1)


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


def _kind(kind: pa.DataType) -> str:
    """What a column holds: "text", "numbers" or its type's name."""
    t = pa.types
    return "text" if t.is_string(kind) or t.is_large_string(kind) else "numbers" if (
        t.is_integer(kind) or t.is_floating(kind) or t.is_decimal(kind)) else str(kind)


def _float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _numbers(source: Source, name: str, column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """float64 values of a column and where it holds no number, as ``float()`` reads text."""
    kind, missing = column.type, column.is_null().to_numpy(zero_copy_only=False)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        try:   # Arrow parses a subset of what float() takes, to the same value
            values = pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False)
        except pa.ArrowInvalid:   # the rest (' 1', '1_0', words): one by one
            parsed = [_float(v) for v in column.to_pylist()]
            return np.array([np.nan if v is None else v for v in parsed]), np.array([v is None for v in parsed])
        for i in np.flatnonzero(np.isnan(values) & ~missing):   # Arrow also takes 'nan(1)'
            missing[i] = _float(column[i].as_py()) is None
        return values, missing
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind):
        return pc.cast(column, pa.float64(), safe=False).to_numpy(zero_copy_only=False), missing
    raise UserError(f"{source.path}: column {name} holds {kind}, not numbers; store numbers or text")


def _check(source: Source, batch: pa.RecordBatch, lines: np.ndarray, bad: list) -> Chunk:
    """``_row_problem`` column-wise: the same checks in the same order, the same messages."""
    first = np.full(batch.num_rows, -1, np.int16)   # per row: the first check it fails
    problems: list = [("path", "empty path")]

    def fail(mask, problem):
        first[mask & (first < 0)] = len(problems)
        problems.append(problem)

    path = batch.column(source.index["path"])   # text: a CSV's always, a Parquet file's checked at open
    lengths, lead = _lead_bytes(path)   # only a path that starts with a space (or non-ASCII) can be blank
    maybe = np.flatnonzero((lengths == 0) | ((lead >= 9) & (lead <= 13)) | ((lead >= 0x1c) & (lead <= 0x20))
                           | (lead >= 0x80))
    first[maybe[pc.match_substring_regex(path.take(maybe), _BLANK).fill_null(True).to_numpy(False)]] = 0
    numbers = {}
    for name in _NUMERIC:
        values, missing = numbers[name] = _numbers(source, name, batch.column(source.index[name]))
        fail(missing, (name, "is not a number"))
        with np.errstate(invalid="ignore"):
            fail(~(values > 0), (name, "must be positive"))
            if name in _POSITIVE_INT:
                fail(~(np.floor(values) == values) | ~np.isfinite(values), (name, "must be a whole number"))
                fail(values >= _MAX_WHOLE, (name, "is too large"))
    failed, keep = np.flatnonzero(first >= 0), first < 0
    for i in failed:
        name, what = problems[first[i]]
        text = "" if name == "path" else f"{name}={batch.column(source.index[name])[i].as_py()!r} "
        bad.append((int(lines[i]), text + what))
    numbers = {k: (v[keep] if len(failed) else v).astype(np.int64 if k in _POSITIVE_INT else np.float64, copy=False)
               for k, (v, _) in numbers.items()}
    if len(failed) > 64:   # many bad rows: one copy of the good ones
        rows = pa.Table.from_batches([batch.filter(pa.array(keep))])
    else:                  # a few: the good runs between them, not copied
        edges = np.concatenate([[-1], failed, [batch.num_rows]])
        rows = pa.Table.from_batches([batch.slice(a + 1, b - a - 1) for a, b in zip(edges[:-1], edges[1:])
                                      if b - a > 1], schema=batch.schema)
    return Chunk(rows, numbers, sorted(bad))


def _first_bad_utf8(path: Path) -> int | None:
    """Byte offset of the first byte that is not UTF-8 (for the error message only)."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open_user_file(path) as handle:
        while True:
            block, pending = handle.read(1 << 24), len(decoder.getstate()[0])
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                return offset - pending + exc.start
            if not block:
                return None
            offset += len(block)


# ---------------------------------------------------------------------------- where rows go


class _Sink:
    """Writes checked chunks into a folder, block by block: ``rows.arrow`` (Arrow IPC, every
    column), ``<number>.bin`` (raw), ``bad.arrow`` and ``manifest.json`` (row counts, and the
    digest of what the bucket plan depends on: paths, frames, heights, widths)."""

    def __init__(self, source: Source, folder: Path):
        self.source, self.folder, self.rows, self.kept, self.relative, self.bad = source, folder, 0, 0, 0, []
        self._hashes = [hashlib.sha256() for _ in range(5)]
        self.writer = ipc.new_file(str(folder / "rows.arrow"), source.schema)
        self.files = {key: open(folder / f"{key}.bin", "wb") for key in _STORED}

    def consume(self, chunks: Iterator[Chunk]):
        for chunk in chunks:
            self.rows += chunk.rows.num_rows + len(chunk.bad)
            self.bad += chunk.bad
            for path in chunk.rows.column(self.source.index["path"]).chunks:
                self.relative += int((_lead_bytes(path)[1] != ord("/")).sum())
                lengths, data = _string_parts(path)
                self._hashes[0].update(lengths.astype(np.int64).data)
                self._hashes[1].update(data)
            for digest, key in zip(self._hashes[2:], _POSITIVE_INT):
                digest.update(np.ascontiguousarray(chunk.numbers[key]).data)
            self.writer.write_table(chunk.rows)
            self.kept += chunk.rows.num_rows
            for key, handle in self.files.items():
                handle.write(np.ascontiguousarray(chunk.numbers[key]).data)
        self.writer.close()
        for handle in self.files.values():
            handle.close()
        bad = pa.table({"line": pa.array([line for line, _ in self.bad], pa.int64()),
                        "reason": pa.array([why for _, why in self.bad], pa.string())})
        with ipc.new_file(str(self.folder / "bad.arrow"), bad.schema) as writer:
            writer.write_table(bad)
        digest = hashlib.sha256(b"".join(h.digest() for h in self._hashes)).hexdigest()[:32]
        (self.folder / "manifest.json").write_text(json.dumps({
            "version": _CACHE_VERSION, "unit": self.source.unit, "rows": self.rows, "kept": self.kept,
            "relative": self.relative, "digest": digest, "bytes": self.source.size}))
        # The parse blocks are freed, but Arrow's allocator keeps their pages (~0.12 GiB at 10M
        # rows) for the whole run unless told: training maps the table from here on.
        pa.default_memory_pool().release_unused()


def _string_parts(array: pa.Array) -> tuple[np.ndarray, memoryview]:
    """(byte length of each value, the values' bytes back to back) of a string array."""
    width = 8 if pa.types.is_large_string(array.type) else 4
    offsets = np.frombuffer(array.buffers()[1], dtype=f"i{width}", count=len(array) + 1, offset=array.offset * width)
    data = array.buffers()[2]
    return np.diff(offsets), memoryview(data if data is not None else b"")[int(offsets[0]) : int(offsets[-1])]


def _lead_bytes(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(byte length, first byte or 0) of each value of a string array."""
    lengths, data = _string_parts(array)
    filled, lead = lengths > 0, np.zeros(len(lengths), np.uint8)
    lead[filled] = np.frombuffer(data, np.uint8)[(np.cumsum(lengths) - lengths)[filled]]
    return lengths, lead


def _open_entry(source: Path, entry: Path, shared: bool = True) -> Metadata:
    """Map a folder ``_Sink`` wrote (``shared=False``: a private one about to be deleted)."""
    info = json.loads((entry / "manifest.json").read_text())
    touch(entry / "manifest.json")
    table, bad = (ipc.open_file(pa.memory_map(str(entry / name))).read_all() for name in ("rows.arrow", "bad.arrow"))
    numbers = {key: np.memmap(entry / f"{key}.bin", dtype, "r").view(np.ndarray) if info["kept"] else
               np.zeros(0, dtype) for key, dtype in _STORED.items()}
    return Metadata(source, table, numbers, bad, info, entry if shared else None)


# ---------------------------------------------------------------------------- writing


def write_csv(path: str | Path, columns: tuple[str, ...] | list[str], rows: list[dict]) -> None:
    """Write ``rows`` as CSV atomically, with ``\\n`` line ends for stable bytes."""
    from videodit.data.video_write import atomic_output   # video_write.py pulls in PyAV; metadata stays light

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    with atomic_output(path) as tmp:
        tmp.write_text(buffer.getvalue(), encoding="utf-8", newline="")


@contextlib.contextmanager
def table_writer(path: str | Path, schema: pa.Schema):
    """A writer of tables to ``path``, moved into place on success: Parquet for ``.parquet`` /
    ``.pq``, else CSV."""
    from videodit.data.video_write import atomic_output

    with atomic_output(path) as tmp:
        parquet = Path(path).suffix.lower() in PARQUET_SUFFIXES
        with contextlib.closing(pq.ParquetWriter(str(tmp), schema) if parquet else
                                pcsv.CSVWriter(str(tmp), schema)) as writer:
            yield writer


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
    first = None
    with table_writer(dst, schema) as writer:
        for chunk in source.chunks(progress):
            writer.write(pa.Table.from_arrays([pa.chunked_array([chunk.numbers[f.name]], types[f.name])
                                               if f.name in types else chunk.rows.column(i)
                                               for i, f in enumerate(source.schema)], schema=schema))
            rows, bad, first = rows + chunk.rows.num_rows, bad + len(chunk.bad), first or next(iter(chunk.bad), None)
    return {"rows": rows, "bad_rows": bad, "first_bad": first, "unit": source.unit, "out": str(dst)}
