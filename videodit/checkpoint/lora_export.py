"""``videodit ckpt export RUN OUT --lora-format FORMAT``: a LoRA run's adapters alone, renamed for
the tool that loads them (``lora_formats.py``), written atomically into the new folder OUT. The
base is not read: the adapters are all a LoRA file holds.

    export_lora(ckpts, out_dir, fmt, use_ema=False, dtype="fp32") -> Path

``ckpts``: one run, or a two-expert pair (the high-noise run, then the low-noise one: Wan 2.2
A14B), whose files are named as ComfyUI's Wan 2.2 workflows name LoRA pairs (``..._high_noise``,
``..._low_noise``):

    format      one run                              two experts
    diffusers   pytorch_lora_weights.safetensors     pytorch_lora_weights_{high,low}_noise.safetensors
    comfyui     <OUT's name>.safetensors             <OUT's name>_{high,low}_noise.safetensors
    peft        adapter_config.json + adapter_model.safetensors, in high_noise_model/ and low_noise_model/

A distilled run's adapters (``distill.method`` with ``lora.rank``) come with ``SAMPLING.md``: its
few steps, sigmas and cfg 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from videodit.checkpoint.convert import student_sampling
from videodit.checkpoint.io import SAMPLING_NOTE, warn
from videodit.checkpoint.loaded import LoadedCheckpoint
from videodit.checkpoint.lora_formats import (Layers, adapter_layers, check_format, comfyui_lora, diffusers_lora,
                                              peft_lora)
from videodit.checkpoint.tools import check_new_folder, export_dtype, write_folder
from videodit.components import model_geometry
from videodit.config import Config, from_yaml
from videodit.errors import UserError
from videodit.models.families import get_spec
from videodit.models.lora import scale_numerator

EXPERTS = ("high_noise", "low_noise")
DIFFUSERS_WEIGHTS = "pytorch_lora_weights"   # diffusers' own name: load_lora_weights(OUT) finds it
PEFT_FOLDERS = {"high_noise": "high_noise_model", "low_noise": "low_noise_model"}   # Wan 2.2's release names


@dataclass
class Adapters:
    """One model's adapters (one run's, or one expert's): what every format is made from."""
    layers: Layers
    cfg: Config
    source: LoadedCheckpoint
    weights: str            # "ema" or "model"

    @property
    def alpha(self) -> float:
        return scale_numerator(self.cfg.lora)


def export_lora(ckpts: list[str | Path], out_dir: str | Path, fmt: str, use_ema: bool = False,
                dtype: str = "fp32") -> Path:
    """The adapters of ``ckpts`` (one LoRA run, or the high- and low-noise runs of two experts) in
    format ``fmt`` in the new folder ``out_dir``; nothing is written unless all of it can be."""
    target = export_dtype(dtype)
    out_dir = Path(out_dir)
    check_new_folder(out_dir)
    parts = [part for ckpt in ckpts for part in read_adapters(ckpt, fmt, use_ema)]
    if len(ckpts) == 2 and len(parts) != 2:
        raise UserError("--low-noise-ckpt pairs two one-expert LoRA runs; a run that trained both experts "
                        "exports both on its own: leave out --low-noise-ckpt")
    experts = EXPERTS if len(parts) == 2 else (None,)
    weights, files = {}, {}
    for part, expert in zip(parts, experts):
        part_weights, part_files = _format_files(fmt, part, out_dir.name, expert, target)
        weights.update(part_weights)
        files.update(part_files)
    note = student_sampling(parts[0].source.config_yaml())   # a distilled (shared-base DMD2) run's sampler
    if note is not None:
        files[SAMPLING_NOTE] = note
    return write_folder(out_dir, weights, files)


