"""``videodit ckpt export RUN_OR_CKPT OUT --extract-lora RANK``: a LoRA extracted from a whole-weight
run, the difference between its weights and the base it started from, in lightx2v's layout (the one
its Wan step-distillation LoRAs ship in and ComfyUI's LoRA loaders read).

    extract_lora(ckpt, out_dir, rank, min_params=MIN_PARAMS, dtype="fp32") -> Extraction

- **base**: the run's teacher (``distill.teacher``, else ``model.init_from``), read as
  ``model.init_from`` reads it (``lora.init_weights``); **student**: the checkpoint's EMA weights
  where it has them, else its model weights (an export: its weights).
- every 2-D weight of at least ``min_params`` values (lightx2v: 1M) that changed: ``delta = student -
  base``, ``U, S, Vh = svd(delta)``, ``lora_up = U[:, :r] * sqrt(S[:r])``, ``lora_down = sqrt(S[:r])[:,
  None] * Vh[:r]`` with ``r = min(rank, min(delta.shape))``: ``up @ down`` is delta's best rank-r
  approximation (Eckart-Young), delta itself where r is its smaller side. No ``.alpha`` (scale 1).
- every other tensor that changed, whole: ``.diff`` (a weight, or any other parameter under its own
  name) or ``.diff_b`` (a bias, on its module); unchanged tensors are left out.

Keys: ``diffusion_model.<module>.lora_up.weight`` / ``.lora_down.weight`` / ``.diff`` / ``.diff_b``,
the modules named as ``--lora-format comfyui`` names them (``ModelSpec.lora_module_name``: Wan's
original names). ComfyUI (``comfy/lora.py`` ``load_lora``) adds ``strength * up @ down`` (no alpha:
scale 1), ``diff`` to the weight (or parameter) and ``diff_b`` to the bias of ``<module>.weight``.
A distilled run's folder also holds ``SAMPLING.md``: its student schedule
(``StudentSchedule.describe``), which the LoRA needs to sample as trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from videodit.checkpoint.experts import experts_run
from videodit.checkpoint.io import SAMPLING_NOTE
from videodit.checkpoint.loaded import LoadedCheckpoint
from videodit.checkpoint.lora import init_weights, lora_config
from videodit.checkpoint.tools import check_new_folder, export_dtype, run_geometry, write_folder
from videodit.config import Config, from_yaml
from videodit.distill.schedule import StudentSchedule
from videodit.errors import UserError
from videodit.models.families import get_spec

MIN_PARAMS = 1_000_000   # lightx2v's: smaller 2-D weights travel whole, as .diff


@dataclass
class Extraction:
    """What an extraction wrote and how well the rank held the change."""
    out: Path
    file: str
    source: Path
    step: int
    weights: str                 # "ema" or "model": the student's
    base: str                    # the base's source, as the run's config names it
    base_option: str             # "distill.teacher" or "model.init_from"
    rank: int
    min_params: int
    factored: int = 0            # weights written as lora_up / lora_down
    whole: int = 0               # tensors written as .diff / .diff_b
    unchanged: int = 0           # tensors equal in both, left out
    kept: float = 1.0            # the share of the factored weights' change (squared Frobenius) the rank holds
    sampling: str | None = None  # SAMPLING.md's text (a distilled run), else None
    ranks: dict[str, int] = field(default_factory=dict)   # key prefix -> rank written

    @property
    def relative_error(self) -> float:
        """||delta - up @ down||_F / ||delta||_F over the factored weights (0 at full rank)."""
        return max(1.0 - self.kept, 0.0) ** 0.5


def check_rank(rank, min_params) -> None:
    """A usable rank and size threshold, or one line."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise UserError(f"--extract-lora {rank}: the rank must be a whole number >= 1 (lightx2v's Wan LoRAs: "
                        "32 or 64; a rank at least a weight's smaller side keeps that weight exactly)")
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 1:
        raise UserError(f"--min-params {min_params}: the size from which a 2-D weight is factored must be a whole "
                        f"number >= 1 (lightx2v: {MIN_PARAMS})")


