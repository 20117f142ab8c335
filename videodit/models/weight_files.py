"""Reading released weight files, shared by the families' layout readers: safetensors opened lazily
(a tensor read on access), weights-only torch files, JSON indexes; every failure a one-line
UserError naming the file. Nothing here unpickles objects.

What a file asks for is bounded before anything is allocated: a sharded folder is read exactly
as its ``*.index.json`` names it (:func:`sharded_sources`), a config.json's values are checked
as the schema checks its own (:class:`ConfigValues`), and a model described by a file is built
on the meta device only while it has no more parameters than the weights hold
(:func:`build_bounded`)."""

from __future__ import annotations

import math
import pickle
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn

from videodit.errors import UserError, os_error_message
from videodit.user_files import NotRegularFile, check_regular_file, read_user_json


class LazyTensors(Mapping):
    """The tensors of safetensors files under a family's names, read one at a time on access.

    ``shape(name)`` reads only the header; ``tensors[name]`` reads that one tensor."""

    def __init__(self, sources: dict[str, tuple[Path, str]]):
        self.sources = sources   # our name -> (file, name in the file)
        self._handles: dict[Path, object] = {}

    def _handle(self, file: Path):
        if file not in self._handles:
            self._handles[file] = open_safetensors(file)
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        file, key = self.sources[name]
        return tuple(self._handle(file).get_slice(key).get_shape())

    def __getitem__(self, name: str) -> torch.Tensor:
        file, key = self.sources[name]
        return self._handle(file).get_tensor(key)

    def __iter__(self):
        return iter(self.sources)

    def __len__(self):
        return len(self.sources)

    def close(self) -> None:
        self._handles.clear()


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def open_safetensors(file: Path):
    """A safetensors handle (header read, tensors on demand)."""
    try:
        return safe_open(str(check_regular_file(file)), framework="pt")
    except NotRegularFile as exc:
        raise UserError(os_error_message(exc)) from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(f"{file} cannot be read as safetensors ({_first_line(exc)}); restore it from the original "
                        "download") from None


def read_json(file: Path):
    try:
        return read_user_json(file)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{file} is not valid JSON ({exc}); restore it from the original download") from None


def read_weights(file: Path) -> dict[str, torch.Tensor]:
    """A state dict from safetensors or a weights-only torch file; Open-Sora's {"ema": ...} unwrapped
    and a DDP ``module.`` prefix dropped."""
    try:
        if file.suffix == ".safetensors":
            state = load_file(str(check_regular_file(file)))
        else:
            state = torch.load(check_regular_file(file), map_location="cpu", weights_only=True)
    except NotRegularFile as exc:
        raise UserError(os_error_message(exc)) from None
    except pickle.UnpicklingError:
        raise UserError(f"{file} holds objects other than tensors, which videodit refuses to unpickle; save the "
                        "state dict alone (torch.save(model.state_dict(), ...)) or as safetensors") from None
    except (SafetensorError, RuntimeError, OSError, EOFError, ValueError) as exc:
        raise UserError(f"{file} cannot be read as weights ({_first_line(exc)}); restore it from the original "
                        "checkpoint") from None
    if isinstance(state, dict) and isinstance(state.get("ema"), dict):   # as Open-Sora's reparameter does
        state = state["ema"]
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UserError(f"{file} is not a state dict of tensors; pass Open-Sora's model weights")
    if state and all(name.startswith("module.") for name in state):
        state = {name[len("module."):]: t for name, t in state.items()}
    return state


# ---------------------------------------------------------------------------- sharded folders

def read_index(index_file: Path) -> dict[str, str]:
    """The ``weight_map`` of a sharded folder's ``*.index.json`` (tensor name -> shard file), checked:
    names and shards are strings, and every shard is a file beside the index."""
    data = read_json(index_file)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise UserError(f"{index_file} has no weight_map of tensor names to shard files; restore it from the "
                        "original download")
    folder = index_file.parent
    for shard in sorted(set(weight_map.values())):
        if shard in ("", ".", "..") or Path(shard).name != shard or "\\" in shard or "\0" in shard:
            raise UserError(f"{index_file} names the shard {shard[:80]!r}, which is not a file beside it; shards "
                            "live in the index's folder: restore the index from the original download")
        if not (folder / shard).exists():
            raise UserError(f"{index_file} names the shard {shard!r}, which is not in {folder}; download every "
                            "shard beside the index")
    return weight_map


def check_shards(index_file: Path, weight_map: Mapping[str, str], held: Mapping[str, Iterable[str]]) -> None:
    """Each shard (``held``: shard file -> the tensor names it holds) holds exactly the tensors the
    index maps to it: a tensor in two shards, or one missing from its shard, or one the index does
    not name, is refused in one line (a later shard never silently wins)."""
    owner: dict[str, str] = {}
    for shard, names in held.items():
        for name in names:
            if name in owner:
                raise UserError(f"{index_file}: the tensor {name[:80]} is in two shards ({owner[name]} and {shard}); "
                                "the shards come from different downloads: download the folder again")
            owner[name] = shard
    for name, shard in weight_map.items():
        if owner.get(name) != shard:
            where = f"it is in {owner[name]}" if name in owner else "no shard holds it"
            raise UserError(f"{index_file} names the tensor {name[:80]} in {shard}, but {where}; the index does not "
                            "match its shards: download the folder again")
    extra = sorted(owner.keys() - weight_map.keys())
    if extra:
        raise UserError(f"{index_file}: {owner[extra[0]]} holds the tensor {extra[0][:80]}, which the index does not "
                        f"name ({len(extra)} such); the index does not match its shards: download the folder again")


