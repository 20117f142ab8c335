"""Reading one checkpoint: :class:`LoadedCheckpoint`, the one door through which training,
sampling, export and ``model.init_from`` read a checkpoint's files.

Every file is checked against ``manifest.json`` when it is read: it must be a regular file
(a device or FIFO, e.g. ``/dev/zero`` symlinked in, is refused before anything is read) of
the listed size, and its SHA-256 is computed while it is read (one pass: the bytes go
straight into the tensors, the hash runs on a helper thread) and compared before anything
read from it is returned. A damaged file is one ``UserError`` naming it; the other files of
the checkpoint stay usable (e.g. the weights of a checkpoint whose optimizer state is
damaged). A malformed manifest is refused when the checkpoint is opened.

An *export* folder (a model folder, ``config.json`` + ``model.safetensors``, with the run's
config beside it; written by :func:`videodit.checkpoint.tools.export`) loads through
:class:`LoadedCheckpoint` too, so sampling works on it unchanged; it has no checksums, so
only sizes and file types are checked.

Nothing here unpickles arbitrary objects: safetensors files are parsed here (no pickle), and
``.pt`` files are loaded with ``weights_only=True``. The DCP shards of a sharded run are read
by :func:`videodit.parallel.state.load_shards`, which checks them against the same manifest.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
from pathlib import Path

import torch
import yaml

from videodit.config.load import parse_yaml
from videodit.checkpoint.io import (EXPORT_MARK, EXPORT_RECORD, EXPORT_RUN_CONFIG, CheckedReader, Damaged,
                                    ManifestError, is_export_dir, load_manifest, open_regular, read_regular,
                                    resolve_checkpoint)
from videodit.checkpoint.writer import SAFETENSORS_DTYPES, tensor_bytes
from videodit.errors import UserError

_DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
_HEADER_MAX = 100 << 20    # the safetensors library's own limit on a header
_SMALL_FILE_MAX = 64 << 20  # the config and record files of an export


class LoadedCheckpoint:
    """Read access to one checkpoint directory (or an export folder: weights + config only)."""

    def __init__(self, path: str | Path):
        self.path = resolve_checkpoint(path)
        self.is_export = is_export_dir(self.path)
        self.is_model_folder = False   # an export whose config.json is the model's (load_pretrained reads it)
        if self.is_export:
            self._init_export()
            return
        try:
            self.manifest = load_manifest(self.path)
        except ManifestError as exc:
            raise UserError(f"checkpoint {self.path} is damaged: {exc}; use an earlier checkpoint") from None

    def _init_export(self) -> None:
        """An export folder; one written before model folders had a model-only config.json
        (its config.json was the run's config plus the export record) still loads."""
        legacy = not (self.path / EXPORT_RUN_CONFIG).is_file()
        names = ("config.json", "model.safetensors") if legacy else \
            ("config.json", "model.safetensors", EXPORT_RUN_CONFIG, EXPORT_RECORD)
        try:
            sizes = {name: _regular_size(self.path / name) for name in names}
            if legacy:
                config = json.loads(read_regular(self.path / "config.json", _SMALL_FILE_MAX))
                if not isinstance(config, dict):
                    raise ValueError("config.json is not an object")
                info = config.pop(EXPORT_MARK, None) or {}
            else:
                text = read_regular(self.path / EXPORT_RUN_CONFIG, _SMALL_FILE_MAX).decode("utf-8", "replace")
                config = parse_yaml(text, str(self.path / EXPORT_RUN_CONFIG)) or {}   # aliases bounded
                info = json.loads(read_regular(self.path / EXPORT_RECORD, _SMALL_FILE_MAX))
                if not isinstance(config, dict) or not isinstance(info, dict):
                    raise ValueError("not a mapping")
        except (Damaged, ValueError, RecursionError, yaml.YAMLError) as exc:
            raise UserError(f"export {self.path}: {' '.join(str(exc).split())[:200]}; export the checkpoint "
                            "again with `videodit ckpt export`") from None
        self.run_config, self.export_info = config, info
        self.is_model_folder = not legacy
        files = {name: {"bytes": size} for name, size in sizes.items()}
        self.manifest = {"step": info.get("step", 0), "epoch": None, "files": files, "metrics": {},
                         "export": info}

    @property
    def step(self) -> int:
        step = self.manifest.get("step")
        return step if isinstance(step, int) and not isinstance(step, bool) else 0

    @property
    def metrics(self) -> dict:
        metrics = self.manifest.get("metrics")
        return metrics if isinstance(metrics, dict) else {}

    def has(self, stem: str) -> bool:
        return any(name.startswith(stem + ".") for name in self.manifest["files"])

    @property
    def has_shards(self) -> bool:
        """Whether a sharded run wrote DCP shards (``dcp/``) beside the whole tensors."""
        return any(name.startswith("dcp/") for name in self.manifest["files"])

    def _not_in_export(self, what: str):
        return UserError(f"{self.path} is an exported model (weights and config only) and has no {what}; "
                         "to resume training pass a checkpoints/step-NNNNNNN folder")

    # ------------------------------------------------------------------ checked reading

    def _damaged(self, problem: str) -> UserError:
        if self.is_export:
            return UserError(f"export {self.path}: {problem}; export the checkpoint again with "
                             "`videodit ckpt export`")
        return UserError(f"checkpoint {self.path} is damaged: {problem}; use an earlier checkpoint")

    def _reader(self, name: str) -> CheckedReader:
        info = self.manifest["files"].get(name)
        if info is None:
            raise self._damaged(f"{name} is not in its manifest")
        try:
            return CheckedReader(self.path / name, info["bytes"], info.get("sha256"), name)
        except Damaged as exc:
            raise self._damaged(str(exc)) from None

    def _read(self, name: str) -> bytearray:
        """The bytes of ``name``, checked against the manifest."""
        try:
            with self._reader(name) as reader:
                data = reader.read(reader.size)
                reader.finish()
        except Damaged as exc:
            raise self._damaged(str(exc)) from None
        return data

    def tensors(self, stem: str) -> dict[str, torch.Tensor]:
        """The tensors of ``{stem}.safetensors``, each in memory of its own, read once and
        checked against the manifest."""
        if self.is_export and stem != "model":
            raise self._not_in_export(f"{stem} weights")
        name = f"{stem}.safetensors"
        try:
            with self._reader(name) as reader:
                tensors = read_safetensors(reader)
                reader.finish()
        except Damaged as exc:
            raise self._damaged(str(exc)) from None
        except ValueError as exc:   # a malformed file whose checksum matches: not written by videodit
            raise UserError(" ".join(f"checkpoint {self.path}: {name} cannot be read ({exc}); use a "
                                     "checkpoint written by videodit".split())) from None
        return tensors

    def tensor_shapes(self, stem: str) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the tensors of ``{stem}.safetensors``, from its header alone (see
        :meth:`tensor_specs`)."""
        return {name: tuple(spec["shape"]) for name, spec in self.tensor_specs(stem).items()}

    def tensor_specs(self, stem: str) -> dict[str, dict]:
        """``{name: {"dtype": "F32", "shape": [...]}}`` of ``{stem}.safetensors``, from its header
        alone: the file must be a regular file of its listed size; its hash is checked when
        :meth:`tensors` reads it. (``safetensors.safe_open`` instead hangs on a FIFO.)"""
        if self.is_export and stem != "model":
            raise self._not_in_export(f"{stem} weights")
        name = f"{stem}.safetensors"
        info = self.manifest["files"].get(name)
        if info is None:
            raise self._damaged(f"{name} is not in its manifest")
        try:
            with CheckedReader(self.path / name, info["bytes"], None, name) as reader:
                entries = _header_entries(reader)
        except Damaged as exc:
            raise self._damaged(str(exc)) from None
        except ValueError as exc:
            raise UserError(" ".join(f"checkpoint {self.path}: {name} cannot be read ({exc}); use a "
                                     "checkpoint written by videodit".split())) from None
        return {entry[2]: {"dtype": SAFETENSORS_DTYPES[entry[3]], "shape": list(entry[4])}
                for entry in sorted(entries, key=lambda e: e[2])}

    def torch_state(self, stem: str) -> dict:
        if self.is_export:
            raise self._not_in_export(f"{stem} state")
        name = f"{stem}.pt"
        data = self._read(name)
        try:
            return torch.load(_MemoryFile(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise UserError(f"checkpoint {self.path}: {name} holds objects other than tensors and plain "
                            "values, which videodit refuses to unpickle; use a checkpoint written by videodit"
                            ) from None
        except (RuntimeError, EOFError, OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"checkpoint {self.path}: {name} cannot be read ({first[:200]}); use a "
                            "checkpoint written by videodit") from exc

    def json_state(self) -> dict:
        if self.is_export:
            raise self._not_in_export("training state")
        try:
            state = json.loads(self._read("state.json"))
        except (ValueError, RecursionError):
            state = None
        if not isinstance(state, dict):
            raise UserError(f"checkpoint {self.path}: state.json is not a JSON object; use a checkpoint "
                            "written by videodit")
        return state

    def config_yaml(self) -> str:
        if self.is_export:
            return yaml.safe_dump(self.run_config, sort_keys=False)
        try:
            return self._read("config.yaml").decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"checkpoint {self.path}: config.yaml is not UTF-8 text; use a checkpoint "
                            "written by videodit") from None


def _regular_size(file: Path) -> int:
    fd = open_regular(file)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def read_safetensors(reader: CheckedReader) -> dict[str, torch.Tensor]:
    """Parse a safetensors file from ``reader`` (positioned at its start): the header, then
    each tensor read straight into memory of its own (what ``safetensors.torch.load_file``
    returns). Gaps between tensors are read and hashed too. Raises ValueError on a malformed
    file; the caller checks the hash with ``reader.finish()`` before using the result."""
    tensors, buffers, position = {}, [], 0
    for begin, end, name, dtype, shape in _header_entries(reader):
        if begin > position:   # never in files videodit writes
            buffers.append(bytearray(begin - position))
        tensor = torch.empty(shape, dtype=dtype)
        if end > begin:
            buffers.append(tensor_bytes(tensor))
        tensors[name] = tensor
        position = end
    reader.readinto_many(buffers)   # many tensors per read call: models have thousands of small ones
    return tensors


def _header_entries(reader: CheckedReader) -> list[tuple[int, int, str, torch.dtype, list[int]]]:
    """The tensors a safetensors header lists, ``(begin, end, name, dtype, shape)`` with
    offsets relative to the data, in file order, checked: known dtypes, sizes that fit the
    shapes and the file, no overlaps. Raises ValueError."""
    if reader.size < 8:
        raise ValueError("shorter than a safetensors header")
    length = int.from_bytes(reader.read(8), "little")
    if length > min(_HEADER_MAX, reader.size - 8):
        raise ValueError(f"its header length {length} is past the end of the file")
    try:
        header = json.loads(reader.read(length))
    except (ValueError, RecursionError):
        raise ValueError("its header is not JSON") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    body = reader.size - 8 - length
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"tensor {name[:80]!r} has no dtype/shape/offsets")
        dtype, shape, offsets = _DTYPES.get(entry.get("dtype")), entry.get("shape"), entry.get("data_offsets")
        if dtype is None:
            raise ValueError(f"tensor {name[:80]!r} has an unknown dtype {str(entry.get('dtype'))[:20]!r}")
        if not (isinstance(shape, list) and all(_count(d) for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)):
            raise ValueError(f"tensor {name[:80]!r} has a malformed shape or offsets")
        begin, end = offsets
        if not begin <= end <= body or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name[:80]!r} has offsets that do not fit its shape or the file")
        entries.append((begin, end, name, dtype, shape))
    entries.sort(key=lambda e: (e[0], e[1]))
    position = 0
    for begin, end, name, _, _ in entries:
        if begin < position:
            raise ValueError(f"tensor {name[:80]!r} overlaps another one")
        position = end
    return entries


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _MemoryFile(io.RawIOBase):
    """A read-only file over memory, without a copy (``io.BytesIO`` copies, and torch.load is
    several times slower on it)."""

    def __init__(self, data):
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), len(self._view) - self._pos))
        buffer[:count] = self._view[self._pos:self._pos + count]
        self._pos += count
        return count

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos
