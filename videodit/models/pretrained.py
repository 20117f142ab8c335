"""``load_pretrained``: a model from any folder videodit reads weights from.

A videodit model folder (``STDiT.save_pretrained``, ``videodit ckpt export`` or ``ckpt import``:
``config.json`` with ``model_type: videodit-stdit`` + ``model.safetensors``), or any Open-Sora
STDiT3 layout (``opensora_files.py``: the Hugging Face folder or a training checkpoint), converted
on the fly. Nothing from the folder is executed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from videodit.errors import UserError
from videodit.models.opensora_files import load_opensora, opensora_layout
from videodit.models.stdit import CONFIG_NAME, MODEL_TYPE, WEIGHTS_NAME, STDiT, load_model_folder


def load_pretrained(path: str | Path, device: str | torch.device = "cpu", ema: bool = False) -> STDiT:
    """The STDiT at ``path`` in fp32. ``ema``: an Open-Sora training checkpoint's EMA weights."""
    path = Path(path)
    if opensora_layout(path):
        return load_opensora(path, ema=ema, device=device)
    config = path / CONFIG_NAME
    if not config.is_file() or not (path / WEIGHTS_NAME).is_file():
        raise UserError(f"{path} is not a model folder: pass a videodit one ({CONFIG_NAME} + {WEIGHTS_NAME}, as "
                        "videodit ckpt export writes it), an Open-Sora STDiT3 folder or an Open-Sora training "
                        "checkpoint")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (ValueError, UnicodeDecodeError, AttributeError):
        model_type = None
    if model_type not in (MODEL_TYPE, None):
        raise UserError(f"{config} describes a {model_type!r} model; videodit loads its own model folders "
                        f"({MODEL_TYPE!r}) and Open-Sora STDiT3 ones")
    return load_model_folder(path, device)