def extract_lora(ckpt: str | Path, out_dir: str | Path, rank: int, min_params: int = MIN_PARAMS,
                 dtype: str = "fp32") -> Extraction:
    """The LoRA of ``ckpt`` (a run folder: its newest checkpoint; a checkpoint; an export) against its
    run's base, written atomically into the new folder ``out_dir`` as ``<OUT's name>.safetensors``
    (+ ``SAMPLING.md`` for a distilled run). Every check runs before anything is written."""
    check_rank(rank, min_params)
    target = export_dtype(dtype)
    out_dir = Path(out_dir)
    check_new_folder(out_dir)
    loaded = LoadedCheckpoint(ckpt)
    cfg = from_yaml(loaded.config_yaml(), f"the config of {loaded.path}")
    spec = _check_run(loaded, cfg)
    option, source = base_source(cfg, loaded.path)
    student, weights = student_weights(loaded)
    base = _base_weights(source, option, run_geometry(loaded.config_yaml(), student), student)
    result = Extraction(out_dir, f"{out_dir.name}.safetensors", loaded.path, loaded.step, weights, str(source),
                        option, rank, min_params)
    rename = lambda module: "diffusion_model." + spec.lora_module_name("comfyui", module)   # noqa: E731
    tensors = extracted_tensors(student, base, rank, min_params, rename, result)
    if not tensors:
        raise UserError(f"the {weights} weights of {loaded.path} equal their base {source} ({option}): there is "
                        "no change to extract")
    schedule = StudentSchedule.of(cfg)
    files = {}
    if schedule is not None:
        result.sampling = sampling_note(schedule, result)
        files[SAMPLING_NOTE] = result.sampling
    record = {"extracted_rank": rank, "min_params": min_params, "format": "comfyui", "layout": "lightx2v",
              "step": loaded.step, "weights": weights, "source": str(loaded.path.resolve()), "base": str(source),
              **({"sampling": schedule.describe()} if schedule is not None else {})}
    metadata = {"format": "pt", "videodit_lora": json.dumps(record)}
    out = {name: t.to(target).contiguous() if t.is_floating_point() else t for name, t in tensors.items()}
    write_folder(out_dir, {result.file: (out, metadata)}, files)
    return result


def _check_run(loaded: LoadedCheckpoint, cfg: Config):
    """The run's spec, where its weights are whole and its family has a ComfyUI LoRA layout."""
    spec = get_spec(cfg.model.family)
    if "comfyui" not in spec.lora_formats:
        raise UserError(f"--extract-lora writes a ComfyUI LoRA file (lightx2v's layout), which loads for Wan and "
                        f"LTX-2 models, not {spec.family} ones; export the whole model with "
                        f"--format {' or '.join(('videodit',) + spec.export_formats)}")
    if lora_config(loaded) is not None:
        raise UserError(f"{loaded.path} is a LoRA run's checkpoint (adapters only): export its adapters with "
                        "--lora-format comfyui; --extract-lora takes a whole-weight run")
    if experts_run(loaded.config_yaml()):
        raise UserError(f"{loaded.path} holds both experts of a two-expert model (model.expert=both); "
                        "--extract-lora takes one model: export it, then extract from each expert's folder")
    return spec


def base_source(cfg: Config, where) -> tuple[str, str]:
    """(option, source) of a run's base: its teacher (``distill.teacher``), else ``model.init_from``."""
    if cfg.distill.teacher:
        return "distill.teacher", cfg.distill.teacher
    if cfg.model.init_from:
        return "model.init_from", cfg.model.init_from
    raise UserError(f"the run of {where} names no base (neither distill.teacher nor model.init_from: it trained "
                    "from scratch); --extract-lora extracts the change from the weights a run started from")


def student_weights(loaded: LoadedCheckpoint) -> tuple[dict[str, torch.Tensor], str]:
    """The checkpoint's EMA weights where it has them (its model weights for the rest), else its model
    weights; and which ("ema" or "model")."""
    tensors = loaded.tensors("model")   # every read checks the file against the manifest
    if loaded.has("ema"):
        tensors.update(loaded.tensors("ema"))
        return tensors, "ema"
    return tensors, "model"


