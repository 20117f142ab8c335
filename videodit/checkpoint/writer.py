"""Writing checkpoint files: checked, hashed and fsynced, and the safetensors encoder.

Files are written with checked ``os.write`` calls and hashed while they are written, so a
full disk or a permission problem surfaces as an error instead of a short file with a
valid-looking manifest. :class:`Pipe` overlaps the hashing and fsyncs of one checkpoint's
files with their writing: the thread that writes never hashes (the SHA-256 of each file runs
on a hasher thread while the next chunk is written) and a file is fsynced while the next one
is written. ``torch.save`` (the optimizer state) skips its own CRC-32 of every record, which
the SHA-256 makes redundant. Nothing here knows the layout of a checkpoint folder (that is
``io.py``) or unpickles anything.

Memory handed to a helper thread stays alive until the helper is done with it: the writer
holds the tensors it streams from, and copies any other large buffer (``torch.save``'s pickle
record) before queueing it.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import json
import os
import queue
import threading
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHUNK = 16 << 20         # bytes per write() / hash update
_SMALL = 64 << 10        # writes below this are gathered into one buffer (torch.save writes many small records)


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder after creating, renaming or removing entries in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file already on disk, hex."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(CHUNK)
        view = memoryview(buffer)
        while count := handle.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


class Done:
    """The outcome of a call handed to a :class:`Worker`: ``wait()`` / ``result()``."""

    def __init__(self):
        self._event = threading.Event()
        self.error: BaseException | None = None
        self.value: Any = None

    def wait(self) -> BaseException | None:
        self._event.wait()
        return self.error

    def result(self):
        if self.wait() is not None:
            raise self.error
        return self.value


class Worker:
    """One helper thread running submitted calls in order. (Not concurrent.futures: it refuses
    new work once the interpreter starts shutting down, which is exactly when the last async
    save of a run that forgot ``wait()`` is still writing.)"""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args, done = item
            try:
                done.value = fn(*args)
            except BaseException as exc:
                done.error = exc
            finally:
                done._event.set()

    def submit(self, fn, *args) -> Done:
        done = Done()
        self._queue.put((fn, args, done))
        return done

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()


class _Pool:
    """The helper threads every checkpoint write of this process shares: hashers (one on a
    2-core machine: one core writes, the other hashes; two on more cores, which keep up with
    one writer) and one fsync thread. Started on first use and kept, because starting threads
    on a busy machine costs milliseconds each; started again in a forked child."""

    _lock = threading.Lock()
    _pid: int | None = None
    hashers: list[Worker] = []
    syncer: Worker | None = None
    _next = 0

    @classmethod
    def get(cls) -> type[_Pool]:
        with cls._lock:
            if cls._pid != os.getpid():
                count = 1 if (os.cpu_count() or 1) <= 2 else 2
                cls.hashers = [Worker(f"videodit-sha256-{i}") for i in range(count)]
                cls.syncer = Worker("videodit-fsync")
                cls._pid, cls._next = os.getpid(), 0
        return cls

    @classmethod
    def hasher(cls) -> Worker:
        with cls._lock:
            worker = cls.hashers[cls._next % len(cls.hashers)]
            cls._next += 1
        return worker


def shared_hasher() -> Worker:
    """A hasher thread of the process's shared pool (for hashing while reading, too)."""
    return _Pool.get().hasher()


