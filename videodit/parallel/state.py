"""Training state across layouts: full (gathered) tensors for files any process can read,
and sharded state for ``torch.distributed.checkpoint`` (DCP).

Full state: ``model.safetensors`` and ``ema.safetensors`` always hold whole tensors (what
sampling and export read) and, without sharding, ``optimizer.pt`` holds the optimizer
state keyed by parameter name. Sharded runs (FSDP/HSDP) also write ``dcp/``: model, EMA
and optimizer as DCP shards, which DCP re-shards on load, so a run saved on 4 ranks
resumes on 2 or on 1. Loading works the same from any layout into any layout. Tensor
parallelism's fused layers (the MMDiT single blocks' ``v_mlp``/``linear2``) are strided shards,
which DCP cannot write: they travel as plain shards (``parallel/tensor.py``'s ``dcp_state``).

Reading shards never runs code from the checkpoint, whoever wrote it: DCP's own reader
unpickles ``dcp/.metadata`` with plain ``pickle`` and the non-tensor entries (learning rate,
betas, ...) with ``torch.load(weights_only=False)``. :func:`load_shards` instead reads the
metadata with an unpickler that builds only DCP's metadata classes (:data:`METADATA_CLASSES`),
checks where it points (files of the checkpoint's manifest, inside ``dcp/``), hands DCP that
object, loads the non-tensor entries weights-only, and checks every shard file against its
size and SHA-256 in ``manifest.json`` before DCP reads it (tensors are loaded by DCP itself
with ``weights_only=True``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, distribute_tensor

from videodit.errors import UserError
from videodit.models.lora import ADAPTER, base_parameter_names
from videodit.parallel.tensor import dcp_state, restore_from_dcp
from videodit.user_files import NotRegularFile, open_user_fd, read_user_bytes

SHARDS_DIR = "dcp"
METADATA_FILE = ".metadata"


def full_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors: plain ones as they are, sharded ones gathered to CPU memory. Gathering
    is a collective, so every rank calls this."""
    return {name: tensor.full_tensor().cpu() if isinstance(tensor, DTensor) else tensor.detach()
            for name, tensor in tensors.items()}


def gather_stages(tensors: dict[str, torch.Tensor], ctx) -> dict[str, torch.Tensor]:
    """Under pipeline parallelism each stage holds part of the model: merge the parts on the
    first rank of each pipeline group (global rank 0 gets the whole model; other ranks get
    their own part back). A collective over the pipeline group."""
    if not ctx.distributed or ctx.dims.pp == 1:
        return tensors
    group = ctx.group("pp")
    first = dist.get_global_rank(group, 0)
    parts = [None] * ctx.dims.pp if ctx.rank == first else None
    dist.gather_object(tensors, parts, dst=first, group=group)
    if ctx.rank != first:
        return tensors
    return {name: tensor for part in parts for name, tensor in part.items()}


def _restricted(state: dict, names) -> dict:
    return {name: value for name, value in state.items() if name in names}


def copy_into(targets: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors from ``source`` into ``targets``, which may be shards (DTensor)."""
    missing = targets.keys() - source.keys()
    if missing:
        raise KeyError(f"state lacks {sorted(missing)[:3]}")
    with torch.no_grad():
        for name, target in targets.items():
            value = source[name].to(target.device if not isinstance(target, DTensor) else target.to_local().device)
            if isinstance(target, DTensor):
                value = distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements)
                target.to_local().copy_(value.to_local())
            else:
                target.copy_(value)


def saved_state(model: nn.Module, adapter: str = ADAPTER) -> dict[str, torch.Tensor]:
    """The model tensors a checkpoint holds: the state dict, less a LoRA run's frozen base (the
    weights the run started from, ``model.init_from``, hold it); of a shared-base run's model,
    ``adapter``'s tensors (each role saves its own)."""
    base = base_parameter_names(model, adapter)
    return {name: tensor for name, tensor in model.state_dict().items() if name not in base}