def _base_weights(source: str, option: str, geometry, student: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base's tensors, read as model.init_from reads them, checked to be the student's model."""
    if not Path(source).exists():
        raise UserError(f"the base {source} ({option} of the run) does not exist; --extract-lora needs the "
                        "weights the run started from: restore them there")
    try:
        base, _ = init_weights(source, like=geometry)
    except UserError as exc:
        raise UserError(f"the base {source} ({option} of the run): {exc}") from None
    differ = sorted(set(base) ^ set(student)) or \
        sorted(name for name in student if tuple(student[name].shape) != tuple(base[name].shape))
    if differ:
        raise UserError(f"the base {source} ({option} of the run) does not hold the student's model (e.g. "
                        f"{differ[0]}); point {option} at the weights the run started from")
    return base


def _prefix(name: str, tensors: dict[str, torch.Tensor]) -> tuple[str, str]:
    """(module, suffix) under which a changed tensor travels whole: a weight as ``<module>.diff``, a
    bias beside a weight as ``<module>.diff_b``, any other parameter as ``<name>.diff``."""
    if name.endswith(".weight"):
        return name.removesuffix(".weight"), "diff"
    if name.endswith(".bias") and name.removesuffix(".bias") + ".weight" in tensors:
        return name.removesuffix(".bias"), "diff_b"
    return name, "diff"


def factor(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lora_up [out, r], lora_down [r, in], the singular values) of ``delta``, r = min(rank, its
    smaller side): the square root of each singular value on either side."""
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    r = min(rank, s.shape[0])
    root = s[:r].sqrt()
    return u[:, :r] * root, root[:, None] * vh[:r], s


def extracted_tensors(student: dict[str, torch.Tensor], base: dict[str, torch.Tensor], rank: int, min_params: int,
                      rename, result: Extraction) -> dict[str, torch.Tensor]:
    """The LoRA file's tensors (float32, CPU), in the student's order; counts into ``result``."""
    device = "cuda" if torch.cuda.is_available() else "cpu"   # a 14B's few hundred SVDs: minutes on a GPU
    tensors, kept, total = {}, 0.0, 0.0
    for name, theirs in student.items():
        ours = base[name]
        if not theirs.is_floating_point():
            if not torch.equal(theirs, ours):
                raise UserError(f"{name} (not floating point) differs from the base's; --extract-lora carries "
                                "changes of floating-point weights only")
            result.unchanged += 1
            continue
        delta = theirs.float() - ours.float()
        if not delta.any():
            result.unchanged += 1
            continue
        if delta.dim() == 2 and delta.numel() >= min_params:
            up, down, s = factor(delta.to(device), rank)
            key = rename(name.removesuffix(".weight"))
            tensors[f"{key}.lora_up.weight"] = up.cpu()
            tensors[f"{key}.lora_down.weight"] = down.cpu()
            energy = s.double().square()
            kept, total = kept + float(energy[:up.shape[1]].sum()), total + float(energy.sum())
            result.factored += 1
            result.ranks[key] = up.shape[1]
            continue
        module, suffix = _prefix(name, student)
        tensors[f"{rename(module)}.{suffix}"] = delta
        result.whole += 1
    result.kept = kept / total if total else 1.0
    return tensors


def sampling_note(schedule: StudentSchedule, result: Extraction) -> str:
    """``SAMPLING.md``: how the distilled LoRA samples as it was trained."""
    sigmas = ", ".join(f"{s:.4f}" for s in schedule.sigmas.tolist())
    sampler = ("LCM-style: each step takes the model's x0 (x - sigma * v), then noises it afresh to the next sigma"
               if schedule.renoise else "Euler along the flow ODE: x + (sigma_next - sigma) * v")
    return "\n".join([
        f"# Sampling {result.file}",
        "",
        f"A step-distilled LoRA: rank {result.rank}, extracted by videodit from the {result.weights} weights of "
        f"{result.source} (step {result.step}) minus its teacher {result.base} ({result.base_option}). Apply it at "
        "strength 1 to that teacher's weights, and sample as the student was trained:",
        "",
        schedule.describe(),
        "",
        f"- steps: {len(schedule.steps)} (timesteps {list(schedule.steps)} on the 1000-grid)",
        f"- shift: {schedule.shift:g}, warping t -> shift*t / (1 + (shift-1)*t)",
        f"- sigmas: {sigmas}, then 0",
        "- cfg: 1 (guidance is distilled in: no negative prompt, one model call per step)",
        f"- sampler: {sampler}",
        "",
    ])