def sharded_sources(index_file: Path) -> dict[str, tuple[Path, str]]:
    """name -> (shard, name in it) of safetensors shards, exactly as their index names them."""
    weight_map = read_index(index_file)
    folder = index_file.parent
    shards = sorted(set(weight_map.values()))
    check_shards(index_file, weight_map, {shard: open_safetensors(folder / shard).keys() for shard in shards})
    return {name: (folder / shard, name) for name, shard in weight_map.items()}


def merged_sources(files: Iterable[Path]) -> dict[str, tuple[Path, str]]:
    """name -> (file, name) of several safetensors files read as one state dict; a name held by
    two files is refused (which one a loader would take is not written anywhere)."""
    sources: dict[str, tuple[Path, str]] = {}
    for file in files:
        for name in open_safetensors(file).keys():
            if name in sources:
                raise UserError(f"the tensor {name[:80]} is in both {sources[name][0]} and {file}; keep the files "
                                "of one checkpoint only")
            sources[name] = (file, name)
    return sources


# ---------------------------------------------------------------------------- config values

MAX_SIZE = 1 << 24     # a width or a channel count (released models stay far below)
MAX_TOKENS = 1 << 16   # caption tokens a model pads to
_MISSING = object()


class ConfigValues:
    """The values of a released ``config.json``, each checked as the schema checks its own: the
    right type, finite, in range; a bad one is one UserError naming the file, the key, what is
    allowed and ``fix``."""

    def __init__(self, config: Mapping, file: Path | str, fix: str):
        self.config, self.file, self.fix = config, file, fix

    def _get(self, key: str, default):
        value = self.config.get(key, default)
        if value is _MISSING:
            raise UserError(f"{self.file} lacks {key}; {self.fix}")
        return value

    def _bad(self, key: str, value, problem: str) -> UserError:
        shown = repr(value)
        shown = shown if len(shown) <= 40 else shown[:40] + "..."
        return UserError(f"{self.file}: {key}={shown} {problem}; {self.fix}")

    def int(self, key: str, default=_MISSING, low: int = 1, high: int = MAX_SIZE) -> int:
        value = self._get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._bad(key, value, "is not a whole number")
        if not low <= value <= high:
            raise self._bad(key, value, f"is out of range: it must be from {low} to {high}")
        return value

    def optional_int(self, key: str, low: int = 1, high: int = MAX_SIZE) -> int | None:
        return None if self.config.get(key) is None else self.int(key, low=low, high=high)

    def float(self, key: str, default=_MISSING, above: float = 0.0, below: float = math.inf) -> float:
        value = self._get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self._bad(key, value, "is not a number")
        if not math.isfinite(value):
            raise self._bad(key, value, "is not a finite number")
        if not above < value < below:
            raise self._bad(key, value, f"is out of range: it must lie between {above:g} and {below:g}")
        return float(value)

    def bool(self, key: str, default=_MISSING) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self._bad(key, value, "is not true or false")
        return value

    def ints(self, key: str, default=_MISSING, length: int = 3, low: int = 1, high: int = 64) -> tuple[int, ...]:
        value = self._get(key, default)
        if not (isinstance(value, (list, tuple)) and len(value) == length
                and all(isinstance(v, int) and not isinstance(v, bool) and low <= v <= high for v in value)):
            raise self._bad(key, value, f"is not a list of {length} whole numbers from {low} to {high}")
        return tuple(value)


# ---------------------------------------------------------------------------- building what a file describes

class _TooLarge(Exception):
    pass


def build_bounded(build: Callable[[], nn.Module], held: int, refusal: str) -> nn.Module:
    """``build()`` on the meta device, stopped with ``UserError(refusal)`` as soon as it has
    registered far more parameters than the ``held`` tensors of its weights (twice as many, plus
    64: a model a few tensors off is built, so the strict check after it names them): a model
    described by a file (its config, the names or shapes of its tensors) cannot take weights that
    hold far fewer tensors, and a million layers are never built to find that out."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    max_parameters = 2 * held + 64
    count, thread = 0, threading.get_ident()

    def counted(module, name, param):
        nonlocal count
        if param is not None and threading.get_ident() == thread:
            count += 1
            if count > max_parameters:
                raise _TooLarge

    handle = register_module_parameter_registration_hook(counted)
    try:
        with torch.device("meta"):
            return build()
    except _TooLarge:
        raise UserError(refusal) from None
    finally:
        handle.remove()
