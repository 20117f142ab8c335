"""LoRA checkpoints: a run's adapters, on the base weights it started from.

A LoRA run (``lora.rank > 0``) starts from ``model.init_from`` (the *base*), which it never
changes and never saves: its checkpoints hold the adapters (``model.safetensors``; their EMA in
``ema.safetensors``) and the adapters' optimizer state. ``state.json`` records the base as
``lora_base``: its absolute path and a fingerprint of its weight files (the SHA-256 of each
file's whole content: a checkpoint's from its manifest, others hashed here), so a base that
changed since is refused instead of silently getting adapters trained on other weights.

    init_weights(source) -> (weights, taken)   what model.init_from takes from any source
    base_record(source, known) -> dict         what a LoRA run records about its base
    check_base(record, source) -> str          the base, refused if it is not the recorded one
    lora_config(loaded) -> LoraConfig | None   a LoRA checkpoint's settings (None: not one)
    adapted_model(loaded, stem, merge) -> model   the base with the checkpoint's adapters
    lora_model(cfg, base, adapters, merge) -> model   the same from a config and tensors
    run_base(cfg) -> dict                      a starting LoRA run's base record
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import time
from pathlib import Path

import torch
import yaml
from torch import nn

from videodit.config.load import parse_yaml
from videodit.checkpoint.io import is_export_dir, warn
from videodit.checkpoint.loaded import LoadedCheckpoint
from videodit.components import model_geometry, model_of, one_model_tensors
from videodit.config import Config, LoraConfig, ModelConfig, from_yaml
from videodit.errors import UserError, os_error_message
from videodit.models.lora import add_adapters, is_adapter_name, merge_adapters
from videodit.models.families import families, get_spec, released_spec, spec_for_model_type, spec_of
from videodit.models.pretrained import folder_geometry
from videodit.models.spec import ModelSpec
from videodit.user_files import NotRegularFile, open_user_file


def init_weights(source: str | Path, like=None) -> tuple[dict[str, torch.Tensor], str]:
    """The weights ``model.init_from=source`` takes, and a description of them: Open-Sora STDiT3
    weights converted; a LoRA checkpoint's adapters (their EMA if any) merged into its base; a
    checkpoint's EMA weights if it has them (its model weights for the buffers), else its model
    weights; an export's weights; both experts' of a two-expert model folder. ``like``: the geometry
    of the model they are for, whose architecture fields the source's must equal (one line if not)."""
    hints = dataclasses.asdict(like) if like is not None else None
    spec = released_spec(source)
    if spec is not None:
        geometry, weights = spec.read_released_like(Path(source), like=hints)
        check_architecture(source, geometry, like, spec.released_fix)
        return weights, f"{spec.released_short} weights of {source}"
    folders = expert_model_folders(source)
    if folders is not None:   # a videodit two-expert folder: each expert's model folder, by its prefix
        spec, parts = folders
        weights = {}
        for prefix, folder in zip(spec.expert_prefixes, parts):
            ckpt = LoadedCheckpoint(folder)
            check_architecture(source, source_geometry(ckpt, None), like, _FIX)
            weights.update({prefix + name: t for name, t in ckpt.tensors("model").items()})
        return weights, f"two experts' weights of {source}"
    ckpt = LoadedCheckpoint(source)
    stem = "ema" if ckpt.has("ema") else "model"
    if lora_config(ckpt) is not None:
        model = adapted_model(ckpt, stem, merge=True)
        check_architecture(source, getattr(model, "geometry", None), like, _FIX)
        return model.state_dict(), f"{stem} adapters of {ckpt.path} (step {ckpt.step}) merged into their base"
    weights = ckpt.tensors(stem)
    if stem == "ema":   # the EMA covers the parameters; buffers come from the model weights
        weights = {**ckpt.tensors("model"), **weights}
    if like is not None:
        check_architecture(source, source_geometry(ckpt, weights), like, _FIX)
    return weights, f"{stem} weights of {ckpt.path} (step {ckpt.step})"


_FIX = "set model.* as in that run's config.yaml"


