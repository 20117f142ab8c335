"""Reading released weight files, shared by the families' layout readers: safetensors opened lazily
(a tensor read on access), weights-only torch files, JSON indexes; every failure a one-line
UserError naming the file. Nothing here unpickles objects."""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

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
