"""Reading a config: a built-in preset or a YAML file, then ``key.sub=value`` overrides,
then validation. Unknown keys and bad values raise :class:`UserError` naming the key and what
is allowed, before any work starts. (``data.bucket_config`` is checked where the data is
built, by ``data/buckets/config.py``.)
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from videodit.config.schema import PARALLEL_ALIASES, ZERO_STAGES, Config
from videodit.errors import UserError

PRESETS_PACKAGE = "videodit.config.presets"

def builtin_presets() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(PRESETS_PACKAGE).iterdir()
                  if p.name.endswith(".yaml"))


def load_config(source: Optional[str] = None, overrides: Optional[list[str]] = None) -> Config:
    """Build a validated config from a preset name or YAML path plus ``key=value`` overrides."""
    raw = _read_source(source or "tiny")
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(raw, key, value)
    return from_dict(raw)


def _read_source(source: str) -> dict:
    path = Path(source)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise UserError(f"config file {source!r} does not exist; pass a YAML file or one of the "
                            f"presets: {', '.join(builtin_presets())}")
        text = path.read_text()
    elif source in builtin_presets():
        text = resources.files(PRESETS_PACKAGE).joinpath(f"{source}.yaml").read_text()
    else:
        raise UserError(f"{source!r} is neither a YAML file nor a preset; presets: "
                        f"{', '.join(builtin_presets())}")
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"config {source!r} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise UserError(f"config {source!r} must be a mapping of keys to values")
    return raw


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise UserError(f"override {item!r} must look like key.sub=value (e.g. train.max_steps=100)")
    key, text = item.split("=", 1)
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    return key.strip(), value


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"override {key}: {part!r} is a value, not a section")
    node[parts[-1]] = value


def from_dict(raw: dict) -> Config:
    cfg = _build(Config, _apply_memory_aliases(_apply_parallel_aliases(raw)), prefix="")
    cfg.model = cfg.model.resolved()
    _check_consistency(cfg)
    return cfg


def _apply_parallel_aliases(raw: dict) -> dict:
    """Map Open-Sora's ``sp_size``/``tp_size``/``pp_size``/``zero_stage`` (top level or under
    ``parallel``) onto the ``parallel`` section; a clash with an explicit key is an error."""
    raw = dict(raw)
    section = raw.get("parallel", {})
    if not isinstance(section, dict):
        return raw   # _build reports the bad section
    section = dict(section)
    moved = {name: raw.pop(name) for name in (*PARALLEL_ALIASES, "zero_stage") if name in raw}
    moved.update({name: section.pop(name) for name in (*PARALLEL_ALIASES, "zero_stage") if name in section})
    implied: dict[str, Any] = {}
    for name, value in moved.items():
        if name == "zero_stage":
            if value not in ZERO_STAGES:
                raise UserError(f"zero_stage={value!r} is not allowed; choose one of: 0 (DDP), 1 or 2 (FSDP, "
                                "weights kept after forward), 3 (FSDP, weights resharded)")
            implied.update(ZERO_STAGES[value])
        else:
            implied[PARALLEL_ALIASES[name]] = value
    for key, value in implied.items():
        if key in section and section[key] != value:
            raise UserError(f"parallel.{key}={section[key]!r} conflicts with the Open-Sora option that implies "
                            f"{key}={value!r}; set one of them")
        section[key] = value
    if moved:
        raw["parallel"] = section
    return raw


def _apply_memory_aliases(raw: dict) -> dict:
    """Open-Sora's top-level ``grad_checkpoint`` and the earlier ``train.activation_checkpointing``
    (still in older runs' config.yaml): true/false is ``memory.checkpointing: full/none``."""
    raw = dict(raw)
    train = dict(raw["train"]) if isinstance(raw.get("train"), dict) else None
    moved = {}
    if "grad_checkpoint" in raw:
        moved["grad_checkpoint"] = raw.pop("grad_checkpoint")
    if train is not None and "activation_checkpointing" in train:
        moved["train.activation_checkpointing"] = train.pop("activation_checkpointing")
        raw["train"] = train
    for name, value in moved.items():
        if not isinstance(value, bool):
            raise UserError(f"{name}={value!r} must be true or false (or set memory.checkpointing)")
        section = dict(raw.get("memory") or {})
        implied = "full" if value else "none"
        if section.get("checkpointing", implied) != implied:
            raise UserError(f"memory.checkpointing={section['checkpointing']!r} conflicts with {name}="
                            f"{str(value).lower()}; set one of them")
        section["checkpointing"] = implied
        raw["memory"] = section
    return raw


def _check_consistency(cfg: Config) -> None:
    """Constraints between keys, checked before anything is built."""
    m = cfg.model
    if m.hidden_size % m.num_heads:
        valid = [h for h in range(1, m.hidden_size + 1) if m.hidden_size % h == 0 and h <= 64]
        raise UserError(f"model.num_heads={m.num_heads} does not divide model.hidden_size={m.hidden_size}; "
                        f"valid: {', '.join(map(str, valid))}")
    if (m.hidden_size // m.num_heads) % 2:
        raise UserError(f"head size hidden_size/num_heads={m.hidden_size // m.num_heads} must be even "
                        "(rotary embeddings rotate pairs); change model.num_heads")
    if cfg.data.bucket_config is not None and cfg.data.bucket_config_file is not None:
        raise UserError("set data.bucket_config or data.bucket_config_file, not both")
    if cfg.vae.kind == "diffusers" and not cfg.vae.path:
        raise UserError("vae.path is required for vae.kind=diffusers: point it to a local diffusers "
                        "autoencoder folder (nothing is downloaded)")
    if cfg.text.kind == "transformers" and not cfg.text.path:
        raise UserError("text.path is required for text.kind=transformers: point it to a local "
                        "transformers encoder folder (nothing is downloaded)")


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise UserError(f"{prefix.rstrip('.') or 'config'} must be a section (a mapping), got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else \
                f"; allowed: {', '.join(prefix + f for f in fields)}"
            raise UserError(f"unknown config key {prefix}{key}{hint}")
    values = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, raw[name], prefix=f"{prefix}{name}.")
        else:
            values[name] = _check_value(f"{prefix}{name}", raw[name], hint, f.metadata)
    return cls(**values)


def _check_value(key: str, value: Any, hint: Any, meta: typing.Mapping) -> Any:
    """Coerce ``value`` to ``hint`` or raise a UserError naming the key and what is allowed."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check_value(key, value, inner, meta)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{key} must be a list, got {value!r}")
        if "length" in meta and len(value) != meta["length"]:
            raise UserError(f"{key} must have {meta['length']} entries, got {len(value)}")
        return [_check_value(key, v, args[0], meta) for v in value]
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key} must be a mapping, got {value!r}")
        return value
    if origin is Literal:
        if value not in args:
            raise UserError(f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, args))}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise UserError(f"{key} must be true or false, got {value!r}")
        return value
    if hint in (int, float):
        if isinstance(value, str):   # YAML 1.1 reads "1e-3" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (hint is int and isinstance(value, float) and not value.is_integer()):
            raise UserError(f"{key} must be {'an integer' if hint is int else 'a number'}, got {value!r}")
        value = hint(value)
        if "min" in meta and value < meta["min"]:
            raise UserError(f"{key}={value} is too small; it must be >= {meta['min']}")
        if "max" in meta and value > meta["max"]:
            raise UserError(f"{key}={value} is too large; it must be <= {meta['max']}")
        return value
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise UserError(f"{key} must be a string, got {value!r}")
        value = str(value)
        if "choices" in meta and value not in meta["choices"]:
            raise UserError(f"{key}={value!r} is not allowed; choose one of: {', '.join(meta['choices'])}")
        return value
    raise TypeError(f"config field {key} has unsupported type {hint}")  # a bug in this file


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, type, help) for every option, for ``config keys``."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            rows += describe(hint, f"{prefix}{f.name}.")
        else:
            type_name = str(hint).replace("typing.", "") if not isinstance(hint, type) else hint.__name__
            rows.append((prefix + f.name, type_name, f.metadata.get("help", "")))
    return rows
