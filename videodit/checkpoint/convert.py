"""``videodit ckpt import`` and ``videodit ckpt export --format FORMAT``: a family's released
weights (Open-Sora STDiT3, Wan, Open-Sora 2.0, LTX-2) in and out of videodit, written atomically as
model folders (a two-expert model: one folder per expert, in one staging folder).

    import_released(src, out_dir, run_config, use_ema=False, dtype="fp32") -> Path
      = write_imported(read_released(src, use_ema, like), out_dir, run_config, ...)
    export_released(ckpt, out_dir, fmt, use_ema=False, dtype="fp32") -> Path
    export_released_pair((high, low), out_dir, fmt, folders, ...) -> Path

The conversions are the family's (``ModelSpec.read_released_like`` / ``export_released``); every
value read is checked before anything is written, and a refusal leaves nothing. Nothing read is
unpickled beyond tensors.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from videodit.checkpoint.experts import (EXPERTS, expert_folders, expert_run_config, experts_run, split_experts,
                                         write_experts)
from videodit.checkpoint.io import EXPORT_RECORD, EXPORT_RUN_CONFIG, SAMPLING_NOTE, is_export_dir
from videodit.checkpoint.loaded import LoadedCheckpoint
from videodit.checkpoint.tools import (check_new_folder, checkpoint_weights, export_dtype, run_geometry,
                                      staged_folder, write_folder, write_model_folder)
from videodit.config import ModelConfig, from_yaml
from videodit.distill.schedule import StudentSchedule
from videodit.errors import UserError
from videodit.models.families import families, released_spec, spec_for_model_type, spec_of
from videodit.models.pretrained import check_fits, folder_geometry
from videodit.models.spec import ModelSpec
from videodit.user_files import read_user_json


@dataclass
class Released:
    """Released weights read for an import: one model, or the two experts of a two-expert model
    (``parts``: (expert or None, where it was read, its tensors), high first)."""
    spec: ModelSpec
    src: Path
    geometry: Any
    parts: list[tuple[str | None, Path, Mapping[str, torch.Tensor]]]

    @property
    def experts(self) -> bool:
        return self.parts[0][0] is not None


def read_released(src: str | Path, use_ema: bool = False, like: dict | None = None) -> Released:
    """The released weights at ``src`` (lazily where the family reads lazily), checked: ``like``
    (a run's model.*) gives what the files cannot say (the MMDiT's RoPE split)."""
    src = Path(src)
    spec = released_spec(src)
    if spec is None:
        raise UserError(f"{src} holds no released weights videodit reads "
                        f"({', '.join(s.released_name for s in families().values())})")
    if spec.expert_source(src, "high") is None:
        geometry, tensors = spec.read_released_like(src, ema=use_ema, like=like)
        return Released(spec, src, geometry, [(None, src, tensors)])
    if use_ema:
        raise UserError(f"{src} holds two experts' released weights, which have no EMA; leave out --ema")
    parts, geometries = [], []
    for expert in EXPERTS:
        folder = spec.expert_source(src, expert)
        geometry, tensors = spec.read_released_like(folder, like=like)
        geometries.append(geometry)
        parts.append((expert, folder, tensors))
    if geometries[0] != geometries[1]:
        raise UserError(f"the two experts in {src} have different sizes (their config.json files differ); restore "
                        "the download")
    return Released(spec, src, geometries[0], parts)


def import_released(src: str | Path, out_dir: str | Path, run_config: str, use_ema: bool = False,
                    dtype: str = "fp32") -> Path:
    """A videodit model folder from a family's released weights (an Open-Sora STDiT3 folder or
    training checkpoint, ``use_ema``: its ``ema.pt``; a Wan folder), laid out as ``videodit ckpt
    export`` writes one: ``config.json`` (the model), ``model.safetensors``, ``run_config.yaml``
    (``run_config``: the encoders and sampling defaults that ``videodit sample --ckpt`` uses) and
    ``export.json`` (where the weights came from). ``videodit.models.load_pretrained`` and
    ``model.init_from`` read the result too. A two-expert model (Wan 2.2 A14B) becomes the folder a
    ``model.expert=both`` run exports: one such folder per expert (Wan's names), each with its
    expert's run config."""
    export_dtype(dtype)
    check_new_folder(out_dir, "import")
    like = import_hints(from_yaml(run_config, "the import's config").model)
    return write_imported(read_released(src, use_ema, like), out_dir, run_config, use_ema, dtype)


def import_hints(model_cfg) -> dict:
    """What an import's config says of the weights that their files cannot (an Open-Sora 2.0 file's
    RoPE split: model.axes_dim): the model.* values given apart from the preset's (a preset's own
    values describe the preset's model, not the weights)."""
    preset = dataclasses.asdict(ModelConfig(preset=model_cfg.preset).resolved())
    return {k: v for k, v in dataclasses.asdict(model_cfg).items() if v is not None and v != preset.get(k)}


def write_imported(released: Released, out_dir: str | Path, run_config: str, use_ema: bool = False,
                   dtype: str = "fp32") -> Path:
    """Write what :func:`read_released` read as a model folder (two for two experts), atomically."""
    target = export_dtype(dtype)
    spec = released.spec
    check_new_folder(out_dir, "import")

    def files(source: Path, config: str, expert: str | None) -> dict[str, str]:
        record = {"step": 0, "source": str(source.resolve()), "format": spec.released_format,
                  "weights": "ema" if use_ema else "model", "dtype": dtype, **({"expert": expert} if expert else {})}
        return {"config.json": json.dumps(spec.geometry_config(released.geometry), indent=1) + "\n",
                EXPORT_RUN_CONFIG: config, EXPORT_RECORD: json.dumps(record, indent=1) + "\n"}
    if not released.experts:
        _, source, tensors = released.parts[0]
        return write_model_folder(out_dir, _cast(tensors, target), files(source, run_config, None), verb="import")
    if from_yaml(run_config, "the import's config").model.expert_boundary is None:
        raise UserError(f"{released.src} holds two experts, and each one's run config needs the timestep where they "
                        "switch: add model.expert_boundary=B (Wan 2.2 T2V-A14B: 0.875, I2V-A14B: 0.9)")
    folders = expert_folders(spec.family, "videodit")
    with staged_folder(out_dir, "import") as staging:
        for folder, (expert, source, tensors) in zip(folders, released.parts):
            config = expert_run_config(run_config, expert)
            write_model_folder(staging / folder, _cast(tensors, target), files(source, config, expert), verb="import")
    return Path(out_dir)


def export_released(ckpt: str | Path, out_dir: str | Path, fmt: str, use_ema: bool = False,
                    dtype: str = "fp32") -> Path:
    """A folder in released format ``fmt`` (``opensora``: what Open-Sora's ``STDiT3.from_pretrained``
    loads; Wan's ``wan``, ``diffusers`` and ``comfyui``; LTX-2's ``ltx2``, ``comfyui`` and ``diffusers``)
    from a videodit checkpoint, export or model folder. The weights file carries the family's
    safetensors metadata (``ModelSpec.export_metadata``: LTX-2's release config)."""
    target = export_dtype(dtype)
    check_new_folder(out_dir)
    return _export_released(ckpt, out_dir, fmt, use_ema, target)


def export_released_pair(ckpts: tuple[str | Path, str | Path], out_dir: str | Path, fmt: str,
                         folders: tuple[str, str], use_ema: bool = False, dtype: str = "fp32") -> Path:
    """Two expert runs (high, low) in ``fmt``, into ``out_dir/<folder>`` each, in one staging folder:
    a refusal of either leaves nothing."""
    target = export_dtype(dtype)
    check_new_folder(out_dir)
    with staged_folder(out_dir) as staging:
        for ckpt, folder in zip(ckpts, folders):
            _export_released(ckpt, staging / folder, fmt, use_ema, target)
    return Path(out_dir)


def _export_released(ckpt: str | Path, out_dir: str | Path, fmt: str, use_ema: bool, target: torch.dtype) -> Path:
    path = Path(ckpt)
    note = None if is_export_dir(path) else student_sampling(LoadedCheckpoint(path).config_yaml())

    def write(folder: Path, geometry, tensors: dict) -> Path:
        spec = spec_of(geometry)
        if fmt not in spec.export_formats:
            raise UserError(f"--format {fmt} does not apply to a {spec.family} model; it exports as: "
                            f"{', '.join(('videodit',) + spec.export_formats)}")
        state, files, weights_name = spec.export_released(fmt, geometry, tensors)
        if note is not None:   # a released format carries no run config: the student's sampler beside it
            files = {**files, SAMPLING_NOTE: note}
        weights_name = weights_name.replace("{folder}", Path(folder).name)   # one file named after its folder
        metadata = spec.export_metadata(fmt, geometry)   # LTX-2's release format: its config travels here
        return write_folder(folder, {weights_name: (_cast(state, target), metadata)}, files)
    if not is_export_dir(path):
        loaded = LoadedCheckpoint(path)
        if experts_run(loaded.config_yaml()):   # both experts of one run: the release's two folders
            tensors, _ = checkpoint_weights(loaded, use_ema)
            family = from_yaml(loaded.config_yaml(), "the checkpoint's config.yaml").model.family
            return write_experts(out_dir, expert_folders(family, fmt), split_experts(tensors, loaded.config_yaml()),
                                 lambda folder, own, config: write(folder, run_geometry(config, own), own))
    return write(Path(out_dir), *_videodit_weights(path, use_ema))


def student_sampling(config_yaml: str) -> str | None:
    """``SAMPLING.md`` of a distilled run's export (None for other runs): its few steps, unguided."""
    schedule = StudentSchedule.of(from_yaml(config_yaml, "the checkpoint's config.yaml"))
    if schedule is None:
        return None
    return (f"# Sampling this model\n\nA few-step student distilled by videodit (distill.method). Sample it as "
            f"it was trained: {schedule.describe()}.\n")


def _videodit_weights(path: Path, use_ema: bool):
    """Geometry and tensors of a model folder (its config.json) or a checkpoint (its run config)."""
    if is_export_dir(path):
        try:
            config = read_user_json(path / "config.json")
        except (ValueError, UnicodeDecodeError):
            config = None   # LoadedCheckpoint names the problem
        spec = spec_for_model_type(config.get("model_type")) if isinstance(config, dict) else None
        if spec is not None:   # checked as the schema checks its own, then against the weights
            geometry = folder_geometry(path)[1]
            loaded = LoadedCheckpoint(path)
            check_fits(spec, geometry, loaded.tensor_shapes("model"), path)   # from the header, before reading
            return geometry, loaded.tensors("model")
    loaded = LoadedCheckpoint(path)
    tensors, _ = checkpoint_weights(loaded, use_ema)
    return run_geometry(loaded.config_yaml(), tensors), tensors


def _cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
