"""Checkpoints: one directory per save, complete or invisible.

``checkpoints/step-0000123/`` holds ``model.safetensors``, ``ema.safetensors``,
``optimizer.pt`` (tensors only; loaded with ``weights_only=True``), ``rng.safetensors``,
``state.json`` (step, data position, LR schedule, Python/NumPy RNG), ``config.yaml`` and
``manifest.json`` (every file with its size and SHA-256). A save is written into a
``.staging-*`` directory, flushed, and renamed into place, so a crash mid-save leaves
nothing a resume would pick up. Nothing here unpickles arbitrary objects.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from videodit.errors import UserError

CHECKPOINT_RE = re.compile(r"^step-(\d{7,})$")
STAGING_PREFIX = ".staging-"


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root`` (a ``checkpoints/`` folder), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and CHECKPOINT_RE.match(p.name)
             and (p / "manifest.json").is_file()]
    return sorted(found, key=lambda p: int(CHECKPOINT_RE.match(p.name).group(1)))


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the newest one of a run directory."""
    path = Path(path)
    if (path / "manifest.json").is_file():
        return path
    for root in (path / "checkpoints", path):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise UserError(f"{str(path)!r} is neither a checkpoint (no manifest.json) nor a run folder with "
                    "checkpoints; pass a run folder or a checkpoints/step-NNNNNNN folder")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(root: Path, step: int, *, tensors: dict[str, dict[str, torch.Tensor]],
                    torch_states: dict[str, dict], json_state: dict, config_yaml: str) -> Path:
    """Write one checkpoint atomically and return its final directory.

    ``tensors``: file stem -> flat tensor dict (safetensors); ``torch_states``: file stem ->
    nested state of tensors and plain values (``torch.save``, safe to load weights-only).
    """
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    staging = root / f"{STAGING_PREFIX}{final.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    started = time.time()
    try:
        for stem, flat in tensors.items():
            save_file({k: v.detach().contiguous().cpu() for k, v in flat.items()},
                      str(staging / f"{stem}.safetensors"))
        for stem, state in torch_states.items():
            torch.save(state, staging / f"{stem}.pt")
        (staging / "state.json").write_text(json.dumps(json_state, indent=1))
        (staging / "config.yaml").write_text(config_yaml)
        files = sorted(p for p in staging.iterdir() if p.is_file())
        for path in files:
            _fsync(path)
        manifest = {
            "step": step,
            "epoch": json_state.get("epoch"),
            "files": {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files},
            "save_seconds": round(time.time() - started, 3),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=1))
        _fsync(staging / "manifest.json")
        if final.exists():   # re-saving the same step (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


class LoadedCheckpoint:
    """Read access to one verified checkpoint directory."""

    def __init__(self, path: str | Path):
        self.path = resolve_checkpoint(path)
        self.manifest = json.loads((self.path / "manifest.json").read_text())
        for name, info in self.manifest["files"].items():
            file = self.path / name
            if not file.is_file() or file.stat().st_size != info["bytes"]:
                raise UserError(f"checkpoint {self.path} is damaged: {name} is missing or has the wrong "
                                "size; resume from an earlier checkpoint")

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def has(self, stem: str) -> bool:
        return any(name.startswith(stem + ".") for name in self.manifest["files"])

    def tensors(self, stem: str) -> dict[str, torch.Tensor]:
        return load_file(str(self.path / f"{stem}.safetensors"))

    def torch_state(self, stem: str) -> dict:
        return torch.load(self.path / f"{stem}.pt", map_location="cpu", weights_only=True)

    def json_state(self) -> dict:
        return json.loads((self.path / "state.json").read_text())

    def config_yaml(self) -> str:
        return (self.path / "config.yaml").read_text()
