"""What a training run needs around its loop: seeding, resume checks, run info (signals: stop.py)."""

from __future__ import annotations

import importlib.metadata
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from videodit.config import Config, from_yaml, to_dict
from videodit.errors import UserError


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# Keys that may change between a checkpoint and its resume without changing what is trained.
RESUMABLE_CHANGES = ("name", "resume", "train.max_steps", "train.log_every", "train.sample_every",
                     "train.loggers", "train.threads", "train.peak_tflops", "data.num_workers", "data.metadata_cache",
                     "checkpoint.", "validation.", "sample.", "parallel.")


def check_config_change(saved_yaml: str, cfg: Config) -> list[str]:
    """Say what changed since the checkpoint; refuse unless checkpoint.on_config_change=continue."""
    saved = _flatten(to_dict(from_yaml(saved_yaml, "the checkpoint's config.yaml")))
    now = _flatten(to_dict(cfg))
    changed = [f"{key}: {saved.get(key)!r} -> {now.get(key)!r}" for key in sorted(saved.keys() | now.keys())
               if saved.get(key) != now.get(key) and not key.startswith(RESUMABLE_CHANGES)]
    if changed and cfg.checkpoint.on_config_change == "error":
        shown = "; ".join(changed[:4]) + (f"; and {len(changed) - 4} more" if len(changed) > 4 else "")
        raise UserError(f"the config changed since the checkpoint ({shown}); restore it, or set "
                        "checkpoint.on_config_change=continue to resume anyway")
    for line in changed:
        print(f"config changed since the checkpoint: {line}", flush=True)
    return changed


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "bucket_config":
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def git_commit() -> str | None:
    """The commit of the videodit checkout that runs (None outside a git checkout)."""
    import videodit
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(videodit.__file__).parent,
                              capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_info(num_params: int) -> dict:
    """What produced this run: code version and library versions."""
    import videodit
    commit = git_commit()
    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "videodit": videodit.__version__,
                "numpy": np.__version__}
    for name in ("av", "safetensors", "diffusers", "transformers"):
        try:   # from the installed package's metadata: importing diffusers and transformers costs seconds
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"git_commit": commit, "versions": versions, "platform": platform.platform(),
            "num_params": num_params, "command": sys.argv, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def cuda_settings(device: torch.device) -> None:
    """GPU fast paths that need no option: TF32 tensor cores for fp32 matmuls (what bf16
    autocast leaves in fp32, and precision=fp32 runs), and no cuDNN autotuning, which would
    re-benchmark every new bucket shape (the patch-embedding Conv3d).

    These are torch's older TF32 switches, on purpose: torch 2.13 refuses to read the
    precision once the newer ``fp32_precision`` switches were mixed in, and inductor reads it
    (``get_float32_matmul_precision`` is part of its cache key)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = False
