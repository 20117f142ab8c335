"""Checkpoint files: writing, verifying, loading and retaining them, and the ``videodit ckpt``
tools (list, inspect, export). It knows files, not training: what a training checkpoint holds
is ``train/state.py``'s business.

Modules, each importing only the ones above it:

    writer.py   checked, hashed, fsynced file writes; the safetensors encoder
    io.py       the folder format: names, write/save, manifests, checked reads, verification
    loaded.py   LoadedCheckpoint: reading a checkpoint or an export folder, every file checked
    manager.py  CheckpointManager: when to save, retention, event log, async saves
    staging.py  a new folder written whole or not at all (exports, imports)
    tools.py    ckpt list / inspect / export; where outputs may not go (folders videodit deletes in)
    convert.py  ckpt import / export --format FORMAT (a family's released weights)
    lora_formats.py, lora_export.py   ckpt export --lora-format: a LoRA run's adapters for diffusers, ComfyUI, peft
"""

from videodit.checkpoint.convert import export_released, import_released
from videodit.checkpoint.io import (checkpoint_name, damaged_files, list_checkpoints, resolve_checkpoint,
                                    save_checkpoint, verify_checkpoint, write_checkpoint)
from videodit.checkpoint.loaded import LoadedCheckpoint
from videodit.checkpoint.manager import CheckpointManager
from videodit.checkpoint.tools import export, format_inspect, format_list, inspect, list_run
from videodit.checkpoint.writer import write_safetensors

__all__ = ["CheckpointManager", "LoadedCheckpoint", "checkpoint_name", "damaged_files", "export", "export_released",
           "format_inspect", "format_list", "import_released", "inspect", "list_checkpoints", "list_run",
           "resolve_checkpoint", "save_checkpoint", "verify_checkpoint", "write_checkpoint", "write_safetensors"]
