"""Reading a config: a built-in preset or a YAML file, then ``key.sub=value`` overrides,
then validation. Unknown keys and bad values raise :class:`UserError` naming the key and what
is allowed, before any work starts. (``data.bucket_config`` is checked where the data is
built, by ``data/buckets/config.py``.)
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import types
import sys
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from videodit.config.schema import LORA_AUDIO_TARGETS, LORA_TARGETS, PARALLEL_ALIASES, ZERO_STAGES, Config
from videodit.errors import UserError, os_error_message
from videodit.user_files import read_user_text

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
        if not path.exists():
            raise UserError(f"config file {source!r} does not exist; pass a YAML file or one of the "
                            f"presets: {', '.join(builtin_presets())}")
        try:
            text = read_user_text(path, max_bytes=CONFIG_MAX_BYTES, encoding="utf-8-sig")
        except OSError as exc:
            raise UserError(f"config {source!r}: {os_error_message(exc)}") from None
        except UnicodeDecodeError as exc:
            raise UserError(f"config {source!r} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    elif source in builtin_presets():
        text = resources.files(PRESETS_PACKAGE).joinpath(f"{source}.yaml").read_text()
    else:
        raise UserError(f"{source!r} is neither a YAML file nor a preset; presets: "
                        f"{', '.join(builtin_presets())}")
    raw = parse_yaml(text, f"config {source!r}")
    if raw is None:
        print(f"note: config {source!r} is empty; using the built-in defaults (videodit config show lists them)",
              file=sys.stderr)
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"config {source!r} must be a mapping of keys to values")
    return raw


CONFIG_MAX_BYTES = 16 << 20   # a config is kilobytes; a bigger file is a mistake or crafted
MAX_YAML_NODES = 100_000   # values after expanding aliases; a config has a few hundred


class _AliasBomb(Exception):
    """YAML whose aliases (``*name``) would expand past :data:`MAX_YAML_NODES` or into themselves."""


class _BoundedLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing aliases that would expand past :data:`MAX_YAML_NODES` values
    ("billion laughs") or into themselves. The check runs on the composed node graph, where an alias
    is one shared node, before anything is constructed."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            self._aliases_seen = True
        return super().compose_node(parent, index)

    def compose_document(self):
        self._aliases_seen = False
        node = super().compose_document()
        if self._aliases_seen:
            _check_expansion(node)
        return node


def _check_expansion(root: yaml.Node) -> None:
    """Count the values ``root`` expands to (each shared node counted at every use), without
    recursion and stopping as soon as the count passes the bound."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        children = [] if isinstance(node, yaml.ScalarNode) else \
            [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else list(node.value)
        if done:
            on_path.discard(id(node))
            size = 1 + sum(sizes[id(c)] for c in children)
            if size > MAX_YAML_NODES:
                raise _AliasBomb(f"its aliases (*name) expand to more than {MAX_YAML_NODES:,} values; "
                                 "write the values out or use fewer aliases")
            sizes[id(node)] = size
            continue
        if id(node) in sizes:
            continue
        if id(node) in on_path:
            raise _AliasBomb("an alias (*name) refers to a value that contains it; write the values out")
        on_path.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)


