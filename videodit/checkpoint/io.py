"""Checkpoint folders: one directory per save, complete or invisible.

``checkpoints/step-0000123/`` holds ``model.safetensors``, ``ema.safetensors``,
``optimizer.pt`` (tensors only; loaded with ``weights_only=True``), ``rng.safetensors``,
``state.json`` (step, data position, LR schedule, Python/NumPy RNG), ``config.yaml`` and
``manifest.json`` (every file with its size and SHA-256, plus the metrics of the save).

Crash safety: a save is written into ``.staging-step-NNNNNNN-<pid>``, every file and the
folder fsynced, and renamed into place, so a crash mid-save leaves nothing a resume would
pick up. Files are written with checked ``os.write`` calls and hashed while they are
written (``writer.py``), so a full disk or a permission problem surfaces as an error
instead of a short file with a valid-looking manifest. A checkpoint is deleted by renaming
it to ``.deleting-*`` first, so a crash mid-delete never leaves a half-deleted folder that
looks complete. Nothing here unpickles arbitrary objects.

Reading is checked (:class:`CheckedReader`): a file must be a regular file of the size its
manifest entry lists (so a device or FIFO never hangs a reader) and is hashed while it is
read; :func:`verify_checkpoint` and :func:`damaged_files` check whole folders.

This module is the format: names, writing one folder (:func:`write_checkpoint`,
:func:`save_checkpoint`), manifests and :func:`verify_checkpoint`. When to save and what to
keep is ``manager.py``; reading a checkpoint is ``loaded.py``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from videodit.checkpoint.writer import (CHUNK as _CHUNK, HashingWriter, Pipe, fsync_path, shared_hasher,
                                        write_tensors, write_text, write_torch)
from videodit.errors import UserError
from videodit.user_files import NotRegularFile, open_user_fd

CHECKPOINT_RE = re.compile(r"^step-(\d{7,})$")
STAGING_PREFIX = ".staging-"
DELETING_PREFIX = ".deleting-"
EXPORT_MARK = "videodit_export"   # the export record inside a legacy export's config.json
# An export folder: the model folder STDiT.save_pretrained writes (config.json = the model's
# arguments, model.safetensors), plus the run's config (encoders, sampling defaults) and a
# record of where the weights came from.
EXPORT_RUN_CONFIG, EXPORT_RECORD = "run_config.yaml", "export.json"
SAMPLING_NOTE = "SAMPLING.md"   # a distilled model's sampler, beside exports that carry no run config


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
    from videodit.models.families import families
    for spec in families().values():   # two experts' folders (a two-expert model): one at a time
        high, low = (spec.expert_source(path, expert) for expert in ("high", "low"))
        if high is not None and low is not None and is_export_dir(high):
            raise UserError(f"{path} holds two experts' model folders: pass one of them (videodit sample samples the "
                            f"pair with --ckpt {high} --low-noise-ckpt {low})")
    raise UserError(f"{str(path)!r} is neither a checkpoint (no manifest.json), an export (config.json + "
                    "model.safetensors) nor a run folder with checkpoints; pass a run folder, a "
                    "checkpoints/step-NNNNNNN folder or an export folder")


MANIFEST_MAX_BYTES = 64 << 20   # a manifest lists files; one of 64 MiB is not a videodit manifest
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(ValueError):
    """A manifest.json that is missing, not JSON or not in the format; the message says which."""


class Damaged(Exception):
    """A checkpoint file that does not match its manifest entry; the message says how."""


def load_manifest(path: Path) -> dict:
    """The manifest of a checkpoint folder, checked: a JSON object whose ``files`` maps relative
    names inside the folder to ``{"bytes": int, "sha256": hex}``. Raises ManifestError."""
    try:
        data = read_regular(path / "manifest.json", limit=MANIFEST_MAX_BYTES)
    except Damaged as exc:
        raise ManifestError(str(exc)) from None
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError):
        raise ManifestError("manifest.json is not JSON") from None
    if not isinstance(manifest, dict):
        raise ManifestError("manifest.json is not a JSON object")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ManifestError("manifest.json has no 'files' mapping")
    for name, info in files.items():
        parts = name.split("/")
        if (not name or name.startswith("/") or "\\" in name or "\0" in name
                or any(part in ("", ".", "..") for part in parts)):
            raise ManifestError(f"manifest.json lists {name[:80]!r}, which is not a file inside the checkpoint")
        if not isinstance(info, dict) or not _entry_ok(info):
            raise ManifestError(f"manifest.json: the entry of {name} lacks a byte count or a SHA-256")
    return manifest


def _entry_ok(info: dict) -> bool:
    size, sha = info.get("bytes"), info.get("sha256")
    return (isinstance(size, int) and not isinstance(size, bool) and size >= 0
            and isinstance(sha, str) and _SHA256_RE.match(sha) is not None)


def read_manifest(path: Path) -> dict | None:
    """The manifest of a checkpoint folder, or None if it is missing, unreadable or malformed."""
    try:
        return load_manifest(path)
    except ManifestError:
        return None


# ---------------------------------------------------------------------------- reading, checked


def open_regular(file: Path, size: int | None = None, name: str | None = None) -> int:
    """A read-only descriptor of ``file``, which must be a regular file (a symlink to one is
    fine) and, when ``size`` is given, exactly ``size`` bytes long. Opened non-blocking, so a
    FIFO never hangs the open; a device, FIFO or folder is refused before anything is read.
    Raises Damaged, naming the file ``name`` (default: its file name)."""
    name = name or file.name
    try:
        fd = open_user_fd(file)
    except FileNotFoundError:
        raise Damaged(f"{name} is missing") from None
    except NotRegularFile:
        raise Damaged(f"{name} is not a regular file") from None
    except OSError as exc:
        raise Damaged(f"{name} cannot be read ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if size is not None and info.st_size != size:
            raise Damaged(f"{name} has {info.st_size} bytes, the manifest says {size}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(file: Path, limit: int) -> bytes:
    """The bytes of a small regular file of at most ``limit`` bytes. Raises Damaged."""
    fd = open_regular(file)
    try:
        chunks, total = [], 0
        while chunk := _read(fd, file, min(limit + 1 - total, _CHUNK)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise Damaged(f"{file.name} is larger than {limit >> 20} MiB")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _read(fd: int, file: Path, size: int) -> bytes:
    try:
        return os.read(fd, size) if size > 0 else b""
    except OSError as exc:
        raise Damaged(f"{file.name} cannot be read ({exc.strerror or exc})") from None


_READ_CHUNK = 4 << 20   # bytes per read call while hashing: small enough to overlap, large enough to be cheap
_IOV_MAX = 512          # buffers per readv call (POSIX guarantees 16, Linux allows 1024)


class CheckedReader:
    """Sequential reads of one file, checked against its manifest entry: a regular file of
    ``size`` bytes (no more is ever read) whose SHA-256 is ``sha256`` (None: the size only).

    The bytes go straight into the caller's memory (:meth:`readinto_many` fills many small
    buffers with one ``readv``), and each batch is hashed on a hasher thread while the next
    one is read, so a file is read once; :meth:`finish` checks the end and the hash. Whatever
    was read before ``finish`` succeeds is unverified: use it only after. Raises Damaged. A
    context manager (closing on exit).
    """

    def __init__(self, file: Path, size: int, sha256: str | None, name: str | None = None):
        self.file, self.size, self.sha256 = file, size, sha256
        self.name = name or file.name   # as messages call it: the name in the manifest
        self.pos = 0
        self._digest = hashlib.sha256() if sha256 is not None else None
        self._worker = None
        self._pending = None   # (Done, the buffers it hashes): at most one batch in flight
        self._scratch: list[bytearray] = []
        self._turn = 0
        self.fd = open_regular(file, size, self.name)
        if self._digest is not None and size > _READ_CHUNK:
            self._worker = shared_hasher()

    def __enter__(self) -> CheckedReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def readinto(self, view) -> None:
        """Fill ``view`` (writable bytes) with the next ``len(view)`` bytes of the file."""
        self.readinto_many([view])

    def readinto_many(self, views) -> None:
        """Fill each of ``views`` (writable bytes) in turn with the next bytes of the file."""
        batch, total = [], 0
        for view in views:
            view = memoryview(view).cast("B")
            for start in range(0, len(view), _READ_CHUNK):
                piece = view[start:start + _READ_CHUNK]
                if batch and (total + len(piece) > _READ_CHUNK or len(batch) >= _IOV_MAX):
                    self._fill(batch, total)
                    batch, total = [], 0
                batch.append(piece)
                total += len(piece)
        if batch:
            self._fill(batch, total)

    def _fill(self, batch: list[memoryview], total: int) -> None:
        if self.pos + total > self.size:
            raise Damaged(f"{self.name}: a read past its {self.size} bytes")
        left, first, got = list(batch), 0, 0
        while got < total:
            try:
                count = os.readv(self.fd, left[first:first + _IOV_MAX])
            except OSError as exc:
                raise Damaged(f"{self.name} cannot be read ({exc.strerror or exc})") from None
            if count == 0:
                raise Damaged(f"{self.name} ended after {self.pos + got} bytes, the manifest says {self.size}")
            got += count
            while count and first < len(left):   # skip the buffers this read filled
                if count >= len(left[first]):
                    count -= len(left[first])
                    first += 1
                else:
                    left[first] = left[first][count:]
                    count = 0
        self.pos += total
        self._hash(batch)

    def read(self, count: int) -> bytearray:
        data = bytearray(count)
        self.readinto(memoryview(data))
        return data

    def skip(self, count: int) -> None:
        """Read (and hash) ``count`` bytes into scratch buffers."""
        while count > 0:
            if not self._scratch:
                self._scratch = [bytearray(min(_READ_CHUNK, count)) for _ in range(2)]
            buffer = self._scratch[self._turn]   # the other one may still be hashing
            self._turn ^= 1
            step = min(count, len(buffer))
            self.readinto(memoryview(buffer)[:step])
            count -= step

    def _hash(self, batch: list[memoryview]) -> None:
        if self._digest is None:
            return
        if self._worker is None:
            _update(self._digest, batch)
            return
        self._settle()
        self._pending = (self._worker.submit(_update, self._digest, batch), batch)

    def _settle(self) -> None:
        if self._pending is not None:
            done, self._pending = self._pending[0], None
            done.result()

    def finish(self) -> None:
        """Check that the file ends here and matches its SHA-256; raise Damaged if not."""
        self.skip(self.size - self.pos)
        try:
            extra = os.read(self.fd, 1)
        except OSError as exc:
            raise Damaged(f"{self.name} cannot be read ({exc.strerror or exc})") from None
        if extra:
            raise Damaged(f"{self.name} is longer than the manifest's {self.size} bytes")
        self._settle()
        if self._digest is not None and self._digest.hexdigest() != self.sha256:
            raise Damaged(f"{self.name} does not match its SHA-256 in the manifest")

    def close(self) -> None:
        if self._pending is not None:   # never free memory the hasher still reads
            self._pending[0].wait()
            self._pending = None
        self._worker = None   # a shared thread: it keeps running
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _update(digest, batch: list[memoryview]) -> None:
    for view in batch:
        digest.update(view)


def check_file(folder: Path, name: str, info: dict) -> str | None:
    """None if ``folder/name`` matches its manifest entry (a regular file with its size and
    SHA-256, read once); otherwise what is wrong."""
    try:
        with CheckedReader(folder / name, info["bytes"], info["sha256"], name) as reader:
            reader.finish()
    except Damaged as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------------------- writing


def clean_metrics(metrics: dict | None) -> dict:
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


def remove_dir(path: Path, root: Path) -> None:
    """Delete a folder: rename it to ``.deleting-*`` first, then remove it."""
    doomed = root / f"{DELETING_PREFIX}{path.name}-{os.getpid()}"
    if doomed.exists():
        shutil.rmtree(doomed)
    os.replace(path, doomed)
    fsync_path(root)
    shutil.rmtree(doomed)


def write_checkpoint(root: Path, step: int, *, tensors: dict[str, dict[str, torch.Tensor]],
                     torch_states: dict[str, dict], json_state: dict, config_yaml: str,
                     metrics: dict | None, staging_hook=None, write_shards=None) -> tuple[Path, int]:
    """Write one checkpoint atomically; return (final directory, total bytes). Raises OSError.

    ``write_shards(staging)``, when given, writes more files into the staging folder first
    (the DCP shards of a sharded run, written by every rank); the manifest lists them too.
    ``staging_hook(staging)`` is called once the staging folder exists. This is the
    ``writer`` a :class:`~videodit.checkpoint.manager.CheckpointManager` calls; a replacement
    must keep this signature and contract. :func:`save_checkpoint` is the user-facing form.
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
        writers: dict[str, HashingWriter] = {}
        shards: dict[str, tuple[int, object]] = {}
        pipe = Pipe()
        try:
            if write_shards is not None:
                write_shards(staging)
                # Written (and fsynced) by DCP on every rank; hashed here on the hasher threads
                # while the files below are written.
                shards = {file.relative_to(staging).as_posix(): (file.stat().st_size, pipe.hash_file(file))
                          for file in sorted(staging.rglob("*")) if file.is_file()}
            # The optimizer state first (the largest file, and torch.save keeps this thread busy
            # longest), so its fsync overlaps the writing of the others; small files come last.
            for stem, state in torch_states.items():
                writers[f"{stem}.pt"] = write_torch(staging / f"{stem}.pt", state, pipe)
            for stem, flat in sorted(tensors.items(), key=lambda item: -_nbytes(item[1])):
                writers[f"{stem}.safetensors"] = write_tensors(staging / f"{stem}.safetensors", flat, pipe)
            writers["state.json"] = write_text(staging / "state.json", json.dumps(json_state, indent=1), pipe)
            writers["config.yaml"] = write_text(staging / "config.yaml", config_yaml, pipe)
            pipe.finish()   # every file is on disk before the manifest says so
            extra = {name: {"bytes": size, "sha256": done.result()} for name, (size, done) in shards.items()}
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
        write_text(staging / "manifest.json", text)
        fsync_path(staging)
        if final.exists():   # re-saving the same step (e.g. after a resume): replace it whole
            remove_dir(final, root)
        os.replace(staging, final)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final, sum(f["bytes"] for f in files.values()) + len(text.encode())


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values() if isinstance(t, torch.Tensor))


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


