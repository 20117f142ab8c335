"""LoRA checkpoints: a run's adapters, on the base weights it started from.

A LoRA run (``lora.rank > 0``) starts from ``model.init_from`` (the *base*), which it never
changes and never saves: its checkpoints hold the adapters (``model.safetensors``; their EMA in
``ema.safetensors``) and the adapters' optimizer state. ``state.json`` records the base as
``lora_base``: its absolute path and a fingerprint of its weight files (the SHA-256s of a
checkpoint's manifest, else the files' sizes), so a base that changed since is refused instead
of silently getting adapters trained on other weights.

    init_weights(source) -> (weights, taken)   what model.init_from takes from any source
    base_record(source) -> dict                what a LoRA run records about its base
    lora_config(loaded) -> LoraConfig | None   a LoRA checkpoint's settings (None: not one)
    adapted_model(loaded, stem, merge) -> model   the base with the checkpoint's adapters
    lora_model(cfg, base, adapters, merge) -> model   the same from a config and tensors
    run_base(cfg) -> dict                      a starting LoRA run's base record
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import yaml
from torch import nn

from videodit.checkpoint.loaded import LoadedCheckpoint
from videodit.components import model_geometry
from videodit.config import Config, LoraConfig, from_yaml
from videodit.errors import UserError
from videodit.models.lora import add_adapters, is_adapter_name, merge_adapters
from videodit.models.families import get_spec, released_spec

# Files that hold weights in a released folder (fingerprinted by base_record).
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


def init_weights(source: str | Path) -> tuple[dict[str, torch.Tensor], str]:
    """The weights ``model.init_from=source`` takes, and a description of them: Open-Sora STDiT3
    weights converted; a LoRA checkpoint's adapters (their EMA if any) merged into its base; a
    checkpoint's EMA weights if it has them (its model weights for the buffers), else its model
    weights; an export's weights."""
    spec = released_spec(source)
    if spec is not None:
        return spec.read_released(Path(source))[1], f"{spec.released_short} weights of {source}"
    ckpt = LoadedCheckpoint(source)
    stem = "ema" if ckpt.has("ema") else "model"
    if lora_config(ckpt) is not None:
        weights = adapted_model(ckpt, stem, merge=True).state_dict()
        return weights, f"{stem} adapters of {ckpt.path} (step {ckpt.step}) merged into their base"
    weights = ckpt.tensors(stem)
    if stem == "ema":   # the EMA covers the parameters; buffers come from the model weights
        weights = {**ckpt.tensors("model"), **weights}
    return weights, f"{stem} weights of {ckpt.path} (step {ckpt.step})"


def base_record(source: str | Path) -> dict:
    """``{"path": absolute path, "fingerprint": {file: digest}}`` of a base: a run folder resolves
    to its newest checkpoint, whose path is recorded. A checkpoint's weight files are named by
    the SHA-256 of its manifest; files without one (exports, Open-Sora folders) by their size and
    a SHA-256 of their first and last 4 MiB (cheap on many-GB files)."""
    if released_spec(source) is not None:
        path = Path(source).resolve()
        files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.suffix in WEIGHT_SUFFIXES)
        return {"path": str(path), "fingerprint": {(f.name if f == path else str(f.relative_to(path))): _sampled(f)
                                                   for f in files}}
    ckpt = LoadedCheckpoint(source)
    names = ("model.safetensors", "ema.safetensors")
    return {"path": str(ckpt.path.resolve()),
            "fingerprint": {name: info.get("sha256") or _sampled(ckpt.path / name)
                            for name, info in sorted(ckpt.manifest["files"].items()) if name in names}}


_SAMPLE = 4 << 20


def _sampled(file: Path) -> str:
    """``size:sha256`` of a file's first and last 4 MiB."""
    digest = hashlib.sha256()
    size = file.stat().st_size
    with open(file, "rb") as handle:
        digest.update(handle.read(_SAMPLE))
        if size > _SAMPLE:
            handle.seek(max(_SAMPLE, size - _SAMPLE))
            digest.update(handle.read(_SAMPLE))
    return f"{size}:{digest.hexdigest()}"


def check_base(record: dict, source: str | Path | None = None) -> str:
    """The base path of ``record`` (or ``source``), checked against the recorded fingerprint."""
    source = source or record.get("path")
    if not source:
        raise UserError("this LoRA run records no base weights (model.init_from); set model.init_from to them")
    now = base_record(source)
    if record.get("fingerprint") and now["fingerprint"] != record["fingerprint"]:
        raise UserError(f"the LoRA base {source} is not the one the adapters were trained on ({record.get('path')}: "
                        "its weight files differ); point model.init_from at those weights")
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
        spec = get_spec(cfg.model.family)
        geometry = model_geometry(cfg, latent_channels=spec.latent_channels(weights),
                                  caption_channels=spec.caption_channels(weights))
        model = spec.build(geometry)
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
    raw = yaml.safe_load(config_yaml) or {}
    raw.setdefault("lora", {})["rank"] = 0
    return yaml.safe_dump(raw, sort_keys=False)


def merge_record(loaded: LoadedCheckpoint) -> dict:
    """What a merged export records: the LoRA settings and the base the adapters were merged into."""
    cfg = _config(loaded)
    base = (loaded.json_state().get("lora_base") or {}).get("path") or cfg.model.init_from
    return {"rank": cfg.lora.rank, "alpha": cfg.lora.alpha if cfg.lora.alpha is not None else cfg.lora.rank,
            "targets": cfg.lora.targets, "base": base}