def _model_options(model: nn.Module, **options) -> StateDictOptions:
    """DCP state-dict options; with LoRA they leave the frozen base out, in and out."""
    if base_parameter_names(model):
        options.update(ignore_frozen_params=True, strict=False)
    return StateDictOptions(**options)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, whole: bool = False) -> dict:
    """The optimizer state keyed by parameter name (of unsharded runs); ``whole``: gathered from
    every rank's shards onto rank 0 (a collective: every rank calls it; the others get {})."""
    if not whole:
        return get_optimizer_state_dict(model, optimizer)
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a whole, name-keyed optimizer state into a plain or sharded model's optimizer
    (a pipeline stage takes its own parameters' part)."""
    names = {name for name, _ in model.named_parameters()}
    state = {"state": _restricted(state["state"], names),
             "param_groups": [{**group, "params": [n for n in group["params"] if n in names]}
                              for group in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor], adapter: str = ADAPTER) -> None:
    """Load whole tensors into a plain or sharded model (a pipeline stage takes its part; frozen
    parameters keep what they hold; of a shared-base run's model, ``adapter``'s tensors)."""
    state = _restricted(state, saved_state(model, adapter).keys())
    if any(isinstance(p, DTensor) for p in model.parameters()):
        set_model_state_dict(model, state, options=_model_options(model, full_state_dict=True, strict=True))
    else:
        model.load_state_dict(state, strict=not base_parameter_names(model))


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema: dict | None) -> dict:
    state = {"model": get_model_state_dict(model, options=_model_options(model)),
             "optimizer": get_optimizer_state_dict(model, optimizer)}
    if ema is not None:
        state["ema"] = ema
    return state


def save_shards(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ema: dict | None) -> None:
    """Every rank writes its shards into ``folder/dcp`` (a collective). Tensor parallelism's fused
    layers are strided shards, which DCP refuses: they are written as plain shards (``dcp_state``)."""
    dcp.save(dcp_state(sharded_state(model, optimizer, ema)), checkpoint_id=str(Path(folder) / SHARDS_DIR))


def load_shards(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ema: dict | None) -> None:
    """Read ``folder/dcp`` into this run's layout, whatever layout wrote it. Every rank checks
    the shard files it reads against ``folder/manifest.json`` (size, SHA-256) and refuses a
    metadata file holding anything but DCP's metadata classes; problems are one UserError."""
    folder = Path(folder)
    files = shard_files(folder)
    metadata = read_shard_metadata(folder, files)
    live = sharded_state(model, optimizer, ema)
    state = dcp_state(live)   # DCP reads into plain shards; restore_from_dcp hands them to the strided ones
    reader = _CheckedReader(folder, files, metadata)
    try:
        with warnings.catch_warnings():   # one process reading shards is intended, not a mistake
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=reader, planner=_WeightsOnlyPlanner(folder),
                     no_dist=not dist.is_initialized())
    except CheckpointException as exc:   # DCP wraps what each rank raised
        errors = [error for error, _ in exc.failures.values()]
        for error in errors:
            if isinstance(error, UserError):
                raise UserError(str(error)) from exc
        raise _unreadable(folder, errors[0] if errors else exc) from exc
    except UserError:
        raise
    except (RuntimeError, ValueError, KeyError, AssertionError, OSError, EOFError, pickle.UnpicklingError) as exc:
        raise _unreadable(folder, exc) from exc
    restore_from_dcp(live, state)
    state = _with_live_shards(live, state)
    set_model_state_dict(model, state["model"], options=_model_options(model))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    # The EMA tensors were loaded in place (strided ones by restore_from_dcp).


def _with_live_shards(live, loaded):
    """What DCP read (tensors and plain values: learning rates, betas), except the sharded tensors,
    taken from ``live``: :func:`restore_from_dcp` copied the plain copies' values into its strided ones."""
    if isinstance(live, dict):
        return {key: _with_live_shards(value, loaded[key]) for key, value in live.items()}
    if isinstance(live, list) and isinstance(loaded, list) and len(live) == len(loaded):
        return [_with_live_shards(value, other) for value, other in zip(live, loaded)]
    return live if isinstance(live, DTensor) else loaded


def _unreadable(folder: Path, exc: BaseException) -> UserError:
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return UserError(f"checkpoint {folder}: its DCP shards do not fit this model or cannot be read ({text[:200]}); "
                     "resume with the model settings of that run, or from a checkpoint written by videodit")