class Pipe:
    """Helper threads for one checkpoint write: each file's chunks are hashed in order on a
    hasher thread while the next chunks are written (files spread over the hashers), and a
    finished file is fsynced on the fsync thread while the next one is written. Hashing and
    fsync release the GIL. The threads are shared by the process (:class:`_Pool`). Without a
    pipe, writers hash and fsync inline."""

    MAX_PENDING = 256 << 20   # bytes a file may have queued for hashing before its writer waits

    def __init__(self):
        self._pool = _Pool.get()
        self.syncer = self._pool.syncer
        self.syncs: list[Done] = []
        self.hashes: list[Done] = []

    def hasher(self) -> Worker:
        return self._pool.hasher()

    def hash_file(self, path: Path) -> Done:
        """The SHA-256 of a file already written (``.result()``), computed on a hasher thread."""
        done = self.hasher().submit(sha256_file, path)
        self.hashes.append(done)
        return done

    def sync_close(self, fd: int, path: Path) -> None:
        self.syncs.append(self.syncer.submit(_fsync_close, fd, path))

    def finish(self) -> None:
        """Wait for every fsync; raise the first error."""
        syncs, self.syncs = self.syncs, []
        errors = [e for e in (done.wait() for done in syncs) if e is not None]
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Wait until the helpers are done with this write (on an error path too: every file
        closed, no hash still reading memory the caller is about to free)."""
        for done in [*self.syncs, *self.hashes]:
            done.wait()
        self.syncs, self.hashes = [], []


def _fsync_close(fd: int, path: Path) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
    finally:
        os.close(fd)


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


class HashingWriter:
    """A binary file written with checked ``os.write`` calls, SHA-256 computed on the way.

    ``close()`` fsyncs (or hands the fsync to the pipe); ``record()`` waits for the hash.
    Every OSError carries the file name; ``error`` keeps the first one (``torch.save`` turns
    exceptions raised by ``write`` into an opaque RuntimeError).

    With a pipe, large chunks are hashed later on a helper thread, so their memory must stay
    valid until then: :meth:`write_held` takes memory the caller keeps alive (and ``hold()``
    keeps objects alive until the hashes are done); :meth:`write` copies a large buffer unless
    it lies inside a tensor registered with :meth:`hold`.
    """

    def __init__(self, path: Path, pipe: Pipe | None = None):
        self.path = path
        self.pipe = pipe
        self.sha = hashlib.sha256()
        self.bytes = 0
        self.error: OSError | None = None
        self._buffer = bytearray()
        self._hasher = pipe.hasher() if pipe is not None else None
        self._hashing: deque = deque()   # (Done, bytes, owner) queued on the hasher
        self._hashing_bytes = 0
        self._held: list = []
        self._ranges: list[tuple[int, int]] = []   # sorted [start, end) of held tensors' memory
        self.fd = -1
        self.fd = self._call(os.open, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except OSError as exc:
            if exc.filename is None:
                exc = OSError(exc.errno, exc.strerror or str(exc), str(self.path))
            self.error = self.error or exc
            raise exc from None

    def hold(self, tensors) -> None:
        """Keep ``tensors`` (CPU) alive until the file's hash is done; writes of their memory
        through :meth:`write` are then hashed without a copy."""
        for tensor in tensors:
            self._held.append(tensor)
            storage = tensor.untyped_storage()
            if storage.nbytes():
                bisect.insort(self._ranges, (storage.data_ptr(), storage.data_ptr() + storage.nbytes()))

    def _is_held(self, view: memoryview) -> bool:
        if not self._ranges:
            return False
        start = _address(view)
        i = bisect.bisect_right(self._ranges, (start, float("inf"))) - 1
        return i >= 0 and self._ranges[i][0] <= start and start + len(view) <= self._ranges[i][1]

    def write(self, data) -> int:
        """Write bytes the caller may free or reuse once this returns (``torch.save``'s contract)."""
        view = memoryview(data).cast("B")
        size = len(view)
        if size < _SMALL:
            self._buffer += view
            if len(self._buffer) >= CHUNK:
                self._drain()
        elif self._hasher is None or self._is_held(view):
            self._drain()
            self._put(view)
        else:
            self._drain()
            copy = bytes(view)
            self._put(memoryview(copy), copy)
        return size

    def write_held(self, data, owner=None) -> int:
        """Write memory that stays valid until :meth:`record` (or that ``owner`` keeps alive)."""
        view = memoryview(data).cast("B")
        if len(view) < _SMALL:
            return self.write(view)
        self._drain()
        self._put(view, owner)
        return len(view)

    def flush(self) -> None:   # torch.save calls it; the data reaches the disk in close()
        pass

    def _drain(self) -> None:
        if self._buffer:
            buffer, self._buffer = self._buffer, bytearray()
            self._put(memoryview(buffer), buffer)

    def _hash(self, chunk: memoryview, owner) -> None:
        if self._hasher is None:
            self.sha.update(chunk)
            return
        while self._hashing and self._hashing_bytes > self.pipe.MAX_PENDING:
            done, size, _ = self._hashing.popleft()
            done.result()
            self._hashing_bytes -= size
        self._hashing.append((self._hasher.submit(self.sha.update, chunk), len(chunk), owner))
        self._hashing_bytes += len(chunk)

    def _put(self, view: memoryview, owner=None) -> None:
        for start in range(0, len(view), CHUNK):
            chunk = view[start : start + CHUNK]
            self._hash(chunk, owner)
            while len(chunk):
                written = self._call(os.write, self.fd, chunk)
                if written <= 0:
                    self._call(_raise, OSError(errno.EIO, "write returned 0"))
                chunk = chunk[written:]
        self.bytes += len(view)

    def _wait_hashing(self) -> None:
        while self._hashing:
            self._hashing.popleft()[0].result()
        self._hashing_bytes = 0
        self._held, self._ranges = [], []

    def close(self) -> None:
        try:
            self._drain()
            if self.pipe is not None:
                fd, self.fd = self.fd, -1
                self.pipe.sync_close(fd, self.path)
                return
            self._call(os.fsync, self.fd)
        finally:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def abort(self) -> None:
        for done, _, _ in self._hashing:   # the chunks may point into memory about to be freed
            done.wait()
        self._hashing.clear()
        self._held, self._ranges = [], []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def record(self) -> dict:
        self._wait_hashing()
        return {"bytes": self.bytes, "sha256": self.sha.hexdigest()}


def _raise(exc: BaseException):
    raise exc


_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code
SAFETENSORS_DTYPES = _ST_DTYPES   # torch dtype -> the safetensors dtype code


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy (writable: reading
    a file into them fills the tensor)."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> dict:
    """Write ``tensors`` in the safetensors format (byte for byte what ``safetensors.torch.save_file``
    writes for the usual dtypes; read it with ``safetensors.torch.load_file``).

    Streams each tensor's memory straight to disk (no serialised copy), hashing as it
    goes; fsyncs. Returns ``{"bytes", "sha256"}``. Raises OSError (with the file name).
    """
    return _write_file(path, None, lambda writer: _fill_safetensors(writer, tensors, metadata)).record()


def _fill_safetensors(writer: HashingWriter, tensors: dict[str, torch.Tensor], metadata: dict | None) -> None:
    prepared = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        if tensor.dtype not in _ST_DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        prepared[name] = tensor
    # The safetensors library's own order: larger element sizes first, then by name.
    order = sorted(prepared, key=lambda n: (-prepared[n].element_size(), n))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in order:
        tensor = prepared[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _ST_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    writer.write(len(encoded).to_bytes(8, "little") + encoded)
    for name in order:   # straight from the tensors' memory; the hasher reads it later
        writer.write_held(tensor_bytes(prepared[name]), prepared[name])


_CRC_LOCK = threading.Lock()


def _fill_torch(writer: HashingWriter, state) -> None:
    state = _on_cpu(state)
    writer.hold(_tensors_in(state))   # torch.save writes their storages: hashed later without a copy
    try:
        # The SHA-256 covers every byte, so the zip's per-record CRC-32 (torch.save's own check,
        # a third of its time) is left out; torch.load reads such files (torch >= 2.5). The
        # option is global: while it is off, other threads' torch.save skip the CRC too.
        set_crc = getattr(torch.serialization, "set_crc32_options", None)
        if set_crc is None:
            torch.save(state, writer)
            return
        with _CRC_LOCK:
            before = torch.serialization.get_crc32_options()
            set_crc(False)
            try:
                torch.save(state, writer)
            finally:
                set_crc(before)
    except Exception as exc:
        if writer.error is not None:   # the real cause, hidden by torch's RuntimeError
            raise writer.error from exc
        raise


def _on_cpu(value):
    """``value`` with every tensor in its dicts, lists and tuples on the CPU (a copy only where
    one is not already); the same object when nothing moves."""
    if isinstance(value, torch.Tensor):
        return value.cpu() if value.device.type != "cpu" else value
    if isinstance(value, dict):
        items = {k: _on_cpu(v) for k, v in value.items()}
        if all(items[k] is v for k, v in value.items()):
            return value
        out = value.copy()
        out.update(items)
        return out
    if isinstance(value, (list, tuple)):
        items = [_on_cpu(v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    return value


def _tensors_in(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def _write_file(path: Path, pipe: Pipe | None, fill) -> HashingWriter:
    """Create ``path``, let ``fill(writer)`` write it, close it; on any error close the file."""
    writer = HashingWriter(path, pipe)
    try:
        fill(writer)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return writer


def write_tensors(path: Path, tensors: dict, pipe: Pipe | None = None) -> HashingWriter:
    """A flat tensor dict as safetensors; ``.record()`` of the result is its manifest entry."""
    return _write_file(path, pipe, lambda writer: _fill_safetensors(writer, tensors, {"format": "pt"}))


def write_torch(path: Path, state, pipe: Pipe | None = None) -> HashingWriter:
    """A nested state of tensors and plain values with ``torch.save`` (loadable weights-only)."""
    return _write_file(path, pipe, lambda writer: _fill_torch(writer, state))


def write_text(path: Path, text: str, pipe: Pipe | None = None) -> HashingWriter:
    """UTF-8 text."""
    return _write_file(path, pipe, lambda writer: writer.write(text.encode()))
