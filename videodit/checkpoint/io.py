"""Checkpoints: one directory per save, complete or invisible.

``checkpoints/step-0000123/`` holds ``model.safetensors``, ``ema.safetensors``,
``optimizer.pt`` (tensors only; loaded with ``weights_only=True``), ``rng.safetensors``,
``state.json`` (step, data position, LR schedule, Python/NumPy RNG), ``config.yaml`` and
``manifest.json`` (every file with its size and SHA-256, plus the metrics of the save).

Crash safety: a save is written into ``.staging-step-NNNNNNN-<pid>``, every file and the
folder fsynced, and renamed into place, so a crash mid-save leaves nothing a resume would
pick up. Files are written with checked ``os.write`` calls and hashed while they are
written, so a full disk or a permission problem surfaces as an error instead of a short
file with a valid-looking manifest. A checkpoint is deleted by renaming it to
``.deleting-*`` first, so a crash mid-delete never leaves a half-deleted folder that looks
complete. Nothing here unpickles arbitrary objects.

:class:`CheckpointManager` adds the policy on top: when to save (every N steps / T
minutes), retention (last K, best N by a metric, never the checkpoint the run resumed
from), an event log ``checkpoints.jsonl``, cleanup of interrupted saves, verified
``latest()``, and optional background (async) saves.

An *export* folder (``config.json`` + ``model.safetensors``, written by
:func:`videodit.checkpoint.tools.export`) loads through :class:`LoadedCheckpoint` too, so
sampling works on it unchanged.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import math
import os
import pickle
import queue
import re
import shutil
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file

from videodit.errors import UserError

try:   # safetensors >= 0.4
    from safetensors import SafetensorError
except ImportError:   # pragma: no cover
    SafetensorError = RuntimeError

CHECKPOINT_RE = re.compile(r"^step-(\d{7,})$")
STAGING_PREFIX = ".staging-"
DELETING_PREFIX = ".deleting-"
LOG_NAME = "checkpoints.jsonl"
EXPORT_MARK = "videodit_export"
_CHUNK = 16 << 20        # bytes per write() / hash update
_SMALL = 64 << 10        # writes below this are gathered into one buffer (torch.save writes many small records)


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root`` (a ``checkpoints/`` folder), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and CHECKPOINT_RE.match(p.name)
             and (p / "manifest.json").is_file()]
    return sorted(found, key=lambda p: int(CHECKPOINT_RE.match(p.name).group(1)))


def is_export_dir(path: Path) -> bool:
    """An exported model folder: ``config.json`` + ``model.safetensors`` and no manifest."""
    return (not (path / "manifest.json").is_file() and (path / "config.json").is_file()
            and (path / "model.safetensors").is_file())


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, an export directory, or the newest checkpoint of a run directory."""
    path = Path(path)
    if (path / "manifest.json").is_file() or is_export_dir(path):
        return path
    for root in (path / "checkpoints", path):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise UserError(f"{str(path)!r} is neither a checkpoint (no manifest.json), an export (config.json + "
                    "model.safetensors) nor a run folder with checkpoints; pass a run folder, a "
                    "checkpoints/step-NNNNNNN folder or an export folder")


# ---------------------------------------------------------------------------- low-level writing


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
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


class _Pipe:
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


class _HashingWriter:
    """A binary file written with checked ``os.write`` calls, SHA-256 computed on the way.

    ``close()`` fsyncs (or hands the fsync to the pipe); ``record()`` waits for the hash.
    Every OSError carries the file name; ``error`` keeps the first one (``torch.save`` turns
    exceptions raised by ``write`` into an opaque RuntimeError).
    """

    def __init__(self, path: Path, pipe: _Pipe | None = None):
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


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
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


def _fill_safetensors(writer: _HashingWriter, tensors: dict[str, torch.Tensor], metadata: dict | None) -> None:
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
        writer.write(_tensor_bytes(prepared[name]))