# ---------------------------------------------------------------------------- checked shards

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_MANIFEST_MAX = 64 << 20
_CHUNK = 16 << 20

# What a DCP metadata file holds, found by unpickling real ones (dcp.save on one process and
# FSDP2 on 2 ranks, torch 2.13) with a find_class that logs every global: DCP's metadata
# dataclasses, torch.Size, the dtype/layout/memory-format lookups, the checkpoint id (a
# path). Builtin containers come as pickle opcodes; the few names below cover older protocols.
METADATA_CLASSES = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "list"), ("builtins", "dict"),
    ("builtins", "tuple"), ("collections", "OrderedDict"),
})
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)   # torch.float32, torch.strided, ...


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only :data:`METADATA_CLASSES` and torch's dtype/layout/memory-format constants."""

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid):
        raise _Refused("a persistent id")


class _Refused(pickle.UnpicklingError):
    pass


def shard_files(folder: Path) -> dict[str, dict]:
    """The ``dcp/`` entries of ``folder/manifest.json``, by name inside ``dcp/``, each with its
    ``bytes`` and ``sha256``; UserError if the manifest is malformed or lists none."""
    problem = None
    try:
        manifest = json.loads(read_user_bytes(folder / "manifest.json", max_bytes=_MANIFEST_MAX))
    except (OSError, ValueError, RecursionError) as exc:
        manifest, problem = None, f"manifest.json cannot be read ({' '.join(str(exc).split())[:120]})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if problem is None and not isinstance(files, dict):
        problem = "manifest.json has no 'files' mapping"
    shards = {}
    for name, info in (files or {}).items() if problem is None else ():
        if not name.startswith(SHARDS_DIR + "/"):
            continue
        inner = name[len(SHARDS_DIR) + 1:]
        size = info.get("bytes") if isinstance(info, dict) else None
        sha = info.get("sha256") if isinstance(info, dict) else None
        if (not inner or "/" in inner or "\\" in inner or inner in (".", "..")
                or not isinstance(size, int) or isinstance(size, bool) or size < 0
                or not isinstance(sha, str) or not _SHA256_RE.match(sha)):
            problem = f"manifest.json has a malformed entry {name[:80]!r}"
            break
        shards[inner] = {"bytes": size, "sha256": sha}
    if problem is None and METADATA_FILE not in shards:
        problem = f"{SHARDS_DIR}/{METADATA_FILE} is not in its manifest"
    if problem is not None:
        raise UserError(f"checkpoint {folder} is damaged: {problem}; resume from an earlier checkpoint")
    return shards


def read_shard_metadata(folder: Path, files: dict[str, dict]):
    """``dcp/.metadata``, checked against the manifest, unpickled with :class:`_MetadataUnpickler`
    and checked: every storage entry points into a shard file the manifest lists."""
    name = f"{SHARDS_DIR}/{METADATA_FILE}"
    with _open_checked(folder, METADATA_FILE, files) as handle:
        data = handle.read()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise UserError(f"checkpoint {folder}: {name} holds objects other than checkpoint metadata ({exc}), "
                        "which videodit refuses to unpickle; use a checkpoint written by videodit") from None
    except Exception as exc:
        raise UserError(f"checkpoint {folder}: {name} cannot be read ({type(exc).__name__}: "
                        f"{' '.join(str(exc).split())[:120]}); use a checkpoint written by videodit") from None
    problem = _metadata_problem(metadata, files)
    if problem is not None:
        raise UserError(f"checkpoint {folder}: {name} {problem}; use a checkpoint written by videodit")
    return metadata


