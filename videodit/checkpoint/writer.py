"""Writing checkpoint files: checked, hashed and fsynced, and the safetensors encoder.

Files are written with checked ``os.write`` calls and hashed while they are written, so a
full disk or a permission problem surfaces as an error instead of a short file with a
valid-looking manifest. :class:`Pipe` overlaps the hashing and fsyncs of one checkpoint's
files with their writing. Nothing here knows the layout of a checkpoint folder (that is
``io.py``) or unpickles anything.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import threading
from collections import deque
from pathlib import Path
from typing import Any

import torch

_CHUNK = 16 << 20        # bytes per write() / hash update
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
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


class _Done:
    """The outcome of a call handed to a :class:`_Worker`."""

    def __init__(self):
        self._event = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> BaseException | None:
        self._event.wait()
        return self.error

    def result(self) -> None:
        if self.wait() is not None:
            raise self.error


class _Worker:
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
                fn(*args)
            except BaseException as exc:
                done.error = exc
            finally:
                done._event.set()

    def submit(self, fn, *args) -> _Done:
        done = _Done()
        self._queue.put((fn, args, done))
        return done

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()


class Pipe:
    """Helper threads for one checkpoint write. Each file gets a SHA-256 thread, so chunk N
    is hashed while chunk N+1 is written and the files are hashed in parallel; a finished
    file is fsynced while the next one is written. Hashing and fsync release the GIL.
    Without a pipe, writers hash and fsync inline."""

    MAX_PENDING = 256 << 20   # bytes a file may have queued for hashing before its writer waits

    def __init__(self):
        self.syncer = _Worker("videodit-fsync")
        self.syncs: list[_Done] = []
        self.hashers: list[_Worker] = []

    def hasher(self) -> _Worker:
        worker = _Worker("videodit-sha256")
        self.hashers.append(worker)
        return worker

    def sync_close(self, fd: int, path: Path) -> None:
        self.syncs.append(self.syncer.submit(_fsync_close, fd, path))

    def finish(self) -> None:
        """Wait for every fsync; raise the first error."""
        syncs, self.syncs = self.syncs, []
        errors = [e for e in (done.wait() for done in syncs) if e is not None]
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Stop the threads once their queues are done (on an error path too: every file closed)."""
        for done in self.syncs:
            done.wait()
        for worker in [*self.hashers, self.syncer]:
            worker.stop()


def _fsync_close(fd: int, path: Path) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
    finally:
        os.close(fd)


class HashingWriter:
    """A binary file written with checked ``os.write`` calls, SHA-256 computed on the way.

    ``close()`` fsyncs (or hands the fsync to the pipe); ``record()`` waits for the hash.
    Every OSError carries the file name; ``error`` keeps the first one (``torch.save`` turns
    exceptions raised by ``write`` into an opaque RuntimeError).
    """

    def __init__(self, path: Path, pipe: Pipe | None = None):
        self.path = path
        self.pipe = pipe
        self.sha = hashlib.sha256()
        self.bytes = 0
        self.error: OSError | None = None
        self._buffer = bytearray()
        self._hasher = pipe.hasher() if pipe is not None else None
        self._hashing: deque = deque()   # (_Done, bytes) queued on the hasher
        self._hashing_bytes = 0
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

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if size < _SMALL:
            self._buffer += view
            if len(self._buffer) >= _CHUNK:
                self._drain()
        else:
            self._drain()
            self._put(view)
        return size

    def flush(self) -> None:   # torch.save calls it; the data reaches the disk in close()
        pass

    def _drain(self) -> None:
        if self._buffer:
            buffer, self._buffer = self._buffer, bytearray()
            self._put(memoryview(buffer))

    def _hash(self, chunk: memoryview) -> None:
        if self._hasher is None:
            self.sha.update(chunk)
            return
        while self._hashing and self._hashing_bytes > self.pipe.MAX_PENDING:
            done, size = self._hashing.popleft()
            done.result()
            self._hashing_bytes -= size
        self._hashing.append((self._hasher.submit(self.sha.update, chunk), len(chunk)))
        self._hashing_bytes += len(chunk)

    def _put(self, view: memoryview) -> None:
        for start in range(0, len(view), _CHUNK):
            chunk = view[start : start + _CHUNK]
            self._hash(chunk)
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
        for done, _ in self._hashing:   # the chunks may point into memory about to be freed
            done.wait()
        self._hashing.clear()
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


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
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
    for name in order:
        writer.write(tensor_bytes(prepared[name]))


def _fill_torch(writer: HashingWriter, state) -> None:
    try:
        torch.save(state, writer)
    except Exception as exc:
        if writer.error is not None:   # the real cause, hidden by torch's RuntimeError
            raise writer.error from exc
        raise


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