def expert_model_folders(source: str | Path) -> tuple[ModelSpec, list[Path]] | None:
    """(spec, [high, low] folders) of a videodit two-expert folder (what ``ckpt export`` of a
    ``model.expert=both`` run and ``ckpt import`` of a two-expert release write), or None."""
    path = Path(source)
    if (path / "config.json").exists() or (path / "manifest.json").exists():
        return None
    for spec in families().values():
        parts = [spec.expert_source(path, expert) for expert in ("high", "low")]
        if all(part is not None and is_export_dir(part) for part in parts):
            return spec, parts
    return None


def source_geometry(ckpt: LoadedCheckpoint, tensors: dict[str, torch.Tensor] | None):
    """The geometry of the model a checkpoint or model folder holds: a model folder's config.json,
    else its run's config with the encoders' widths read off ``tensors``."""
    if ckpt.is_model_folder or (ckpt.is_export and (spec_for_model_type(ckpt.run_config.get("model_type"))
                                                    or not ckpt.export_info)):
        return folder_geometry(ckpt.path)[1]   # its config.json is the model's (no run config beside it)
    tensors = tensors if tensors is not None else ckpt.tensors("model")
    cfg = _config(ckpt)
    spec, one = get_spec(cfg.model.family), one_model_tensors(cfg, tensors)
    return model_geometry(cfg, latent_channels=spec.latent_channels(one), caption_channels=spec.caption_channels(one))


def check_architecture(source, theirs, ours, fix: str) -> None:
    """The model a run starts from has the run's architecture: every geometry field (heads, widths,
    norms, patch, ...) but the ones a run sets apart (``ModelSpec.run_fields``), not only the shapes
    (two heads of 32 and four of 16 hold the same tensors). One line naming the fields and what to set."""
    if theirs is None or ours is None:
        return
    if type(theirs) is not type(ours):
        raise UserError(f"model.init_from={source} holds a {spec_of(theirs).family} model, this run builds a "
                        f"{spec_of(ours).family} one; {fix}")
    spec = spec_of(ours)
    differ = [(f.name, getattr(theirs, f.name), getattr(ours, f.name)) for f in dataclasses.fields(ours)
              if f.name not in spec.run_fields and _value(getattr(theirs, f.name)) != _value(getattr(ours, f.name))]
    if not differ:
        return
    options = {f.name: f"model.{f.name}" for f in dataclasses.fields(ModelConfig)} | dict(spec.field_options)
    shown = ", ".join(f"{name}={_value(there)} there, {_value(here)} here" for name, there, here in differ[:3])
    if all(name in options for name, _, _ in differ):
        fix = "set " + " ".join(f"{options[name]}={_value(there)}" for name, there, _ in differ)
    raise UserError(f"model.init_from={source}: its model is not this run's ({shown}); {fix}")


