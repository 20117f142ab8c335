"""``load_pretrained``: a model from any folder videodit reads weights from.

A videodit model folder (``save_pretrained``, ``videodit ckpt export`` or ``ckpt import``:
``config.json`` with the family's ``model_type`` + ``model.safetensors``), or any family's
released layout (Open-Sora's STDiT3 folders and training checkpoints, Wan's folders), converted
on the fly. Nothing from the folder is executed.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from videodit.errors import UserError
from videodit.models.families import families, released_spec, spec_for_model_type
from videodit.models.weight_files import MAX_SIZE, MAX_TOKENS, ConfigValues, build_bounded
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
    spec, geometry = folder_geometry(path)
    weights = load_file(str(check_regular_file(path / WEIGHTS_NAME)))
    return _filled(spec, geometry, weights).to(device)


def folder_geometry(path: str | Path):
    """(spec, geometry) of a videodit model folder's config.json, every value checked as the schema
    checks its own (the right type, finite, in range) before the geometry is made."""
    config = Path(path) / CONFIG_NAME
    try:
        config_dict = read_user_json(config)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{config} is not valid JSON ({exc}); write it with videodit ckpt export") from None
    if not isinstance(config_dict, dict):
        raise UserError(f"{config} is not a JSON object; write it with videodit ckpt export")
    model_type = config_dict.get("model_type")
    # Folders written before model families carried STDiT's arguments; its reader names what is missing.
    spec = spec_for_model_type(model_type) if model_type is not None else families()["stdit"]
    if spec is None:
        known = ", ".join(repr(s.model_type) for s in families().values())
        raise UserError(f"{config} describes a {str(model_type)[:40]!r} model; videodit loads its own model folders "
                        f"({known}) and released weights")
    check_geometry_values(config_dict, spec.geometry_type, config)
    try:
        return spec, spec.geometry_from_config(config_dict)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as exc:
        raise UserError(f"{config} is not a videodit {spec.family} config ({' '.join(str(exc).split())[:160]}); "
                        "write it with videodit ckpt export") from None


def check_geometry_values(config: dict, geometry_type, where) -> None:
    """The values ``config`` gives a geometry's fields, by each field's type: whole numbers from 0 to
    MAX_SIZE (token counts, fields named ``*_len``/``*_length``, from 1 to MAX_TOKENS), finite
    positive numbers, true or false, strings, lists of whole numbers; one line for the first bad one."""
    values = ConfigValues(config, where, "write it with videodit ckpt export")
    hints = typing.get_type_hints(geometry_type)
    for field in dataclasses.fields(geometry_type):
        if field.name not in config:
            continue
        hint, name = hints[field.name], field.name
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if type(None) in typing.get_args(hint) and config[name] is None:
            continue
        kind = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1 else hint
        if kind is bool:
            values.bool(name)
        elif kind is int:
            tokens = name.endswith(("_len", "_length"))
            values.int(name, low=1 if tokens else 0, high=MAX_TOKENS if tokens else MAX_SIZE)
        elif kind is float:
            values.float(name, below=math.inf)
        elif kind is str and not isinstance(config[name], str):
            raise UserError(f"{where}: {name}={str(config[name])[:40]!r} is not a string; write it with videodit "
                            "ckpt export")
        elif typing.get_origin(kind) is tuple and all(a is int for a in typing.get_args(kind)):
            values.ints(name, length=len(typing.get_args(kind)), high=MAX_SIZE)


def check_fits(spec, geometry, shapes: dict[str, tuple[int, ...]], where) -> None:
    """The weights (names -> shapes) are exactly those of the model ``geometry`` describes (built on
    the meta device only while it needs not far more tensors than the weights hold), or one line."""
    model = build_bounded(lambda: spec.build(geometry), len(shapes), f"{where}: the weights do not fit a "
                          f"{spec.family} model of their config: it needs far more tensors than the {len(shapes)} "
                          "they hold")
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    odd = sorted(expected.keys() ^ shapes.keys()) or [n for n in expected if tuple(shapes[n]) != expected[n]]
    if odd:
        name = odd[0]
        problem = ("is missing" if name not in shapes else "is not in the model" if name not in expected else
                   f"is {list(shapes[name])}, the config gives {list(expected[name])}")
        raise UserError(f"{where}: the weights do not fit a {spec.family} model of their config ({name} {problem}); "
                        "write the folder again with videodit ckpt export")


def _filled(spec, geometry, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """The family's model built on the meta device (only while it needs not far more tensors than
    ``tensors``) and given ``tensors`` (fp32), strictly."""
    model = build_bounded(lambda: spec.build(geometry), len(tensors), f"the weights do not fit a {spec.family} "
                          f"model of their config: it needs far more tensors than the {len(tensors)} they hold")
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
