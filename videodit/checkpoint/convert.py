"""``videodit ckpt import`` and ``videodit ckpt export --format opensora``: Open-Sora STDiT3
weights in and out of videodit, written atomically as model folders.

    import_opensora(src, out_dir, run_config, use_ema=False, dtype="fp32") -> Path
    export_opensora(ckpt, out_dir, use_ema=False, dtype="fp32") -> Path

The conversion itself is ``videodit.models.opensora_stdit``; reading Open-Sora's layouts is
``videodit.models.opensora_files``. Nothing read is unpickled beyond tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from videodit.checkpoint.io import EXPORT_RECORD, EXPORT_RUN_CONFIG, is_export_dir
from videodit.checkpoint.loaded import LoadedCheckpoint
from videodit.checkpoint.tools import (check_new_folder, checkpoint_weights, export_dtype, run_geometry,
                                      write_model_folder)
from videodit.models.opensora_files import opensora_state
from videodit.models.opensora_stdit import opensora_config, to_opensora
from videodit.models.stdit import MODEL_TYPE, DiTGeometry, geometry_config, geometry_from_config

def import_opensora(src: str | Path, out_dir: str | Path, run_config: str, use_ema: bool = False,
                    dtype: str = "fp32") -> Path:
    """A videodit model folder from an Open-Sora STDiT3 folder or training checkpoint (``use_ema``:
    its ``ema.pt``), laid out as ``videodit ckpt export`` writes one: ``config.json`` (the model),
    ``model.safetensors``, ``run_config.yaml`` (``run_config``: the encoders and sampling defaults
    that ``videodit sample --ckpt`` uses) and ``export.json`` (where the weights came from).
    ``videodit.models.load_pretrained`` and ``model.init_from`` read the result too."""
    target = export_dtype(dtype)
    check_new_folder(out_dir)
    geometry, tensors = opensora_state(src, ema=use_ema)
    files = {"config.json": json.dumps(geometry_config(geometry), indent=1) + "\n",
             EXPORT_RUN_CONFIG: run_config,
             EXPORT_RECORD: json.dumps({"step": 0, "source": str(Path(src).resolve()), "format": "opensora-stdit3",
                                        "weights": "ema" if use_ema else "model", "dtype": dtype}, indent=1) + "\n"}
    return write_model_folder(out_dir, _cast(tensors, target), files, verb="import")


def export_opensora(ckpt: str | Path, out_dir: str | Path, use_ema: bool = False, dtype: str = "fp32") -> Path:
    """An Open-Sora STDiT3 folder (``config.json`` + ``model.safetensors``, as ``STDiT3.save_pretrained``
    writes them) from a videodit checkpoint, export or model folder. Only models whose function
    STDiT3 computes convert (``position_embedding=opensora``, ``null_caption_mask=prompt``, ...)."""
    target = export_dtype(dtype)
    check_new_folder(out_dir)
    geometry, tensors = _videodit_weights(Path(ckpt), use_ema)
    state = to_opensora(tensors, geometry)
    files = {"config.json": json.dumps(opensora_config(geometry), indent=2) + "\n"}
    return write_model_folder(out_dir, _cast(state, target), files)


def _videodit_weights(path: Path, use_ema: bool) -> tuple[DiTGeometry, dict[str, torch.Tensor]]:
    """Geometry and tensors of a model folder (its config.json) or a checkpoint (its run config)."""
    if is_export_dir(path):
        try:
            config = json.loads((path / "config.json").read_text())
        except (ValueError, UnicodeDecodeError):
            config = None   # LoadedCheckpoint names the problem
        if isinstance(config, dict) and config.get("model_type") == MODEL_TYPE:
            return geometry_from_config(config), LoadedCheckpoint(path).tensors("model")
    loaded = LoadedCheckpoint(path)
    tensors, _ = checkpoint_weights(loaded, use_ema)
    return run_geometry(loaded.config_yaml(), tensors), tensors


def _cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