def _value(value):
    """A geometry value as an override writes it: lists without spaces, booleans in lower case."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(_value(v)) for v in value) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    return value


def base_record(source: str | Path, known: dict | None = None) -> dict:
    """``{"path": absolute path, "fingerprint": {file: sha256}, "stat": {file: key}}`` of a base:
    a run folder resolves to its newest checkpoint, whose path is recorded. Each weight file is
    named by the SHA-256 of its whole content: a checkpoint's from its manifest; a file without
    one (an export, Open-Sora or Wan weights) hashed here, with its ``stat`` key (inode, size,
    mtime and ctime in ns) beside it. ``known``, a record made earlier, saves work: a file whose
    stat key and path are the recorded ones is not read again (ctime cannot be set back, so no
    write since can leave the key as it was), and a file recorded in the old sampled kind
    (``size:sha256`` of its first and last 4 MiB) is fingerprinted that way, to compare."""
    known = known or {}
    if (spec := released_spec(source)) is not None:
        path = Path(source).resolve()
        files = spec.released_files(path)
        named = {(f.name if f == path else str(f.relative_to(path))): (f, None) for f in files}
    elif (folders := expert_model_folders(source)) is not None:   # each expert's weights
        path = Path(source).resolve()
        named = {str(f.resolve().relative_to(path)): (f.resolve(), None) for f in
                 (folder / "model.safetensors" for folder in folders[1])}
    else:
        ckpt = LoadedCheckpoint(source)
        path = ckpt.path.resolve()
        named = {name: (path / name, info.get("sha256")) for name, info in sorted(ckpt.manifest["files"].items())
                 if name in ("model.safetensors", "ema.safetensors")}
    same_place = known.get("path") == str(path)
    record = {"path": str(path), "fingerprint": {}, "stat": {}}
    for name, (file, manifest_sha) in named.items():
        before = (known.get("fingerprint") or {}).get(name)
        if isinstance(before, str) and _SAMPLED_KIND.fullmatch(before):   # an old record: compare its way
            record["fingerprint"][name] = _sampled(file)
        elif manifest_sha:
            record["fingerprint"][name] = manifest_sha
        else:
            cached = (before, (known.get("stat") or {}).get(name)) if same_place else None
            record["fingerprint"][name], key = _whole(file, cached)
            if key is not None:
                record["stat"][name] = key
    if not record["stat"]:
        del record["stat"]
    return record


# The old kind of fingerprint (before whole-file hashes): "size:sha256 of the first and last 4 MiB".
_SAMPLED_KIND = re.compile(r"\d+:[0-9a-f]{64}")
_SAMPLE = 4 << 20
# A file whose ctime is this close to the moment it was hashed is "racy" (a write in the same
# timestamp tick could leave its stat key unchanged): its key is not kept, so it is hashed again.
_RACY_NS = 3_000_000_000
# This process's whole-file hashes: (path, stat key) -> sha256 (run_base and check_base on resume).
_HASHED: dict[tuple, str] = {}


def _stat_key(file: Path) -> list[int]:
    st = os.stat(file)
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _whole(file: Path, cached: tuple | None = None) -> tuple[str, list[int] | None]:
    """The SHA-256 of ``file``'s whole content and its stat key (None: the file is racy or changed
    while it was read, and the key is not to be trusted later). ``cached``: a recorded
    ``(sha256, key)``, taken without reading the file when its key is still ``key``."""
    key = _stat_key(file)
    if cached and cached[1] == key and isinstance(cached[0], str) and re.fullmatch(r"[0-9a-f]{64}", cached[0]):
        return cached[0], key
    memo = (str(file), tuple(key))
    if memo in _HASHED:
        return _HASHED[memo], key
    digest = _sha256_file(file)
    if _stat_key(file) != key or time.time_ns() - key[3] < _RACY_NS:
        return digest, None
    _HASHED[memo] = digest
    return digest, key


def _sha256_file(file: Path) -> str:
    with _open_base_file(file) as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _open_base_file(file: Path):
    """A weight file of a LoRA base, opened for reading: a FIFO, socket or device in its place
    is refused in one line (a FIFO would block the hash forever)."""
    try:
        return open_user_file(file)
    except NotRegularFile as exc:
        raise UserError(f"LoRA base weights: {os_error_message(exc)}") from None


def _sampled(file: Path) -> str:
    """``size:sha256`` of a file's first and last 4 MiB: the old kind of fingerprint, kept to check
    runs recorded with it."""
    digest = hashlib.sha256()
    size = file.stat().st_size
    with _open_base_file(file) as handle:
        digest.update(handle.read(_SAMPLE))
        if size > _SAMPLE:
            handle.seek(max(_SAMPLE, size - _SAMPLE))
            digest.update(handle.read(_SAMPLE))
    return f"{size}:{digest.hexdigest()}"


def check_base(record: dict, source: str | Path | None = None) -> str:
    """The base path of ``record`` (or ``source``), checked against the recorded fingerprint: the
    SHA-256 of each weight file's whole content (a file unchanged since, by its stat key, is not
    read again). A record of the old sampled kind is compared that way, with a warning."""
    source = source or record.get("path")
    if not source:
        raise UserError("this LoRA run records no base weights (model.init_from); set model.init_from to them")
    recorded = record.get("fingerprint")
    if recorded:
        now = base_record(source, known=record)
        if now["fingerprint"] != recorded:
            raise UserError(f"the LoRA base {source} is not the one the adapters were trained on "
                            f"({record.get('path')}: its weight files differ); point model.init_from at those weights")
        old = sorted(name for name, value in recorded.items()
                     if isinstance(value, str) and _SAMPLED_KIND.fullmatch(value))
        if old:
            warn(f"the LoRA base {source} was recorded by an older videodit by the size and first and last 4 MiB of "
                 f"{', '.join(old)} only, and was checked that way; a resumed run records their whole SHA-256")
    return str(source)


def lora_config(loaded: LoadedCheckpoint) -> LoraConfig | None:
    """The LoRA settings of a checkpoint written by a LoRA run (None for any other checkpoint or
    an export, whose weights are whole)."""
    if loaded.is_export:
        return None
    cfg = _config(loaded)
    return cfg.lora if cfg.lora.rank else None


def _config(loaded: LoadedCheckpoint) -> Config:
    return from_yaml(loaded.config_yaml(), f"the config of {loaded.path}")


def adapted_model(loaded: LoadedCheckpoint, stem: str = "model", merge: bool = False) -> nn.Module:
    """The base weights a LoRA checkpoint's run started from, in fp32 on the CPU, with the
    checkpoint's adapters (``stem``: ``model`` or ``ema``) applied by peft, or merged into the
    weights (``merge``: a plain model with the base's parameter names)."""
    cfg = _config(loaded)
    source = check_base(loaded.json_state().get("lora_base") or {"path": cfg.model.init_from})
    adapters = loaded.tensors("model")
    if stem == "ema":
        adapters.update(loaded.tensors("ema"))
    return lora_model(cfg, source, adapters, merge=merge, what=f"checkpoint {loaded.path}")


def lora_model(cfg: Config, base: str | Path, adapters: dict[str, torch.Tensor], merge: bool = False,
               what: str = "the run") -> nn.Module:
    """``cfg``'s model with the weights of ``base`` and ``cfg.lora``'s adapters set to ``adapters``
    (fp32, CPU); ``merge``: folded into the weights."""
    weights, _ = init_weights(base)
    try:
        spec, one = get_spec(cfg.model.family), one_model_tensors(cfg, weights)
        geometry = model_geometry(cfg, latent_channels=spec.latent_channels(one),
                                  caption_channels=spec.caption_channels(one))
        model = model_of(cfg, geometry)
        model.load_state_dict({name: t.float() if t.is_floating_point() else t for name, t in weights.items()})
    except (KeyError, RuntimeError) as exc:
        raise UserError(f"the LoRA base {base} does not fit the model of {what} "
                        f"({' '.join(str(exc).split())[:160]}); set model.* as in that run") from None
    add_adapters(model, cfg.lora)
    own = {name for name in model.state_dict() if is_adapter_name(name)}
    if set(adapters) != own:
        odd = sorted(set(adapters) ^ own)
        raise UserError(f"{what}: its adapters do not match its lora.* settings (e.g. {odd[0]}); use a checkpoint "
                        "written by videodit")
    model.load_state_dict({name: t.float() for name, t in adapters.items()}, strict=False)
    return merge_adapters(model) if merge else model


def run_base(cfg: Config) -> dict:
    """A LoRA run's base, recorded (:func:`base_record`) from ``model.init_from``, which it needs."""
    if not cfg.model.init_from:
        raise UserError(f"lora.rank={cfg.lora.rank} trains adapters on frozen base weights: set model.init_from to "
                        "them (a checkpoint, a run folder, an export or released weights: Open-Sora STDiT3, Wan)")
    return base_record(cfg.model.init_from)


def merged_run_config(config_yaml: str) -> str:
    """A LoRA run's config for its merged export: ``lora.rank: 0`` (the weights are whole)."""
    raw = parse_yaml(config_yaml, "the run's config.yaml") or {}
    raw.setdefault("lora", {})["rank"] = 0
    return yaml.safe_dump(raw, sort_keys=False)


def merge_record(loaded: LoadedCheckpoint) -> dict:
    """What a merged export records: the LoRA settings and the base the adapters were merged into."""
    cfg = _config(loaded)
    base = (loaded.json_state().get("lora_base") or {}).get("path") or cfg.model.init_from
    return {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha if cfg.lora.alpha is not None else cfg.lora.rank,
            "targets": cfg.lora.targets, "base": base}