class _StrictLoader(_BoundedLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (YAML keeps the last
    silently, so a typo'd copy of a section would quietly win)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is written twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _StrictLoader.construct_mapping)

MAX_YAML_DEPTH = 64   # far beyond any config; deeper nesting is an attack or a generated mistake


def parse_yaml(text: str, what: str) -> Any:
    """Safe YAML (no Python tags, no duplicate keys, bounded nesting) or a one-line UserError."""
    depth = _nesting(text)
    if depth > MAX_YAML_DEPTH:
        raise UserError(f"{what} nests {depth} levels deep (at most {MAX_YAML_DEPTH}); flatten it")
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as exc:
        where = f" (line {exc.problem_mark.line + 1})" if exc.problem_mark is not None else ""
        raise UserError(f"{what} is not valid YAML: {exc.problem or exc.context}{where}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{what} is not valid YAML: {' '.join(str(exc).split())[:300]}") from None
    except RecursionError:
        raise UserError(f"{what} nests too deeply to read; flatten it") from None
    except _AliasBomb as exc:
        raise UserError(f"{what} is refused: {exc}") from None
    except ValueError as exc:   # an integer of more than 4300 digits, a date like 2020-02-30
        raise UserError(f"{what} holds a value YAML cannot read: {' '.join(str(exc).split(';')[0].split())[:200]}") from None


def _nesting(text: str) -> int:
    """An upper bound of the flow-style nesting depth ([ and { open, ] and } close) of ``text``;
    block nesting is bounded by the indentation the parser reads without recursion trouble."""
    depth = deepest = 0
    for char in text:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth = max(depth - 1, 0)
    return deepest


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise UserError(f"override {item!r} must look like key.sub=value (e.g. train.max_steps=100)")
    key, text = item.split("=", 1)
    depth = _nesting(text)
    if depth > MAX_YAML_DEPTH:
        raise UserError(f"override {key.strip()}: its value nests {depth} levels deep (at most {MAX_YAML_DEPTH})")
    try:
        value = yaml.load(text, Loader=_BoundedLoader) if text.strip() else None
    except _AliasBomb as exc:
        raise UserError(f"override {key.strip()} is refused: {exc}") from None
    except (yaml.YAMLError, ValueError, RecursionError):
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


def from_yaml(text: str, what: str) -> Config:
    """A validated config from YAML text someone handed us (a checkpoint's config.yaml)."""
    raw = parse_yaml(text, what) or {}
    if not isinstance(raw, dict):
        raise UserError(f"{what} must be a mapping of keys to values")
    return from_dict(raw)


def from_dict(raw: dict) -> Config:
    cfg = _build(Config, _apply_memory_aliases(_apply_parallel_aliases(raw)), prefix="")
    cfg.model = cfg.model.resolved()
    if cfg.lora.targets is None:
        audio = LORA_AUDIO_TARGETS.get(cfg.model.family, []) if cfg.model.train_audio else []
        cfg.lora.targets = list(LORA_TARGETS[cfg.model.family]) + audio
    _check_consistency(cfg)
    return cfg


MAX_SHOWN = 200   # characters of a value quoted in an error message


class _ShortRepr(reprlib.Repr):
    def repr_int(self, x, level):   # repr() of an int past 4300 digits raises ValueError
        return repr(x) if x.bit_length() < 600 else f"<an integer of about {int(x.bit_length() * 0.30103) + 1} digits>"


_short_repr = _ShortRepr()
_short_repr.maxlevel, _short_repr.maxlist, _short_repr.maxtuple, _short_repr.maxdict = 4, 12, 12, 12
_short_repr.maxstring = _short_repr.maxother = _short_repr.maxlong = MAX_SHOWN


def _show(value: Any, quote: bool = True) -> str:
    """``value`` for an error message: its repr (or str), at most :data:`MAX_SHOWN` characters,
    cut with an ellipsis, built without formatting the whole of a huge value."""
    text = _short_repr.repr(value) if quote or not isinstance(value, str) else value[:MAX_SHOWN + 1]
    text = " ".join(text.split()) if len(text) > MAX_SHOWN else text
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


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
                raise UserError(f"zero_stage={_show(value)} is not allowed; choose one of: 0 (DDP), 1 or 2 (FSDP, "
                                "weights kept after forward), 3 (FSDP, weights resharded)")
            implied.update(ZERO_STAGES[value])
        else:
            implied[PARALLEL_ALIASES[name]] = value
    for key, value in implied.items():
        if key in section and section[key] != value:
            raise UserError(f"parallel.{key}={_show(section[key])} conflicts with the Open-Sora option that implies "
                            f"{key}={_show(value)}; set one of them")
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
            raise UserError(f"{name}={_show(value)} must be true or false (or set memory.checkpointing)")
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
    if m.family != m.preset_family:
        raise UserError(f"model.family={m.family} does not fit model.preset={m.preset} (a {m.preset_family} preset); "
                        f"choose a {m.family} preset or leave model.family unset")
    if m.family != "wan" and (m.task != "t2v" or m.image_dim is not None):
        raise UserError(f"model.task={m.task} / model.image_dim belong to the Wan family, not {m.family}; "
                        "leave them unset or choose a Wan preset")
    if m.family == "wan" and cfg.diffusion.mask_ratios is not None and m.task != "ti2v":
        raise UserError(f"diffusion.mask_ratios on Wan is TI2V's image conditioning (the given frames' tokens at "
                        f"time 0): set model.task=ti2v (not {m.task}), or remove diffusion.mask_ratios")
    if m.image_dim is not None and m.task != "i2v":
        raise UserError(f"model.image_dim (CLIP features) needs model.task=i2v, not {m.task}")
    if m.family == "wan" and m.ffn_dim is None:
        raise UserError("model.ffn_dim is not set; a Wan preset sets it (wan-tiny, wan2.1-t2v-1.3b, ...)")
    if m.hidden_size % m.num_heads:
        valid = [h for h in range(1, m.hidden_size + 1) if m.hidden_size % h == 0 and h <= 64]
        raise UserError(f"model.num_heads={m.num_heads} does not divide model.hidden_size={m.hidden_size}; "
                        f"valid: {', '.join(map(str, valid))}")
    if (m.hidden_size // m.num_heads) % 2:
        raise UserError(f"head size hidden_size/num_heads={m.hidden_size // m.num_heads} must be even "
                        "(rotary embeddings rotate pairs); change model.num_heads")
    sample_height, sample_width = cfg.sample.height or cfg.data.height, cfg.sample.width or cfg.data.width
    if sample_height % 2 or sample_width % 2:   # the run ends by writing samples as mp4 (H.264)
        raise UserError(f"samples are written as mp4, which needs an even height and width; got "
                        f"{sample_height}x{sample_width} (sample.height/width, else data.height/width): make them even")
    _check_experts(cfg)
    _check_objective(cfg.diffusion)
    time_range = cfg.diffusion.timestep_range
    if time_range is not None and not time_range[0] < time_range[1]:
        raise UserError(f"diffusion.timestep_range={time_range} is empty: give [lo, hi] with lo < hi, e.g. [0.875, 1.0]")
    if cfg.data.bucket_config is not None and cfg.data.bucket_config_file is not None:
        raise UserError("set data.bucket_config or data.bucket_config_file, not both")
    if cfg.vae.kind == "diffusers" and not cfg.vae.path:
        raise UserError("vae.path is required for vae.kind=diffusers: point it to a local diffusers "
                        "autoencoder folder (nothing is downloaded)")
    if cfg.vae.kind == "opensora-v1.2" and not cfg.vae.path:
        raise UserError("vae.path is required for vae.kind=opensora-v1.2: point it to the downloaded "
                        "hpcai-tech/OpenSora-VAE-v1.2 folder (nothing is downloaded)")
    if cfg.text.kind == "transformers" and not cfg.text.path:
        raise UserError("text.path is required for text.kind=transformers: point it to a local "
                        "transformers encoder folder (nothing is downloaded)")


def _check_objective(d) -> None:
    """Open-Sora 2.0's shift rule and noise floor against the rest of ``diffusion.*``."""
    if d.shift_rule == "opensora2" and d.constant_shift is not None:
        raise UserError(f"diffusion.shift_rule=opensora2 shifts by the clip's size, diffusion.constant_shift="
                        f"{d.constant_shift} by a constant: unset one of them")
    if d.sigma_min and (d.prediction != "velocity" or d.loss_space != "velocity"):
        raise UserError(f"diffusion.sigma_min={d.sigma_min} (Open-Sora 2.0's noise floor) is defined for velocity "
                        "prediction and a velocity loss: set diffusion.prediction and diffusion.loss_space to "
                        "velocity, or diffusion.sigma_min=0")
    if d.condition_config is not None and d.mask_ratios is not None:
        raise UserError("diffusion.condition_config (Open-Sora 2.0's conditioning) and diffusion.mask_ratios "
                        "(Open-Sora 1.2's frame masks) are two ways to give frames: set one of them")
    if d.no_i2v_ref_loss and d.condition_config is None:
        raise UserError("diffusion.no_i2v_ref_loss leaves given frames of diffusion.condition_config's i2v modes out "
                        "of the loss: set diffusion.condition_config too, or remove it")


def _check_experts(cfg: Config) -> None:
    """``model.expert`` needs a two-expert model's boundary; one expert trains on its side of it
    (``diffusion.timestep_range`` is filled in, or must agree), both experts on every timestep."""
    m, time_range = cfg.model, cfg.diffusion.timestep_range
    if m.expert is None:
        if cfg.sample.expert_cfg is not None:
            raise UserError("sample.expert_cfg guides the two experts of a model.expert=both run; remove it, or set "
                            "model.expert=both")
        return
    if m.family != "wan" or m.expert_boundary is None or not 0 < m.expert_boundary < 1:
        raise UserError(f"model.expert={m.expert} needs a two-expert model: a Wan 2.2 A14B preset (wan2.2-t2v-a14b, "
                        "wan2.2-i2v-a14b) or model.expert_boundary strictly between 0 and 1")
    if m.expert == "both":
        if time_range is not None:
            raise UserError(f"model.expert=both trains every timestep (each on its expert); remove "
                            f"diffusion.timestep_range={time_range}, or train one expert with model.expert=high|low")
        return
    if cfg.sample.expert_cfg is not None:
        raise UserError(f"sample.expert_cfg is for model.expert=both; a model.expert={m.expert} run samples with sample.cfg")
    side = [m.expert_boundary, 1.0] if m.expert == "high" else [0.0, m.expert_boundary]
    if time_range is not None and list(time_range) != side:
        raise UserError(f"diffusion.timestep_range={time_range} is not the {m.expert}-noise expert's {side} "
                        f"(model.expert_boundary={m.expert_boundary}); remove it, it follows from model.expert")
    cfg.diffusion.timestep_range = side


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise UserError(f"{prefix.rstrip('.') or 'config'} must be a section (a mapping), got {_show(raw)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else \
                f"; allowed: {', '.join(prefix + f for f in fields)}"
            raise UserError(f"unknown config key {prefix}{_show(key, quote=False)}{hint}")
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
            raise UserError(f"{key} must be a list, got {_show(value)}; write it as [a, b] (e.g. {key}=[a,b])")
        if "length" in meta and len(value) != meta["length"]:
            raise UserError(f"{key} must have {meta['length']} entries, got {len(value)}")
        if meta.get("nonempty") and not value:
            raise UserError(f"{key} is empty; give at least one entry")
        return [_check_value(key, v, args[0], meta) for v in value]
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key} must be a mapping, got {_show(value)}")
        return value
    if origin is Literal:
        if value not in args:
            raise UserError(f"{key}={_show(value)} is not allowed; choose one of: {', '.join(map(str, args))}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise UserError(f"{key} must be true or false, got {_show(value)}")
        return value
    if hint in (int, float):
        if isinstance(value, str):   # YAML 1.1 reads "1e-3" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (hint is int and isinstance(value, float) and not value.is_integer()):
            raise UserError(f"{key} must be {'an integer' if hint is int else 'a number'}, got {_show(value)}")
        try:
            value = hint(value)
        except OverflowError:   # an integer beyond any float
            limit = f"; it must be <= {meta['max']}" if "max" in meta else ""
            raise UserError(f"{key}={_show(value)} is too large{limit}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{key}={_show(value)} is not a finite number; give a real value")
        if "min" in meta and value < meta["min"]:
            raise UserError(f"{key}={_show(value)} is too small; it must be >= {meta['min']}")
        if "above" in meta and not value > meta["above"]:
            raise UserError(f"{key}={_show(value)} is too small; it must be > {meta['above']}"
                            + (f" ({meta['above_why']})" if "above_why" in meta else ""))
        if "max" in meta and value > meta["max"]:
            raise UserError(f"{key}={_show(value)} is too large; it must be <= {meta['max']}")
        return value
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise UserError(f"{key} must be a string, got {_show(value)}")
        value = str(value)
        if "choices" in meta and value not in meta["choices"]:
            raise UserError(f"{key}={_show(value)} is not allowed; choose one of: {', '.join(meta['choices'])}")
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