def save_error(step: int, root: Path, exc: OSError) -> UserError:
    """The UserError for a save that failed with ``exc``: what happened and what to do."""
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
        final, _ = write_checkpoint(root, step, tensors=tensors, torch_states=torch_states,
                                    json_state=json_state, config_yaml=config_yaml,
                                    metrics=clean_metrics(metrics))
    except OSError as exc:
        raise save_error(step, root, exc) from exc
    return final


# ---------------------------------------------------------------------------- verification


def verify_checkpoint(path: Path, files: list[str] | None = None) -> str | None:
    """None if the manifest is readable and every listed file (or ``files``) is a regular file
    with its size and SHA-256; otherwise a short description of the first damage."""
    problems = damaged_files(path, files, first=True)
    return next(iter(problems.values()), None)


def damaged_files(path: Path, files: list[str] | None = None, first: bool = False,
                  checksums: bool = True) -> dict[str, str]:
    """``{name: problem}`` for the listed files (or ``files``) that do not match the manifest
    (``manifest.json`` itself when the manifest is malformed); empty when all match. Every file
    is read once (``checksums=False``: types and sizes only, nothing read); ``first`` stops at
    the first damaged one."""
    try:
        entries = load_manifest(path)["files"]
    except ManifestError as exc:
        return {"manifest.json": str(exc)}
    problems = {}
    for name in files if files is not None else sorted(entries):
        info = entries.get(name)
        if info is None:
            problem = f"{name} is not in the manifest"
        elif checksums:
            problem = check_file(path, name, info)
        else:
            problem = _check_size(path / name, info["bytes"], name)
        if problem is not None:
            problems[name] = problem
            if first:
                break
    return problems


def _check_size(file: Path, size: int, name: str) -> str | None:
    try:
        os.close(open_regular(file, size, name))
    except Damaged as exc:
        return str(exc)
    return None


def warn(message: str) -> None:
    """``warning: message`` on stderr."""
    print(f"warning: {message}", file=sys.stderr, flush=True)
