"""Open-Sora STDiT3 weights on disk, read and written; the conversion is opensora_stdit.py.

Layouts read:

- an STDiT3 folder as ``STDiT3.save_pretrained`` writes it (the released
  ``hpcai-tech/OpenSora-STDiT-v3`` snapshot): ``config.json`` (``model_type: STDiT3``) and
  ``model.safetensors`` (or a ``*.index.json`` with shards);
- an Open-Sora 1.2 training checkpoint (``opensora/utils/ckpt_utils.py``: ``epochN-global_stepM/``
  holding ``model/``, ColossalAI's sharded state dict with a ``pytorch_model.bin.index.json``, and
  ``ema.pt``), that ``model/`` folder itself, or one weights file (``ema.pt``, ``*.pth``,
  ``*.safetensors``). These have no config.json: the geometry is read off the weights. A
  checkpoint folder gives its ``model/`` weights (what Open-Sora's ``load_checkpoint`` takes),
  ``ema=True`` its ``ema.pt``.

Loading never runs code from the files: safetensors, or ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from videodit.errors import UserError
from videodit.models.stdit.opensora_stdit import (config_from_weights, from_opensora, geometry_from_opensora,
                                            is_opensora_config, opensora_config, to_opensora)
from videodit.models.stdit.model import DiTGeometry, STDiT
from videodit.models.weight_files import check_shards, read_index, read_json, read_weights

WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE_NAMES = ("model.safetensors", "pytorch_model.bin")


def opensora_layout(path: str | Path) -> str | None:
    """"folder" (config.json + weights), "checkpoint" (a training checkpoint, its model/ folder or
    one weights file), or None when ``path`` is not an Open-Sora layout."""
    path = Path(path)
    if path.is_file():
        return "checkpoint" if path.suffix in WEIGHT_SUFFIXES else None
    if not path.is_dir():
        return None
    config = path / "config.json"
    if config.exists():
        return "folder" if is_opensora_config(read_json(config)) else None
    if (path / "model").is_dir() or (path / "ema.pt").is_file() or (path / "running_states.json").is_file():
        return "checkpoint"
    if any((path / name).is_file() for name in (*INDEX_NAMES, "pytorch_model.bin")):
        return "checkpoint"
    return None


def read_opensora(path: str | Path, ema: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    """(STDiT3 config, STDiT3 state dict) of any layout above."""
    path = Path(path)
    layout = opensora_layout(path)
    if layout == "folder":
        return read_json(path / "config.json"), _read_folder_weights(path)
    if layout is None:
        raise UserError(f"{path} is not an Open-Sora STDiT3 layout: pass an STDiT3 folder (config.json with "
                        "model_type STDiT3 + model.safetensors) or an Open-Sora 1.2 training checkpoint")
    if path.is_file():
        state = read_weights(path)
    elif ema:
        if not (path / "ema.pt").is_file():
            raise UserError(f"{path} has no ema.pt; import its model/ weights (leave out --ema)")
        state = read_weights(path / "ema.pt")
    else:
        folder = path / "model" if (path / "model").is_dir() else path
        if not any((folder / n).is_file() for n in (*INDEX_NAMES, *SINGLE_NAMES)) and (path / "ema.pt").is_file():
            raise UserError(f"{path} has no model/ weights, only ema.pt; import those with --ema")
        state = _read_folder_weights(folder)
    return config_from_weights(state), state


def opensora_state(path: str | Path, ema: bool = False) -> tuple[DiTGeometry, dict[str, torch.Tensor]]:
    """The videodit geometry and state dict of the Open-Sora weights at ``path`` (checked)."""
    config, state = read_opensora(path, ema)
    check_config_sizes(config, state, Path(path))
    geometry = geometry_from_opensora(config)
    return geometry, from_opensora(state, geometry, pred_sigma=bool(config.get("pred_sigma", True)))


# What a config.json says that the weights also say (config_from_weights reads them off the shapes).
_SIZE_KEYS = ("in_channels", "patch_size", "hidden_size", "depth", "num_heads", "mlp_ratio", "caption_channels",
              "model_max_length")


def check_config_sizes(config: dict, state: dict[str, torch.Tensor], path: Path) -> None:
    """A config.json's sizes against the weights', before any model is built: one that asks for a
    million blocks (or strings, NaN, another width) is refused in one line instead of building."""
    try:
        found = config_from_weights(state)
    except UserError:
        return   # not the keys config_from_weights reads: check_state names what is missing
    for key in _SIZE_KEYS:
        given = config.get(key, found[key])
        given = list(given) if isinstance(given, (list, tuple)) else given
        if given != found[key]:
            shown = repr(given) if len(repr(given)) <= 40 else repr(given)[:40] + "..."
            raise UserError(f"{path}: config.json gives {key}={shown} but the weights hold {found[key]}; fix or "
                            "restore config.json")


def load_opensora(path: str | Path, ema: bool = False, device: str | torch.device = "cpu") -> STDiT:
    """A videodit STDiT computing what the Open-Sora weights at ``path`` compute (in fp32)."""
    geometry, weights = opensora_state(path, ema)
    model = STDiT(geometry)
    model.load_state_dict({name: t.float() for name, t in weights.items()})
    return model.to(device)


def save_opensora(model: STDiT, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` that ``STDiT3.from_pretrained`` loads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = to_opensora(model.state_dict(), model.geometry)
    tensors = {k: (t.to(dtype) if dtype is not None else t).detach().contiguous() for k, t in tensors.items()}
    (folder / "config.json").write_text(json.dumps(opensora_config(model.geometry), indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


# ---------------------------------------------------------------------------- reading files

def _read_folder_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The weights of a folder: one file, or the shards a ``*.index.json`` names."""
    for index_name in INDEX_NAMES:
        if (folder / index_name).exists():   # exactly what the index names: no later shard wins
            weight_map = read_index(folder / index_name)
            shards = {name: read_weights(folder / name) for name in sorted(set(weight_map.values()))}
            check_shards(folder / index_name, weight_map, shards)
            return {name: tensor for shard in shards.values() for name, tensor in shard.items()}
    for name in SINGLE_NAMES:
        if (folder / name).exists():   # a FIFO in its place is refused when read
            return read_weights(folder / name)
    raise UserError(f"{folder} holds no weights (model.safetensors, pytorch_model.bin or a *.index.json with "
                    "shards); pass the folder Open-Sora wrote")

