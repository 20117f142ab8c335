"""Checkpoint files: writing, verifying, loading and retaining them (``io.py``, the manager),
and the ``videodit ckpt`` tools (list, inspect, export). It knows files, not training: what a
training checkpoint holds is ``train/state.py``'s business."""

from videodit.checkpoint.io import (CheckpointManager, LoadedCheckpoint, checkpoint_name, list_checkpoints,
                                    resolve_checkpoint)
from videodit.checkpoint.tools import export, format_inspect, format_list, inspect, list_run

__all__ = ["CheckpointManager", "LoadedCheckpoint", "checkpoint_name", "export", "format_inspect", "format_list",
           "inspect", "list_checkpoints", "list_run", "resolve_checkpoint"]