def read_adapters(ckpt: str | Path, fmt: str, use_ema: bool) -> list[Adapters]:
    """The adapters of a LoRA run's checkpoint (a run folder: its newest), checked against the
    format; two parts (high, low) for a run that trained both experts of a two-expert model."""
    loaded = LoadedCheckpoint(ckpt)
    cfg = from_yaml(loaded.config_yaml(), f"the config of {loaded.path}")
    if cfg.lora.rank < 1:
        raise UserError(f"{loaded.path} is not a LoRA run (its lora.rank is 0): --lora-format writes a LoRA run's "
                        "adapters; export this whole model with --format instead")
    spec = get_spec(cfg.model.family)
    check_format(fmt, spec.family, spec.lora_formats)
    weights = "ema" if use_ema and loaded.has("ema") else "model"
    if use_ema and weights == "model":
        warn(f"{loaded.path} has no EMA weights; exporting the model's adapters")
    adapters = loaded.tensors("model")   # every read checks the file against the manifest
    if adapters and not any(".lora_" in name for name in adapters):   # e.g. an import that records a LoRA recipe
        raise UserError(f"{loaded.path} holds a whole model, not a LoRA run's adapters: --lora-format writes a LoRA "
                        "run's adapters; export this model with --format instead")
    if weights == "ema":
        adapters.update(loaded.tensors("ema"))
    prefixes = getattr(spec, "expert_prefixes", ())   # a run of both experts names its adapters by expert
    if prefixes and adapters and all(name.startswith(prefixes) for name in adapters):
        split = [{name.removeprefix(p): t for name, t in adapters.items() if name.startswith(p)} for p in prefixes]
        return [Adapters(adapter_layers(own, str(loaded.path)), cfg, loaded, weights) for own in split]
    return [Adapters(adapter_layers(adapters, str(loaded.path)), cfg, loaded, weights)]


def _format_files(fmt: str, part: Adapters, out_name: str, expert: str | None, dtype: torch.dtype):
    """({file: (tensors, metadata)}, {file: text}) of one model's adapters in ``fmt``."""
    spec = get_spec(part.cfg.model.family)
    rename = lambda module: spec.lora_module_name(fmt, module)   # noqa: E731
    suffix = f"_{expert}" if expert else ""
    record = {"format": "pt", "videodit_lora": json.dumps(_record(part, fmt))}
    if fmt == "diffusers":
        tensors, metadata = diffusers_lora(part.layers, part.alpha, rename, dtype)
        return {f"{DIFFUSERS_WEIGHTS}{suffix}.safetensors": (tensors, {**record, **metadata})}, {}
    if fmt == "comfyui":
        keys = getattr(spec, "comfyui_lora_keys", "lora_down")   # LTX-2: LTX's own lora_A/lora_B keys
        return {f"{out_name}{suffix}.safetensors": (comfyui_lora(part.layers, part.alpha, dtype, keys), record)}, {}
    folder = f"{PEFT_FOLDERS[expert]}/" if expert else ""
    tensors, config = peft_lora(part.layers, part.alpha, part.cfg.lora.dropout, _base(part), _model_class(part.cfg),
                                dtype)
    return {f"{folder}adapter_model.safetensors": (tensors, {"format": "pt"})}, {f"{folder}adapter_config.json": config}


def _base(part: Adapters) -> str | None:
    """The base the adapters were trained on, as the run recorded it."""
    return (part.source.json_state().get("lora_base") or {}).get("path") or part.cfg.model.init_from


def _record(part: Adapters, fmt: str) -> dict:
    """What a LoRA file says about where it came from (safetensors metadata, ignored by loaders)."""
    return {"rank": part.cfg.lora.rank, "alpha": part.alpha, "targets": part.cfg.lora.targets, "format": fmt,
            "step": part.source.step, "weights": part.weights, "source": str(part.source.path.resolve()),
            "base": _base(part)}


def _model_class(cfg: Config) -> type:
    """The class of the run's model, for peft's ``auto_mapping`` (built on the meta device, at the
    released encoders' widths: the class is all that is read)."""
    spec = get_spec(cfg.model.family)
    latent, caption, _ = spec.released_encoders_of(cfg.model)
    with torch.device("meta"):
        return type(spec.build(model_geometry(cfg, latent, caption)))
