"""``videodit ckpt import`` and ``videodit ckpt export --format FORMAT``: a family's released
weights (Open-Sora STDiT3, Wan) in and out of videodit, written atomically as model folders.

    import_released(src, out_dir, run_config, use_ema=False, dtype="fp32") -> Path
    export_released(ckpt, out_dir, fmt, use_ema=False, dtype="fp32") -> Path

The conversions are the family's (``ModelSpec.read_released`` / ``export_released``). Nothing
read is unpickled beyond tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from videodit.checkpoint.experts import expert_folders, experts_run, split_experts, write_experts
from videodit.checkpoint.io import EXPORT_RECORD, EXPORT_RUN_CONFIG, is_export_dir
from videodit.checkpoint.loaded import LoadedCheckpoint
from videodit.checkpoint.tools import (check_new_folder, checkpoint_weights, export_dtype, run_geometry,
                                      write_model_folder)
from videodit.config import from_yaml
from videodit.errors import UserError
from videodit.models.families import families, released_spec, spec_for_model_type, spec_of
from videodit.user_files import read_user_json

def import_released(src: str | Path, out_dir: str | Path, run_config: str, use_ema: bool = False,
                    dtype: str = "fp32") -> Path:
    """A videodit model folder from a family's released weights (an Open-Sora STDiT3 folder or
    training checkpoint, ``use_ema``: its ``ema.pt``; a Wan folder), laid out as ``videodit ckpt
    export`` writes one: ``config.json`` (the model), ``model.safetensors``, ``run_config.yaml``
    (``run_config``: the encoders and sampling defaults that ``videodit sample --ckpt`` uses) and
    ``export.json`` (where the weights came from). ``videodit.models.load_pretrained`` and
    ``model.init_from`` read the result too."""
    target = export_dtype(dtype)
    spec = released_spec(src)
    if spec is None:
        raise UserError(f"{src} holds no released weights videodit reads "
                        f"({', '.join(s.released_name for s in families().values())})")
    check_new_folder(out_dir)
    geometry, tensors = spec.read_released(Path(src), ema=use_ema)
    files = {"config.json": json.dumps(spec.geometry_config(geometry), indent=1) + "\n",
             EXPORT_RUN_CONFIG: run_config,
             EXPORT_RECORD: json.dumps({"step": 0, "source": str(Path(src).resolve()), "format": spec.released_format,
                                        "weights": "ema" if use_ema else "model", "dtype": dtype}, indent=1) + "\n"}
    return write_model_folder(out_dir, _cast(tensors, target), files, verb="import")


def export_released(ckpt: str | Path, out_dir: str | Path, fmt: str, use_ema: bool = False,
                    dtype: str = "fp32") -> Path:
    """A folder in released format ``fmt`` (``opensora``: what Open-Sora's ``STDiT3.from_pretrained``
    loads; Wan's ``wan`` and ``diffusers``) from a videodit checkpoint, export or model folder."""
    target = export_dtype(dtype)
    check_new_folder(out_dir)

    def write(folder: Path, geometry, tensors: dict) -> Path:
        spec = spec_of(geometry)
        if fmt not in spec.export_formats:
            raise UserError(f"--format {fmt} does not apply to a {spec.family} model; it exports as: "
                            f"{', '.join(('videodit',) + spec.export_formats)}")
        state, files, weights_name = spec.export_released(fmt, geometry, tensors)
        weights_name = weights_name.replace("{folder}", Path(folder).name)   # one file named after its folder
        return write_model_folder(folder, _cast(state, target), files, weights_name=weights_name)
    path = Path(ckpt)
    if not is_export_dir(path):
        loaded = LoadedCheckpoint(path)
        if experts_run(loaded.config_yaml()):   # both experts of one run: the release's two folders
            tensors, _ = checkpoint_weights(loaded, use_ema)
            family = from_yaml(loaded.config_yaml(), "the checkpoint's config.yaml").model.family
            return write_experts(out_dir, expert_folders(family, fmt), split_experts(tensors, loaded.config_yaml()),
                                 lambda folder, own, config: write(folder, run_geometry(config, own), own))
    return write(Path(out_dir), *_videodit_weights(path, use_ema))


def _videodit_weights(path: Path, use_ema: bool):
    """Geometry and tensors of a model folder (its config.json) or a checkpoint (its run config)."""
    if is_export_dir(path):
        try:
            config = read_user_json(path / "config.json")
        except (ValueError, UnicodeDecodeError):
            config = None   # LoadedCheckpoint names the problem
        spec = spec_for_model_type(config.get("model_type")) if isinstance(config, dict) else None
        if spec is not None:
            return spec.geometry_from_config(config), LoadedCheckpoint(path).tensors("model")
    loaded = LoadedCheckpoint(path)
    tensors, _ = checkpoint_weights(loaded, use_ema)
    return run_geometry(loaded.config_yaml(), tensors), tensors


def _cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