def _fill_torch(writer: _HashingWriter, state) -> None:
    try:
        torch.save(state, writer)
    except Exception as exc:
        if writer.error is not None:   # the real cause, hidden by torch's RuntimeError
            raise writer.error from exc
        raise


def _write_file(path: Path, pipe: _Pipe | None, fill) -> _HashingWriter:
    """Create ``path``, let ``fill(writer)`` write it, close it; on any error close the file."""
    writer = _HashingWriter(path, pipe)
    try:
        fill(writer)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return writer


def _write_tensors(path: Path, tensors: dict, pipe: _Pipe | None = None) -> _HashingWriter:
    return _write_file(path, pipe, lambda writer: _fill_safetensors(writer, tensors, {"format": "pt"}))


def _write_torch(path: Path, state, pipe: _Pipe | None = None) -> _HashingWriter:
    return _write_file(path, pipe, lambda writer: _fill_torch(writer, state))


def _write_text(path: Path, text: str, pipe: _Pipe | None = None) -> _HashingWriter:
    return _write_file(path, pipe, lambda writer: writer.write(text.encode()))


def _remove_dir(path: Path, root: Path) -> None:
    """Delete a folder: rename it to ``.deleting-*`` first, then remove it."""
    doomed = root / f"{DELETING_PREFIX}{path.name}-{os.getpid()}"
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    _fsync(root)
    shutil.rmtree(doomed)


def _write_checkpoint(root: Path, step: int, *, tensors: dict[str, dict[str, torch.Tensor]],
                      torch_states: dict[str, dict], json_state: dict, config_yaml: str,
                      metrics: dict | None, staging_hook=None, write_shards=None) -> tuple[Path, int]:
    """Write one checkpoint atomically; return (final directory, total bytes). Raises OSError.

    ``write_shards(staging)``, when given, writes more files into the staging folder first
    (the DCP shards of a sharded run, written by every rank); the manifest lists them too.
    """
    final = root / checkpoint_name(step)
    staging = root / f"{STAGING_PREFIX}{final.name}-{os.getpid()}"
    started = time.time()
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        if staging_hook is not None:
            staging_hook(staging)
        extra = {}
        if write_shards is not None:
            write_shards(staging)
            extra = {file.relative_to(staging).as_posix(): {"bytes": file.stat().st_size, "sha256": _sha256(file)}
                     for file in sorted(staging.rglob("*")) if file.is_file()}
        writers: dict[str, _HashingWriter] = {}
        pipe = _Pipe()
        try:
            for stem, flat in tensors.items():
                writers[f"{stem}.safetensors"] = _write_tensors(staging / f"{stem}.safetensors", flat, pipe)
            for stem, state in torch_states.items():
                writers[f"{stem}.pt"] = _write_torch(staging / f"{stem}.pt", state, pipe)
            writers["state.json"] = _write_text(staging / "state.json", json.dumps(json_state, indent=1), pipe)
            writers["config.yaml"] = _write_text(staging / "config.yaml", config_yaml, pipe)
            pipe.finish()   # every file is on disk before the manifest says so
            files = dict(sorted({**extra, **{name: writer.record() for name, writer in writers.items()}}.items()))
        finally:
            pipe.close()
        manifest = {
            "step": step,
            "epoch": json_state.get("epoch"),
            "files": files,
            "metrics": metrics or {},
            "save_seconds": round(time.time() - started, 3),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        text = json.dumps(manifest, indent=1)
        _write_text(staging / "manifest.json", text)
        _fsync(staging)
        if final.exists():   # re-saving the same step (e.g. after a resume): replace it whole
            _remove_dir(final, root)
        os.replace(staging, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final, sum(f["bytes"] for f in files.values()) + len(text.encode())


def describe_os_error(exc: OSError) -> tuple[str, str]:
    """(what happened, with the file; which kind: "space", "permission" or "other")."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        kind = "space"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        kind = "permission"
    else:
        kind = "other"
    return reason + where, kind


def _save_error(step: int, root: Path, exc: OSError) -> UserError:
    what, kind = describe_os_error(exc)
    fix = {"space": f"free space in {root} or lower checkpoint.save_total_limit",
           "permission": f"make {root} writable or train with --out pointing at a writable folder",
           "other": f"fix the problem with {root}, then continue with resume=auto"}[kind]
    message = f"checkpoint save failed at step {step}: {what}; {fix}; earlier checkpoints are intact"
    return UserError(" ".join(message.split()))


def save_checkpoint(root: Path, step: int, *, tensors: dict[str, dict[str, torch.Tensor]],
                    torch_states: dict[str, dict], json_state: dict, config_yaml: str,
                    metrics: dict | None = None) -> Path:
    """Write one checkpoint atomically and return its final directory.

    ``tensors``: file stem -> flat tensor dict (safetensors); ``torch_states``: file stem ->
    nested state of tensors and plain values (``torch.save``, safe to load weights-only).
    A failed write (full disk, permissions) raises UserError and leaves earlier checkpoints
    and no staging folder behind.
    """
    try:
        final, _ = _write_checkpoint(root, step, tensors=tensors, torch_states=torch_states,
                                     json_state=json_state, config_yaml=config_yaml,
                                     metrics=_clean_metrics(metrics))
    except OSError as exc:
        raise _save_error(step, root, exc) from exc
    return final


# ---------------------------------------------------------------------------- verification


def verify_checkpoint(path: Path, files: list[str] | None = None) -> str | None:
    """None if the manifest is readable and every listed file (or ``files``) has its size and
    SHA-256; otherwise a short description of the damage."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        entries = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "manifest.json is missing or unreadable"
    for name in files if files is not None else sorted(entries):
        info = entries.get(name)
        if info is None:
            return f"{name} is not in the manifest"
        file = path / name
        try:
            if file.stat().st_size != info["bytes"]:
                return f"{name} has {file.stat().st_size} bytes, the manifest says {info['bytes']}"
            if info.get("sha256") and _sha256(file) != info["sha256"]:
                return f"{name} does not match its SHA-256 in the manifest"
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or exc})"
    return None


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- the manager


