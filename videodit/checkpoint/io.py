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

This module is the format: names, writing one folder (:func:`write_checkpoint`,
:func:`save_checkpoint`), manifests and :func:`verify_checkpoint`. When to save and what to
keep is ``manager.py``; reading a checkpoint is ``loaded.py``.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from videodit.checkpoint.writer import (HashingWriter, Pipe, fsync_path, sha256_file, write_tensors, write_text,
                                        write_torch)
from videodit.errors import UserError

CHECKPOINT_RE = re.compile(r"^step-(\d{7,})$")
STAGING_PREFIX = ".staging-"
DELETING_PREFIX = ".deleting-"
EXPORT_MARK = "videodit_export"   # the export record inside a legacy export's config.json
# An export folder: the model folder STDiT.save_pretrained writes (config.json = the model's
# arguments, model.safetensors), plus the run's config (encoders, sampling defaults) and a
# record of where the weights came from.
EXPORT_RUN_CONFIG, EXPORT_RECORD = "run_config.yaml", "export.json"


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


def read_manifest(path: Path) -> dict | None:
    """The manifest of a checkpoint folder, or None if it is missing or unreadable."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        return manifest if isinstance(manifest, dict) else None
    except (OSError, ValueError):
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
        extra = {}
        if write_shards is not None:
            write_shards(staging)
            extra = {file.relative_to(staging).as_posix(): {"bytes": file.stat().st_size, "sha256": sha256_file(file)}
                     for file in sorted(staging.rglob("*")) if file.is_file()}
        writers: dict[str, HashingWriter] = {}
        pipe = Pipe()
        try:
            for stem, flat in tensors.items():
                writers[f"{stem}.safetensors"] = write_tensors(staging / f"{stem}.safetensors", flat, pipe)
            for stem, state in torch_states.items():
                writers[f"{stem}.pt"] = write_torch(staging / f"{stem}.pt", state, pipe)
            writers["state.json"] = write_text(staging / "state.json", json.dumps(json_state, indent=1), pipe)
            writers["config.yaml"] = write_text(staging / "config.yaml", config_yaml, pipe)
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
            if info.get("sha256") and sha256_file(file) != info["sha256"]:
                return f"{name} does not match its SHA-256 in the manifest"
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or exc})"
    return None


def warn(message: str) -> None:
    """``warning: message`` on stderr."""
    print(f"warning: {message}", file=sys.stderr, flush=True)
