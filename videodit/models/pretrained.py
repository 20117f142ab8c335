"""``load_pretrained``: a model from any folder videodit reads weights from.

A videodit model folder (``save_pretrained``, ``videodit ckpt export`` or ``ckpt import``:
``config.json`` with the family's ``model_type`` + ``model.safetensors``), or any family's
released layout (Open-Sora's STDiT3 folders and training checkpoints, Wan's folders), converted
on the fly. Nothing from the folder is executed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from videodit.errors import UserError
from videodit.models.families import families, released_spec, spec_for_model_type
from videodit.user_files import check_regular_file, read_user_json

CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


def load_pretrained(path: str | Path, device: str | torch.device = "cpu", ema: bool = False) -> nn.Module:
    """The model at ``path`` in fp32. ``ema``: an Open-Sora training checkpoint's EMA weights."""
    path = Path(path)
    spec = released_spec(path)
    if spec is not None:
        return _with_buffers(spec.load_released(path, ema=ema), spec).to(device)
    config = path / CONFIG_NAME
    if not config.is_file() or not (path / WEIGHTS_NAME).is_file():
        raise UserError(f"{path} is not a model folder: pass a videodit one ({CONFIG_NAME} + {WEIGHTS_NAME}, as "
                        "videodit ckpt export writes it) or released weights "
                        f"({', '.join(s.released_name for s in families().values())})")
    try:
        config_dict = read_user_json(config)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{config} is not valid JSON ({exc}); write it with videodit ckpt export") from None
    model_type = config_dict.get("model_type") if isinstance(config_dict, dict) else None
    # Folders written before model families carried STDiT's arguments; its reader names what is missing.
    spec = spec_for_model_type(model_type) if model_type is not None else families()["stdit"]
    if spec is None:
        known = ", ".join(repr(s.model_type) for s in families().values())
        raise UserError(f"{config} describes a {model_type!r} model; videodit loads its own model folders "
                        f"({known}) and released weights")
    weights = load_file(str(check_regular_file(path / WEIGHTS_NAME)))
    return _filled(spec, spec.geometry_from_config(config_dict), weights).to(device)


def _filled(spec, geometry, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """The family's model built on the meta device and given ``tensors`` (fp32), strictly."""
    with torch.device("meta"):
        model = spec.build(geometry)
    try:
        model.load_state_dict({name: t.float() if t.is_floating_point() else t for name, t in tensors.items()},
                              assign=True)
    except RuntimeError as exc:
        raise UserError(f"the weights do not fit a {spec.family} model of their config "
                        f"({' '.join(str(exc).split())[:200]})") from None
    return _with_buffers(model, spec)


def _with_buffers(model: nn.Module, spec) -> nn.Module:
    """Non-persistent buffers (RoPE tables) are not in a state dict: a model filled on the meta
    device takes them from one built on the CPU (small: buffers only, the weights stay as loaded)."""
    meta = [name for name, b in model.named_buffers() if b.is_meta]
    if meta:
        fresh = dict(spec.build(model.geometry).named_buffers())
        for name in meta:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_buffer(leaf, fresh[name], persistent=False)
    return model
