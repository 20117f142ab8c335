"""Exports of a run that trained both experts of a two-expert model (``model.expert=both``,
Wan 2.2 A14B): one model folder per expert, laid out as the release lays its experts out
(Wan's ``high_noise_model/`` + ``low_noise_model/``, diffusers' ``transformer/`` +
``transformer_2/``; videodit's own format uses Wan's names).

Each expert's folder is what a one-expert run (``model.expert=high|low``) would export: its
run config says which expert it is and the timesteps it covers, and ``sample.cfg`` is its own
guidance, so ``videodit sample --ckpt OUT/high_noise_model --low-noise-ckpt OUT/low_noise_model``
pairs them again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import yaml

from videodit.checkpoint.staging import staged_folder
from videodit.config import from_yaml
from videodit.config.load import parse_yaml
from videodit.errors import UserError
from videodit.models.families import get_spec

EXPERTS = ("high", "low")


def experts_run(run_config: str) -> bool:
    return from_yaml(run_config, "the run's config.yaml").model.expert == "both"


def split_experts(tensors: dict[str, torch.Tensor], run_config: str) -> list[tuple[str, dict, str]]:
    """(expert, its tensors under one model's names, its one-expert run config), high first."""
    spec = get_spec(from_yaml(run_config, "the run's config.yaml").model.family)
    parts = []
    for expert, prefix in zip(EXPERTS, spec.expert_prefixes):
        own = {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}
        parts.append((expert, own, expert_run_config(run_config, expert)))
    return parts


def expert_run_config(run_config: str, expert: str) -> str:
    """The run config of one expert of a ``model.expert=both`` run: ``model.expert`` and its
    ``diffusion.timestep_range``, and its own guidance as ``sample.cfg``."""
    raw = parse_yaml(run_config, "the run's config.yaml") or {}
    cfg = from_yaml(run_config, "the run's config.yaml")
    boundary = cfg.model.expert_boundary
    low, high = cfg.sample.expert_cfg or (cfg.sample.cfg, cfg.sample.cfg)
    raw.setdefault("model", {})["expert"] = expert
    raw.setdefault("diffusion", {})["timestep_range"] = [boundary, 1.0] if expert == "high" else [0.0, boundary]
    sample = raw.setdefault("sample", {})
    sample["cfg"] = high if expert == "high" else low
    sample.pop("expert_cfg", None)
    return yaml.safe_dump(raw, sort_keys=False)


def write_experts(out_dir: str | Path, folders: tuple[str, str], parts: list[tuple[str, dict, str]],
                  write: Callable[[Path, dict, str], Path], verb: str = "export") -> Path:
    """``write(folder, tensors, run_config)`` for each expert into ``out_dir/<its folder>`` (a new
    or empty folder, checked by the caller), all in one staging folder renamed into place at the
    end: a failure (the second expert refused, a full disk) leaves nothing, so ``out_dir`` is as it
    was and the same command can run again."""
    with staged_folder(out_dir, verb) as staging:
        for folder, (_, tensors, run_config) in zip(folders, parts):
            write(staging / folder, tensors, run_config)
    return Path(out_dir)


def expert_folders(family: str, fmt: str) -> tuple[str, str]:
    """Where each expert goes in the ``fmt`` layout (videodit's own: Wan's names)."""
    spec = get_spec(family)
    folders = spec.expert_folders.get("wan" if fmt == "videodit" else fmt)
    if folders is None:
        raise UserError(f"the {family} family has no two-expert layout for --format {fmt}")
    return folders