def _clean_metrics(metrics: dict | None) -> dict:
    """JSON-safe metrics: tensors/NumPy scalars to numbers, NaN/inf to None."""
    out = {}
    for key, value in (metrics or {}).items():
        if hasattr(value, "item"):
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        elif not isinstance(value, (int, float, str, bool, type(None))):
            value = str(value)
        out[str(key)] = value
    return out


def _metric_value(metrics: dict, metric: str) -> float | None:
    value = metrics.get(metric) if isinstance(metrics, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def best_checkpoints(entries: list[tuple[Path, dict]], metric: str, mode: str, n: int) -> list[Path]:
    """The ``n`` best of ``(path, metrics)`` by ``metric`` (``mode`` min|max); ties go to the older."""
    scored = [(value, i, path) for i, (path, metrics) in enumerate(entries)
              if (value := _metric_value(metrics, metric)) is not None]
    scored.sort(key=lambda item: (item[0] if mode == "min" else -item[0], item[1]))
    return [path for _, _, path in scored[:max(n, 0)]]


def read_manifest(path: Path) -> dict | None:
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        return manifest if isinstance(manifest, dict) else None
    except (OSError, ValueError):
        return None


def _pid_of(name: str) -> int | None:
    match = re.search(r"-(\d+)$", name)
    return int(match.group(1)) if match else None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:   # EPERM: it exists, it is someone else's
        return True
    return True


class _Snapshotter:
    """CPU copies of nested states, in buffers kept from one async save to the next.

    Re-using the buffers makes the copy a memcpy into memory that is already mapped (fresh
    allocations of a model-sized state pay page faults on every save); CUDA tensors are
    copied into pinned buffers. Other values are deep-copied. The buffers hold one copy of
    the last async checkpoint's tensors until :meth:`release`.
    """

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self._used: set[tuple] = set()
        self._cuda = False

    def __call__(self, value):
        self._used, self._cuda = set(), False
        out = self._copy(value, ())
        for key in self.buffers.keys() - self._used:
            del self.buffers[key]
        if self._cuda:
            torch.cuda.synchronize()
        return out

    def _copy(self, value, key: tuple):
        if isinstance(value, torch.Tensor):
            source = value.detach()
            buffer = self.buffers.get(key)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=source.is_cuda)
                self.buffers[key] = buffer
            self._cuda |= source.is_cuda
            if source.device.type == "cpu" and source.is_contiguous() and source.numel():
                # One plain memcpy: copy_ splits large copies over OpenMP threads, which is
                # 30x slower (1.8 s vs 0.06 s per GB measured) when other work holds the cores.
                _tensor_bytes(buffer)[:] = _tensor_bytes(source)
            elif source.numel():
                buffer.copy_(source, non_blocking=source.is_cuda)
            self._used.add(key)
            return buffer
        if isinstance(value, dict):
            return {k: self._copy(v, key + (k,)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._copy(v, key + (i,)) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return copy.deepcopy(value)

    def release(self) -> None:
        self.buffers.clear()


class CheckpointManager:
    """When to save, what to keep, and a log of both, for the checkpoints of one run folder.

    Checkpoints go to ``run_dir/checkpoints/step-NNNNNNN``; events to
    ``run_dir/checkpoints.jsonl``. Retention after each save: the newest
    ``save_total_limit`` checkpoints by step (0 = keep all) plus the ``keep_best`` best by
    ``metric`` (``mode`` min|max, among checkpoints whose manifest has it) plus the one this
    run resumed from plus the one just saved; nothing else survives once a limit is set.
    ``keep_best`` alone only protects (it deletes nothing while ``save_total_limit`` is 0).
    """

    def __init__(self, run_dir: Path, *, every_steps: int = 0, every_minutes: float = 0.0,
                 save_total_limit: int = 0, keep_best: int = 0, metric: str = "val_loss",
                 mode: str = "min", resumed_from: Path | None = None):
        for key, value in (("every_steps", every_steps), ("every_minutes", every_minutes),
                           ("save_total_limit", save_total_limit), ("keep_best", keep_best)):
            if value < 0:
                raise UserError(f"checkpoint.{key}={value} is negative; use 0 (off) or a positive number")
        if mode not in ("min", "max"):
            raise UserError(f"checkpoint.mode={mode!r} is not min or max; use checkpoint.mode=min "
                            f"(lower {metric} is better) or checkpoint.mode=max")
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "checkpoints"
        self.log_path = self.run_dir / LOG_NAME
        self.every_steps = int(every_steps)
        self.every_minutes = float(every_minutes)
        self.save_total_limit = int(save_total_limit)
        self.keep_best = int(keep_best)
        self.metric = metric
        self.mode = mode
        self.resumed_from = Path(resumed_from) if resumed_from is not None else None
        self._last_time = time.monotonic()
        self._last_step: int | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._writing: Path | None = None   # the staging folder of our own save in flight
        self._snapshot = _Snapshotter()

    # ------------------------------------------------------------------ when

    def should_save(self, step: int) -> bool:
        """True every ``every_steps`` steps and/or once ``every_minutes`` have passed since the
        last save (or since the manager was made); never twice for the same step. With several
        processes, decide on one and broadcast: clocks differ."""
        if step == self._last_step:
            return False
        if self.every_steps and step % self.every_steps == 0:
            return True
        return bool(self.every_minutes) and time.monotonic() - self._last_time >= self.every_minutes * 60

    # ------------------------------------------------------------------ save

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(self, step: int, *, tensors: dict[str, dict[str, torch.Tensor]], torch_states: dict[str, dict],
             json_state: dict, config_yaml: str, metrics: dict | None = None, blocking: bool = True,
             write_shards=None) -> Path:
        """Save a checkpoint and apply retention; return its final path.

        ``blocking=False`` copies every tensor to CPU memory now (into buffers kept for the
        next async save: one checkpoint's worth of host memory, see :meth:`release_buffers`),
        then writes (and applies retention) in a background thread; the returned path exists
        once :meth:`wait` returns.
        At most one save is in flight: a save first waits for the previous one, and raises
        its error (UserError) if it failed. ``write_shards`` (see ``_write_checkpoint``) is a
        collective with the other ranks, so a save that has it always blocks.
        """
        self.wait()
        self._last_step, self._last_time = step, time.monotonic()
        metrics = _clean_metrics(metrics)
        final = self.root / checkpoint_name(step)
        if blocking or write_shards is not None:
            self._save_now(step, tensors, torch_states, json_state, config_yaml, metrics, started=time.time(),
                           write_shards=write_shards)
            return final
        started = time.time()
        job = (step, *self._snapshot((tensors, torch_states)), json.loads(json.dumps(json_state)),
               config_yaml, metrics)
        self._error = None
        self._thread = threading.Thread(target=self._background, args=job, kwargs={"started": started},
                                        name=f"videodit-checkpoint-{step}", daemon=False)
        self._thread.start()
        return final

    def release_buffers(self) -> None:
        """Free the CPU copy that async saves keep for re-use (after waiting for the save in flight)."""
        self.wait()
        self._snapshot.release()

    def wait(self) -> None:
        """Wait for a background save; raise its error as UserError if it failed."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is None:
            return
        if isinstance(error, UserError):
            raise UserError(str(error)) from error
        raise UserError(" ".join(f"checkpoint save failed in the background: {type(error).__name__}: {error}; "
                                 "earlier checkpoints are intact, see the traceback above".split())) from error

    def _background(self, *job, started: float) -> None:
        try:
            self._save_now(*job, started=started, blocking=False)
        except BaseException as exc:   # surfaces on the next save()/wait()
            self._error = exc
            _warn(str(exc) if isinstance(exc, UserError) else f"background checkpoint save failed: {exc!r}")

    def _save_now(self, step, tensors, torch_states, json_state, config_yaml, metrics, *, started: float,
                  blocking: bool = True, write_shards=None) -> Path:
        def hook(staging: Path) -> None:
            self._writing = staging
        try:
            final, size = _write_checkpoint(self.root, step, tensors=tensors, torch_states=torch_states,
                                            json_state=json_state, config_yaml=config_yaml, metrics=metrics,
                                            staging_hook=hook, write_shards=write_shards)
        except OSError as exc:
            error = _save_error(step, self.root, exc)
            self._log({"event": "save_failed", "step": step, "error": str(error)}, quiet=True)
            raise error from exc
        finally:
            self._writing = None
        self._log({"event": "save", "step": step, "path": self._rel(final), "metrics": metrics, "bytes": size,
                   "seconds": round(time.time() - started, 3), "async": not blocking,
                   "retention": {"save_total_limit": self.save_total_limit, "keep_best": self.keep_best,
                                 "metric": self.metric, "mode": self.mode}})
        try:
            self.apply_retention(just_saved=final)
        except OSError as exc:   # the save itself is complete: keep going
            _warn(f"checkpoint retention failed after step {step}: {exc}; old checkpoints were kept")
        return final

    # ------------------------------------------------------------------ what to keep

    def retention_plan(self, just_saved: Path | None = None) -> dict[Path, str]:
        """Checkpoints retention would delete now, each with its reason."""
        if not self.save_total_limit:
            return {}
        found = list_checkpoints(self.root)
        keep = {p.resolve() for p in found[-self.save_total_limit:]}
        keep |= {p.resolve() for p in self.best()}
        if self.resumed_from is not None:
            keep.add(self.resumed_from.resolve())
        if just_saved is not None:
            keep.add(just_saved.resolve())
        reason = f"save_total_limit={self.save_total_limit}"
        if self.keep_best:
            reason += f", not among the {self.keep_best} best by {self.metric} ({self.mode})"
        return {p: reason for p in found if p.resolve() not in keep}

    def best(self) -> list[Path]:
        """The ``keep_best`` best checkpoints by ``metric``, best first."""
        if not self.keep_best:
            return []
        entries = [(p, (read_manifest(p) or {}).get("metrics") or {}) for p in list_checkpoints(self.root)]
        return best_checkpoints(entries, self.metric, self.mode, self.keep_best)

    def apply_retention(self, just_saved: Path | None = None) -> list[Path]:
        """Delete what :meth:`retention_plan` names (rename to ``.deleting-*``, then remove); log each."""
        deleted = []
        for path, reason in self.retention_plan(just_saved).items():
            manifest = read_manifest(path) or {}
            _remove_dir(path, self.root)
            deleted.append(path)
            self._log({"event": "delete", "step": manifest.get("step"), "path": self._rel(path), "reason": reason,
                       "metrics": manifest.get("metrics") or {}})
        return deleted

    # ------------------------------------------------------------------ housekeeping

    def cleanup_staging(self) -> list[Path]:
        """Remove what interrupted saves and deletes left (``.staging-*``, ``.deleting-*``),
        except folders of another process that is still running; log and return them."""
        removed = []
        if not self.root.is_dir():
            return removed
        for path in sorted(self.root.iterdir()):
            is_staging = path.name.startswith(STAGING_PREFIX)
            if not (is_staging or path.name.startswith(DELETING_PREFIX)) or path == self._writing:
                continue
            pid = _pid_of(path.name)
            if pid is not None and pid != os.getpid() and _pid_alive(pid):
                print(f"checkpoints: leaving {path.name}: process {pid} is still running", flush=True)
                continue
            shutil.rmtree(path, ignore_errors=True)
            if path.exists():
                _warn(f"could not remove {path}; delete it by hand")
                continue
            removed.append(path)
            kind = "interrupted save" if is_staging else "interrupted delete"
            print(f"checkpoints: removed {path.name} ({kind})", flush=True)
            self._log({"event": "cleanup", "path": self._rel(path),
                       "reason": f"{kind} left by process {pid}" if pid is not None else kind})
        return removed

    def latest(self) -> Path | None:
        """The newest checkpoint whose files all match their manifest checksums; damaged ones
        are skipped with a warning."""
        for path in reversed(list_checkpoints(self.root)):
            problem = verify_checkpoint(path)
            if problem is None:
                return path
            _warn(f"skipping damaged checkpoint {path}: {problem}; using the next older one")
        return None

    def record_resume(self, path: Path) -> None:
        """Note that this run resumed from ``path``: it is never deleted, and ``ckpt list`` marks it."""
        self.resumed_from = Path(path)
        manifest = read_manifest(self.resumed_from) or {}
        self._log({"event": "resume", "step": manifest.get("step"), "path": self._rel(self.resumed_from)})

    def checkpoints(self) -> list[Path]:
        return list_checkpoints(self.root)

    # ------------------------------------------------------------------ the event log

    def _rel(self, path: Path) -> str:
        try:
            return str(Path(path).resolve().relative_to(self.run_dir.resolve()))
        except ValueError:
            return str(Path(path).resolve())

    def _log(self, event: dict, quiet: bool = False) -> None:
        record = {"event": event.pop("event"), **event, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        line = json.dumps(record) + "\n"
        with self._lock:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    os.write(fd, line.encode())
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                if not quiet:
                    _warn(f"could not append to {self.log_path}: {exc.strerror or exc}")


def read_events(run_dir: Path) -> list[dict]:
    """The events of ``run_dir/checkpoints.jsonl`` (unreadable lines skipped)."""
    path = Path(run_dir) / LOG_NAME
    events = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return events
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


# ---------------------------------------------------------------------------- loading


class LoadedCheckpoint:
    """Read access to one checkpoint directory (or an export folder: weights + config only)."""

    def __init__(self, path: str | Path):
        self.path = resolve_checkpoint(path)
        self.is_export = is_export_dir(self.path)
        if self.is_export:
            self._init_export()
            return
        manifest = read_manifest(self.path)
        if manifest is None or not isinstance(manifest.get("files"), dict):
            raise UserError(f"checkpoint {self.path} is damaged: manifest.json is unreadable; resume from an "
                            "earlier checkpoint")
        self.manifest = manifest
        for name, info in self.manifest["files"].items():
            file = self.path / name
            if not file.is_file() or file.stat().st_size != info["bytes"]:
                raise UserError(f"checkpoint {self.path} is damaged: {name} is missing or has the wrong "
                                "size; resume from an earlier checkpoint")

    def _init_export(self) -> None:
        try:
            config = json.loads((self.path / "config.json").read_text())
            if not isinstance(config, dict):
                raise ValueError("not an object")
        except (OSError, ValueError) as exc:
            raise UserError(f"export {self.path}: config.json is unreadable ({exc}); export the checkpoint "
                            "again with `videodit ckpt export`") from None
        self.export_config = config
        info = config.get(EXPORT_MARK) or {}
        files = {name: {"bytes": (self.path / name).stat().st_size} for name in ("config.json", "model.safetensors")}
        self.manifest = {"step": info.get("step", 0), "epoch": None, "files": files, "metrics": {},
                         "export": info}

    @property
    def step(self) -> int:
        return int(self.manifest.get("step") or 0)

    @property
    def metrics(self) -> dict:
        return self.manifest.get("metrics") or {}

    def has(self, stem: str) -> bool:
        return any(name.startswith(stem + ".") for name in self.manifest["files"])

    @property
    def has_shards(self) -> bool:
        """Whether a sharded run wrote DCP shards (``dcp/``) beside the whole tensors."""
        return any(name.startswith("dcp/") for name in self.manifest["files"])

    def verify(self) -> None:
        """Check every file against its SHA-256 in the manifest (exports have none)."""
        if self.is_export:
            return
        problem = verify_checkpoint(self.path)
        if problem:
            raise UserError(f"checkpoint {self.path} is damaged: {problem}; resume from an earlier checkpoint")

    def _not_in_export(self, what: str):
        return UserError(f"{self.path} is an exported model (weights and config only) and has no {what}; "
                         "to resume training pass a checkpoints/step-NNNNNNN folder")

    def tensors(self, stem: str) -> dict[str, torch.Tensor]:
        if self.is_export and stem != "model":
            raise self._not_in_export(f"{stem} weights")
        file = self.path / f"{stem}.safetensors"
        try:
            return load_file(str(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise UserError(" ".join(f"checkpoint {self.path}: {file.name} cannot be read ({exc}); resume from "
                                     "an earlier checkpoint".split())) from exc

    def torch_state(self, stem: str) -> dict:
        if self.is_export:
            raise self._not_in_export(f"{stem} state")
        file = self.path / f"{stem}.pt"
        try:
            return torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise UserError(f"checkpoint {self.path}: {file.name} holds objects other than tensors and plain "
                            "values, which videodit refuses to unpickle; use a checkpoint written by videodit"
                            ) from None
        except (RuntimeError, EOFError, OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"checkpoint {self.path}: {file.name} cannot be read ({first}); resume from an "
                            "earlier checkpoint") from exc

    def json_state(self) -> dict:
        if self.is_export:
            raise self._not_in_export("training state")
        return json.loads((self.path / "state.json").read_text())

    def config_yaml(self) -> str:
        if self.is_export:
            config = {k: v for k, v in self.export_config.items() if k != EXPORT_MARK}
            return yaml.safe_dump(config, sort_keys=False)
        return (self.path / "config.yaml").read_text()