def _metadata_problem(metadata, files: dict[str, dict]) -> str | None:
    if type(metadata) is not dcp_metadata.Metadata:
        return f"holds a {type(metadata).__name__}, not DCP metadata"
    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return "lacks its tensor or storage tables"
    kinds = (dcp_metadata.TensorStorageMetadata, dcp_metadata.BytesStorageMetadata)
    if not all(isinstance(key, str) and isinstance(value, kinds) for key, value in entries.items()):
        return "has entries that are not tensors or bytes"
    storage_info = FileSystemReader.__module__ + "._StorageInfo"
    for index, where in storage.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or \
                f"{type(where).__module__}.{type(where).__qualname__}" != storage_info:
            return "has a storage entry of the wrong kind"
        path, offset, length = getattr(where, "relative_path", None), getattr(where, "offset", None), \
            getattr(where, "length", None)
        if not isinstance(path, str) or path == METADATA_FILE or path not in files:
            return f"points at {str(path)[:80]!r}, which is not a shard file in the manifest"
        if not (_count(offset) and _count(length) and offset + length <= files[path]["bytes"]):
            return f"points past the end of {path}"
        if getattr(where, "transform_descriptors", None):
            return "asks for stream transforms videodit does not write"
    return None


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@contextmanager
def _open_checked(folder: Path, inner: str, files: dict[str, dict]):
    """``folder/dcp/inner`` opened for reading once it has been checked against its manifest
    entry: a regular file (never a device or FIFO), its size, its SHA-256 (hashed through the
    same descriptor, then rewound, so DCP reads what was checked)."""
    name = f"{SHARDS_DIR}/{inner}"
    info = files.get(inner)
    if info is None:
        raise UserError(f"checkpoint {folder}: DCP asked for {name}, which is not in its manifest; use a "
                        "checkpoint written by videodit")

    def damaged(problem: str) -> UserError:
        return UserError(f"checkpoint {folder} is damaged: {name} {problem}; resume from an earlier checkpoint")

    try:
        fd = open_user_fd(folder / name)
    except NotRegularFile:
        raise damaged("is not a regular file") from None
    except OSError as exc:
        raise damaged(f"cannot be read ({exc.strerror or exc})") from None
    handle = os.fdopen(fd, "rb", buffering=0)
    try:
        info_stat = os.fstat(fd)
        if info_stat.st_size != info["bytes"]:
            raise damaged(f"has {info_stat.st_size} bytes, the manifest says {info['bytes']}")
        digest, buffer = hashlib.sha256(), bytearray(min(_CHUNK, max(info["bytes"], 1)))
        view, left = memoryview(buffer), info["bytes"]
        while left > 0:
            count = handle.readinto(view[:min(left, len(buffer))])
            if not count:
                raise damaged(f"ended early, the manifest says {info['bytes']} bytes")
            digest.update(view[:count])
            left -= count
        if handle.read(1):
            raise damaged(f"is longer than the manifest's {info['bytes']} bytes")
        if digest.hexdigest() != info["sha256"]:
            raise damaged("does not match its SHA-256 in the manifest")
        handle.seek(0)
        with io.BufferedReader(handle) as buffered:
            yield buffered
    finally:
        handle.close()


class _CheckedFileSystem:
    """DCP's file system, except that reads go through :func:`_open_checked`."""

    def __init__(self, inner, folder: Path, files: dict[str, dict]):
        self._inner, self._folder, self._files = inner, folder, files

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "rb" or Path(path).parent != self._folder / SHARDS_DIR:
            raise UserError(f"checkpoint {self._folder}: DCP asked to open {path} ({mode}); use a checkpoint "
                            "written by videodit")
        with _open_checked(self._folder, Path(path).name, self._files) as handle:
            yield handle


class _CheckedReader(FileSystemReader):
    """DCP's file reader over checked files, with the metadata :func:`load_shards` already read
    and checked (DCP's own ``read_metadata`` would unpickle it with plain pickle)."""

    def __init__(self, folder: Path, files: dict[str, dict], metadata):
        super().__init__(folder / SHARDS_DIR)
        self.fs = _CheckedFileSystem(self.fs, folder, files)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:   # per-rank metadata: videodit always writes the global one
            raise FileNotFoundError("videodit reads only the global DCP metadata")
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = dcp_metadata.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner, except that the non-tensor entries (learning rate, betas, ...) are
    unpickled weights-only: DCP's own ``load_bytes`` uses ``torch.load(weights_only=False)``."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise UserError(f"checkpoint {self.folder}: its DCP shards hold {read_item.dest_index.fqn} as objects "
                            "other than tensors and plain values, which videodit refuses to unpickle; use a "
                            "checkpoint written by videodit") from None
        clean = io.BytesIO()   # DCP unpickles what videodit itself just wrote from the vetted value
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)
