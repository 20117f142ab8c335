"""What ``videodit ckpt list|inspect|export`` does: read-only views of a run's checkpoints and
an atomic export of the weights for sampling or sharing.

    list_run(run_dir) -> rows          format_list(rows) -> str
    inspect(ckpt) -> dict              format_inspect(info) -> str
    export(ckpt, out_dir, use_ema=False, dtype="fp32") -> Path   (Open-Sora's format: convert.py)

None of these unpickles anything: tensors are read from safetensors headers (parsed by
``loaded.py``) or files, and the optimizer state is never loaded. ``list`` and ``inspect`` read every file of a checkpoint
to check it against its manifest (size and SHA-256) and show the damaged ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import yaml

from videodit.config.load import parse_yaml
from videodit.checkpoint.io import (CHECKPOINT_RE, DELETING_PREFIX, EXPORT_RECORD, EXPORT_RUN_CONFIG, STAGING_PREFIX,
                                    damaged_files, list_checkpoints, read_manifest, warn)
from videodit.checkpoint.loaded import LoadedCheckpoint
from videodit.checkpoint.lora import adapted_model, lora_config, merge_record, merged_run_config
from videodit.checkpoint.manager import best_checkpoints, read_events
from videodit.checkpoint.staging import STAGING_OWNER, check_empty, remove_stale_staging, staged_folder  # noqa: F401
from videodit.checkpoint.writer import write_safetensors
from videodit.components import model_geometry, one_model_tensors
from videodit.config import from_yaml
from videodit.errors import UserError
from videodit.user_files import read_user_json
from videodit.models.families import get_spec, spec_of

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _human(size: int | None) -> str:
    if size is None:
        return "?"
    value = float(size)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1024 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# ---------------------------------------------------------------------------- list


def list_run(run_dir: str | Path, metric: str | None = None, mode: str | None = None,
             checksums: bool = True) -> list[dict]:
    """One row per complete checkpoint of a run folder, oldest first.

    Row: ``step, name, path, time, metrics, bytes, marks, damaged`` where marks may hold
    ``best`` (the best by the run's retention metric; the ``keep_best`` best when that is set),
    ``resumed`` (a run resumed from it, per ``checkpoints.jsonl``) and ``damaged`` (the
    manifest is malformed, or a file is missing, not a regular file, or differs from its size
    or SHA-256 in the manifest; ``damaged`` maps each such file to its problem). Every file is
    read to check its SHA-256 (``checksums=False``: types and sizes only). ``metric``/``mode``
    default to the settings the run logged, else ``val_loss``/``min``.
    """
    run_dir = Path(run_dir)
    root = run_dir / "checkpoints"
    if not root.is_dir():
        if list_checkpoints(run_dir):   # given the checkpoints/ folder itself
            root, run_dir = run_dir, run_dir.parent
        else:
            raise UserError(f"{str(run_dir)!r} has no checkpoints/ folder; pass a run folder written by "
                            "`videodit train`")
    events = read_events(run_dir)
    retention = next((e["retention"] for e in reversed(events)
                      if e.get("event") == "save" and isinstance(e.get("retention"), dict)), {})
    metric = metric or retention.get("metric") or "val_loss"
    mode = mode or retention.get("mode") or "min"
    try:
        keep_best = max(int(retention.get("keep_best") or 0), 1)
    except (TypeError, ValueError):
        keep_best = 1

    resumed = set()
    for event in events:
        if event.get("event") == "resume" and isinstance(event.get("path"), str):
            path = Path(event["path"])
            resumed.add((path if path.is_absolute() else run_dir / path).resolve())

    rows = []
    for path in list_checkpoints(root):
        manifest = read_manifest(path) or {}
        damaged = damaged_files(path, checksums=checksums)
        files = manifest.get("files") or {}
        marks = ["damaged"] if damaged else []
        if path.resolve() in resumed:
            marks.append("resumed")
        step = manifest.get("step")
        metrics = manifest.get("metrics") if isinstance(manifest.get("metrics"), dict) else {}
        saved = manifest.get("saved_at")
        rows.append({"step": step if isinstance(step, int) else int(path.name.split("-")[1]), "name": path.name,
                     "path": str(path), "time": str(saved) if saved is not None else None, "metrics": metrics,
                     "bytes": sum(info["bytes"] for info in files.values()) if manifest else None,
                     "marks": marks, "damaged": damaged})
    best = set(best_checkpoints([(Path(r["path"]), r["metrics"]) for r in rows], metric, mode, keep_best))
    for row in rows:
        if Path(row["path"]) in best:
            row["marks"].insert(0, "best")
    return rows


def format_list(rows: list[dict]) -> str:
    """A plain-text table of :func:`list_run` rows."""
    if not rows:
        return "no checkpoints"
    table = [("step", "saved", "size", "metrics", "marks")]
    for row in rows:
        metrics = " ".join(f"{k}={_fmt(v)}" for k, v in row["metrics"].items()) or "-"
        table.append((str(row["step"]), row["time"] or "?", _human(row["bytes"]), metrics,
                      ",".join(row["marks"]) or "-"))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) if i else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))).rstrip()
             for r in table]
    for row in rows:
        for problem in (row.get("damaged") or {}).values():
            lines.append(f"step {row['step']} is damaged: {problem}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- inspect


def _tensor_summary(loaded: LoadedCheckpoint, stem: str) -> dict:
    """Names, shapes, dtypes and counts of a safetensors file, from its header only."""
    tensors, dtypes, params = [], {}, 0
    for name, spec in loaded.tensor_specs(stem).items():
        count = 1
        for dim in spec["shape"]:
            count *= dim
        params += count
        dtypes[spec["dtype"]] = dtypes.get(spec["dtype"], 0) + 1
        tensors.append({"name": name, **spec})
    return {"count": len(tensors), "params": params, "dtypes": dtypes, "tensors": tensors}


def inspect(ckpt: str | Path) -> dict:
    """What a checkpoint (or export) holds: manifest, training-state summary, tensors per file,
    and ``damaged``: ``{file: problem}`` for every file that does not match the manifest (each
    file is read once to check its SHA-256; damaged files are reported, not read further)."""
    loaded = LoadedCheckpoint(ckpt)
    info = {"path": str(loaded.path), "kind": "export" if loaded.is_export else "checkpoint",
            "step": loaded.step, "manifest": loaded.manifest, "metrics": loaded.metrics}
    damaged = {} if loaded.is_export else damaged_files(loaded.path)
    info["damaged"] = damaged
    if loaded.is_export:
        info["state"] = None
        info["export"] = loaded.export_info
    else:
        state = {}
        if "state.json" not in damaged and "state.json" in loaded.manifest["files"]:
            try:
                state = loaded.json_state()
            except UserError as exc:
                damaged["state.json"] = str(exc)
        scheduler = state.get("scheduler") if isinstance(state.get("scheduler"), dict) else {}
        data = state.get("data") if isinstance(state.get("data"), dict) else {}
        last_lr = scheduler.get("_last_lr") if isinstance(scheduler.get("_last_lr"), list) else [None]
        info["state"] = {"step": state.get("step"), "epoch": state.get("epoch"), "data_offset": data.get("offset"),
                         "lr": (last_lr or [None])[0], "keys": sorted(state)}
        info["lora"] = _lora_info(loaded, damaged)
    config = {}
    if "config.yaml" not in damaged and (loaded.is_export or "config.yaml" in loaded.manifest["files"]):
        try:
            config = parse_yaml(loaded.config_yaml(), f"{loaded.path}'s config.yaml") or {}
        except UserError as exc:
            damaged["config.yaml"] = str(exc)
        except yaml.YAMLError:
            config = {}
    model = config.get("model") if isinstance(config, dict) and isinstance(config.get("model"), dict) else {}
    info["model_config"] = {k: model.get(k) for k in ("preset", "depth", "hidden_size", "num_heads", "patch_size")
                            if k in model}
    info["tensors"] = {}
    for name in sorted(loaded.manifest["files"]):
        if name.endswith(".safetensors") and "/" not in name:
            stem = name[: -len(".safetensors")]
            if name in damaged:
                info["tensors"][stem] = {"error": f"damaged: {damaged[name]}"}
                continue
            try:
                info["tensors"][stem] = _tensor_summary(loaded, stem)
            except UserError as exc:   # a malformed header: report, don't stop the listing
                info["tensors"][stem] = {"error": str(exc)}
    info["total_params"] = info["tensors"].get("model", {}).get("params")
    return info


def _lora_info(loaded: LoadedCheckpoint, damaged: dict) -> dict | None:
    """A LoRA run's settings and base (checkpoint/lora.py), or None."""
    if damaged.keys() & {"config.yaml", "state.json"}:
        return None
    try:
        return merge_record(loaded) if lora_config(loaded) is not None else None
    except UserError:
        return None


def format_inspect(info: dict, max_tensors: int = 12) -> str:
    """Text for :func:`inspect` output; lists at most ``max_tensors`` tensor names per file."""
    lines = [f"{info['kind']}: {info['path']}", f"step: {info['step']}"]
    if info.get("total_params") is not None:
        lines.append(f"parameters: {info['total_params']:,} ({info['total_params'] / 1e6:.2f} M)")
    if info.get("model_config"):
        lines.append("model: " + " ".join(f"{k}={v}" for k, v in info["model_config"].items()))
    if info.get("metrics"):
        lines.append("metrics: " + " ".join(f"{k}={_fmt(v)}" for k, v in info["metrics"].items()))
    if info.get("state"):
        s = info["state"]
        lines.append(f"state: epoch={s['epoch']} data offset={s['data_offset']} global batches lr={_fmt(s['lr'])}")
    if info.get("lora"):
        lora = info["lora"]
        lines.append(f"LoRA: rank {lora['rank']}, alpha {lora['alpha']:g}: adapters only, on the base {lora['base']}")
    if info.get("export"):
        lines.append("export: " + " ".join(f"{k}={v}" for k, v in info["export"].items()))
    manifest = info["manifest"]
    if manifest.get("saved_at"):
        lines.append(f"saved: {manifest['saved_at']} in {manifest.get('save_seconds', '?')} s")
    damaged = info.get("damaged") or {}
    if damaged:
        lines.append(f"DAMAGED: {len(damaged)} file(s) do not match the manifest; use an earlier checkpoint")
    lines.append("files:")
    for name, meta in manifest["files"].items():
        status = f"  DAMAGED: {damaged[name]}" if name in damaged else ""
        lines.append(f"  {name:<20} {_human(meta.get('bytes')):>10}{status}")
    for name in damaged.keys() - manifest["files"].keys():
        lines.append(f"  {name:<20} {'':>10}  DAMAGED: {damaged[name]}")
    for stem, summary in info["tensors"].items():
        if "error" in summary:
            lines.append(f"{stem}: unreadable ({summary['error']})")
            continue
        dtypes = ", ".join(f"{d} x{n}" for d, n in sorted(summary["dtypes"].items()))
        noun = "tensor" if summary["count"] == 1 else "tensors"
        lines.append(f"{stem}: {summary['count']} {noun}, {summary['params']:,} values ({dtypes})")
        for tensor in summary["tensors"][:max_tensors]:
            lines.append(f"  {tensor['name']:<48} {tensor['dtype']:<5} {tuple(tensor['shape'])}")
        if summary["count"] > max_tensors:
            lines.append(f"  ... {summary['count'] - max_tensors} more")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- export


def export(ckpt: str | Path, out_dir: str | Path, use_ema: bool = False, dtype: str = "fp32",
           merge_lora: bool = False) -> Path:
    """Write a model folder for sampling, atomically: ``config.json`` (the model's arguments,
    as ``STDiT.save_pretrained`` writes it; ``videodit.models.load_pretrained`` reads it),
    ``model.safetensors``, the run's config (``run_config.yaml``: encoders, sampling defaults)
    and ``export.json`` (step, weights, dtype, source).

    ``use_ema`` takes the EMA weights when the checkpoint has them (else the model weights,
    with a warning); floating-point tensors are cast to ``dtype`` (fp32, bf16, fp16).
    ``merge_lora``: a LoRA run's checkpoint, its adapters merged into its base (a whole model).
    ``out_dir`` must not exist or be empty; nothing is left behind on failure.
    """
    from videodit.checkpoint.experts import expert_folders, experts_run, split_experts, write_experts

    target = export_dtype(dtype)
    check_new_folder(out_dir)
    loaded = LoadedCheckpoint(ckpt)
    tensors, weights = checkpoint_weights(loaded, use_ema, merge_lora)
    tensors = {k: v.to(target) if v.is_floating_point() else v for k, v in tensors.items()}
    run_config = merged_run_config(loaded.config_yaml()) if merge_lora else loaded.config_yaml()
    record = json.dumps({"step": loaded.step, "weights": weights, "dtype": dtype, "source": str(loaded.path),
                         **({"merged_lora": merge_record(loaded)} if merge_lora else {})}, indent=1) + "\n"

    def write(folder: Path, tensors: dict, run_config: str) -> Path:
        geometry = run_geometry(run_config, tensors)
        files = {"config.json": json.dumps(spec_of(geometry).geometry_config(geometry), indent=1) + "\n",
                 EXPORT_RUN_CONFIG: run_config, EXPORT_RECORD: record}
        return write_model_folder(folder, tensors, files)
    if experts_run(run_config):   # both experts of one run: a folder each
        family = from_yaml(run_config, "the checkpoint's config.yaml").model.family
        return write_experts(out_dir, expert_folders(family, "videodit"), split_experts(tensors, run_config), write)
    return write(Path(out_dir), tensors, run_config)


def export_dtype(dtype: str) -> torch.dtype:
    if dtype not in EXPORT_DTYPES:
        raise UserError(f"dtype={dtype!r} is not an export dtype; choose one of: {', '.join(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[dtype]


def check_new_folder(out_dir: str | Path, verb: str = "export") -> None:
    """``out_dir`` may be written: a new or empty folder outside every folder videodit manages and
    deletes (:func:`managed_folder`); else one line."""
    check_empty(out_dir)
    managed = managed_folder(out_dir)
    if managed is not None:
        raise UserError(f"{out_dir} is inside {managed}: anything written there may be deleted; {verb} to a folder "
                        "outside it")


# The files of a run folder (train/run_folder.py writes them): its checkpoints/ is the manager's.
_RUN_FILES = ("checkpoints.jsonl", "run_info.json", "metrics.jsonl")


def managed_folder(path: str | Path) -> str | None:
    """The folder videodit manages and deletes in (named, with what deletes there) that holds ``path``
    (symlinks resolved), or None: a run's ``checkpoints/`` (retention deletes whole checkpoints and
    what saves and exports leave), a checkpoint, a staging or deleting folder, a feature cache."""
    resolved = Path(os.path.abspath(path)).resolve()
    for folder in resolved.parents:
        name = folder.name
        if name.startswith((STAGING_PREFIX, DELETING_PREFIX)):
            return f"{folder}, an unfinished write or delete, which videodit removes"
        if CHECKPOINT_RE.match(name) and (folder / "manifest.json").is_file():
            return f"the checkpoint {folder}, which retention (checkpoint.save_total_limit) deletes whole"
        run = any((folder.parent / f).is_file() for f in _RUN_FILES)
        if name == "checkpoints" and (run or list_checkpoints(folder)):
            return f"the run's checkpoints folder {folder}, where retention deletes"
        if (folder / "shards").is_dir() and _is_cache(folder):
            return f"the feature cache {folder}, whose files cache build replaces"
    return None


def _is_cache(folder: Path) -> bool:
    try:
        manifest = read_user_json(folder / "manifest.json", max_bytes=16 << 20)
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == "videodit-feature-cache"


def checkpoint_weights(loaded: LoadedCheckpoint, use_ema: bool,
                       merge_lora: bool = False) -> tuple[dict[str, torch.Tensor], str]:
    """The model's tensors of a checkpoint and which weights they are ("ema" or "model"). A LoRA
    run's checkpoint holds adapters only: ``merge_lora`` merges them into their base (else refused)."""
    weights = "ema" if use_ema and loaded.has("ema") else "model"
    if use_ema and weights == "model":
        warn(f"{loaded.path} has no EMA weights; exporting the model weights")
    if lora_config(loaded) is not None:
        if not merge_lora:
            raise UserError(f"{loaded.path} is a LoRA checkpoint (adapters only): pass --merge-lora to write its "
                            "base with the adapters merged in")
        return adapted_model(loaded, weights, merge=True).state_dict(), weights
    if merge_lora:
        raise UserError(f"{loaded.path} is not a LoRA checkpoint (its lora.rank is 0); leave out --merge-lora")
    tensors = loaded.tensors("model")   # every read checks the file against the manifest
    if weights == "ema":
        tensors.update(loaded.tensors("ema"))   # EMA covers the parameters; buffers come from the model
    return tensors, weights


def write_model_folder(out_dir: str | Path, tensors: dict[str, torch.Tensor], files: dict[str, str],
                       verb: str = "export", weights_name: str = "model.safetensors") -> Path:
    """``tensors`` as ``weights_name`` and the text ``files`` in the new folder ``out_dir``,
    atomically: written into a staging folder, fsynced and renamed; nothing is left on failure."""
    return write_folder(out_dir, {weights_name: (tensors, {"format": "pt"})}, files, verb)


def write_folder(out_dir: str | Path, weights: dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]],
                 files: dict[str, str], verb: str = "export") -> Path:
    """:func:`write_model_folder` for any number of safetensors files (``{relative name: (tensors,
    metadata)}``, in subfolders too) beside the text ``files``."""
    with staged_folder(out_dir, verb) as staging:
        for name in {str(Path(name).parent) for name in (*weights, *files)} - {"."}:
            (staging / name).mkdir(parents=True, exist_ok=True)
        for name, (tensors, metadata) in weights.items():
            write_safetensors(staging / name, tensors, metadata)
        for name, text in files.items():
            with open(staging / name, "w") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
    return Path(out_dir)


def run_geometry(run_config: str, tensors: dict[str, torch.Tensor]):
    """The model's arguments: sizes from the run's config, the encoders' widths from the
    weights (so no encoder has to be loaded to export)."""
    cfg = from_yaml(run_config, "the checkpoint's config.yaml")
    spec = get_spec(cfg.model.family)
    one = one_model_tensors(cfg, tensors)   # an expert's, in a run of both
    return model_geometry(cfg, latent_channels=spec.latent_channels(one), caption_channels=spec.caption_channels(one))
