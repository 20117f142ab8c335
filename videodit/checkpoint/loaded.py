"""Reading one checkpoint: :class:`LoadedCheckpoint`.

An *export* folder (a model folder, ``config.json`` + ``model.safetensors``, with the run's
config beside it; written by :func:`videodit.checkpoint.tools.export`) loads through
:class:`LoadedCheckpoint` too, so sampling works on it unchanged. Nothing here unpickles arbitrary objects: ``.pt`` files are
loaded with ``weights_only=True``.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from videodit.checkpoint.io import (EXPORT_MARK, EXPORT_RECORD, EXPORT_RUN_CONFIG, is_export_dir, read_manifest,
                                    resolve_checkpoint)
from videodit.errors import UserError

try:   # safetensors >= 0.4
    from safetensors import SafetensorError
except ImportError:   # pragma: no cover
    SafetensorError = RuntimeError


class LoadedCheckpoint:
    """Read access to one checkpoint directory (or an export folder: weights + config only)."""

    def __init__(self, path: str | Path):
        self.path = resolve_checkpoint(path)
        self.is_export = is_export_dir(self.path)
        self.is_model_folder = False   # an export whose config.json is the model's (load_pretrained reads it)
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
        """An export folder; one written before model folders had a model-only config.json
        (its config.json was the run's config plus the export record) still loads."""
        legacy = not (self.path / EXPORT_RUN_CONFIG).is_file()
        names = ("config.json", "model.safetensors") if legacy else \
            ("config.json", "model.safetensors", EXPORT_RUN_CONFIG, EXPORT_RECORD)
        try:
            if legacy:
                config = json.loads((self.path / "config.json").read_text())
                if not isinstance(config, dict):
                    raise ValueError("not an object")
                info = config.pop(EXPORT_MARK, None) or {}
            else:
                config = yaml.safe_load((self.path / EXPORT_RUN_CONFIG).read_text()) or {}
                info = json.loads((self.path / EXPORT_RECORD).read_text())
                if not isinstance(config, dict) or not isinstance(info, dict):
                    raise ValueError("not a mapping")
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise UserError(f"export {self.path}: {' '.join(str(exc).split())[:200]}; export the checkpoint "
                            "again with `videodit ckpt export`") from None
        self.run_config, self.export_info = config, info
        self.is_model_folder = not legacy
        files = {name: {"bytes": (self.path / name).stat().st_size} for name in names}
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
            return yaml.safe_dump(self.run_config, sort_keys=False)
        return (self.path / "config.yaml").read_text()
