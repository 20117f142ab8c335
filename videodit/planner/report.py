"""What ``videodit plan`` and ``videodit tune`` print and write: sizes, the per-bucket table,
the JSON object and the ``bucket_config`` file."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

import yaml

from videodit.models.families import spec_of
from videodit.errors import UserError
from videodit.planner.advice import MAX_SUGGESTED_WORLD, Advice, Fix, batch_one_peak, fixes
from videodit.planner.plan import BucketFit, Planner

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


_MAX_BYTES = 2**50   # 1024 TiB: far beyond any GPU


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80GB``, ``81920MiB``, ``8e10`` or a plain byte count, 1 byte to 1024 TiB."""
    shown = str(text) if len(str(text)) <= 40 else f"{str(text)[:37]}..."
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise UserError(f"memory size {shown!r} is not understood; write e.g. 80GiB, 80GB or 40960MiB")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not 1 <= value <= _MAX_BYTES:   # also refuses what overflows to inf
        raise UserError(f"memory size {shown!r} is out of range; give 1 byte to 1024TiB, e.g. 80GiB")
    return int(value)


def gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def plan_table(planner: Planner, plans: list[BucketFit]) -> str:
    """The human table: one row per (resolution, num_frames), sizes in GiB at the chosen batch;
    TFLOP/sample is the model FLOPs of one sample's forward + backward. Under DDP a ``ddp`` column
    (the reducer's gradient buckets); a DMD2 run adds ``critic`` and ``teacher`` columns, and below
    the table each of its roles on its own line (``roles_text``)."""
    ddp = any(p.estimate.ddp_buckets for p in plans)
    distilled = planner.distill is not None
    extra = (f"{'ddp':>6}" if ddp else "") + (f"{'critic':>8}{'teacher':>8}" if distilled else "")
    head = (f"{'resolution':<11}{'frames':>7}{'tokens':>8}{'TFLOP/sample':>13}{'config bs':>10}{'max bs':>8}"
            f"{'plan bs':>8}{'params':>8}{'grads':>7}{'optim':>7}{'ema':>6}{extra}{'activ':>8}{'temp':>7}{'enc':>6}"
            f"{'peak GiB':>10}  note")
    lines = [head, "-" * len(head)]
    for p in plans:
        e = p.estimate
        note = ""
        if not p.max_batch_size:   # the fix is for the GPUs given; more GPUs: advice_text, below the table
            note = f"does not fit at batch 1; try {p.fix}" if p.fix else \
                f"does not fit at batch 1 on {_gpus(planner.world_size)} with any lever"
        elif p.config_batch_size and p.config_batch_size > p.max_batch_size:
            needed = planner.estimate(p.config_batch_size, p.num_frames, p.height, p.width).peak
            note = f"config batch {p.config_batch_size} would need {gib(needed)} GiB"
        critic = e.critic_params + e.critic_grads + e.critic_optimizer + e.critic_ddp_buckets
        lines.append(f"{p.resolution:<11}{p.num_frames:>7}{p.tokens:>8}{p.flops.model / 1e12:>13.3g}"
                     f"{p.config_batch_size or '-':>10}{p.max_batch_size:>8}{p.batch_size:>8}"
                     f"{gib(e.params):>8}{gib(e.grads):>7}"
                     f"{gib(e.optimizer):>7}{gib(e.ema):>6}{f'{gib(e.ddp_buckets):>6}' if ddp else ''}"
                     f"{f'{gib(critic):>8}{gib(e.teacher):>8}' if distilled else ''}"
                     f"{gib(e.activations):>8}{gib(e.temporaries + e.passes):>7}"
                     f"{gib(e.encoders):>6}{gib(e.peak):>10}  {note}")
    if distilled and plans:
        lines.append(roles_text(max(plans, key=lambda p: p.estimate.peak)))
    return "\n".join(lines)


def roles_text(plan: BucketFit) -> str:
    """Each term of a bucket's estimate on its own line, in GiB (a DMD2 run's by role); their sum
    is the peak."""
    e = plan.estimate
    rows = e.lines()
    width = max(len(label) for label, _ in rows)
    out = [f"by role, {plan.resolution} x {plan.num_frames} at batch {max(plan.batch_size, 1)} (GiB):"]
    out += [f"  {label:<{width}}{gib(value):>8}" for label, value in rows]
    out.append(f"  {'peak (the sum)':<{width}}{gib(e.peak):>8}")
    return "\n".join(out)


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("s" if n != 1 else "")


def advice_text(planner: Planner, advice: Advice, commands: Callable[[Fix], list[str]]) -> str:
    """What to change so that every bucket takes batch 1: on the GPUs given first, then on more;
    each with its batch-1 peak and the command lines to paste (``commands(fix)``)."""
    world = planner.world_size
    lines = [f"{advice.buckets} bucket(s) do not fit at batch 1 as configured on {_gpus(world)} of "
             f"{gib(planner.gpu_bytes)} GiB."]
    if advice.fix is not None:
        lines.append(f"On {_gpus(world)} (as given): {' '.join(advice.fix.settings)} fits, batch-1 peak "
                     f"{gib(advice.fix_peak)} GiB of the {gib(planner.budget)} GiB budget:")
        lines += [f"  {line}" for line in commands(advice.fix)]
    else:
        least = min((batch_one_peak(planner, advice.stuck, fix) for fix in fixes(planner) if fix.world == world),
                    default=None)
        lines.append(f"On {_gpus(world)} (as given) nothing fits at batch 1, whatever lever"
                     + (f" (the least any leaves is {gib(least)} GiB of the {gib(planner.budget)} GiB budget)"
                        if least is not None else "") + ".")
    if advice.more is not None:
        lines.append(f"With {_gpus(advice.more.world)}: {' '.join(advice.more.settings) or 'as configured'} fits, "
                     f"batch-1 peak {gib(advice.more_peak)} GiB" + ("" if advice.more.uses_host else
                                                                    ", without moving weights or activations to "
                                                                    "the host") + ":")
        lines += [f"  {line}" for line in commands(advice.more)]
    elif advice.fix is None and planner.distill is not None:
        lines.append("Nor on more GPUs: DMD2 holds student, critic and teacher whole on every GPU (one process or "
                     "DDP; FSDP, TP and SP are not wired into its roles yet), so more GPUs do not lower the memory "
                     "per GPU: use GPUs with more memory, shorter clips or a lower resolution.")
    elif advice.fix is None:
        lines.append(f"Nor on up to {MAX_SUGGESTED_WORLD} GPUs: use GPUs with more memory, shorter clips or a "
                     "lower resolution.")
    return "\n".join(lines)


def plan_summary(planner: Planner, gpu_bytes: int) -> str:
    p, m = planner.parallel, planner.memory
    hidden = spec_of(planner.geometry).activation_dims(planner.geometry).hidden_size
    experts = (f" x {planner.experts} experts (both held, one trained per step)" if planner.experts > 1 else "")
    experts += f" | {planner.distill.describe()}" if planner.distill is not None else ""
    return (f"model: {planner.counts.num_params:,} parameters{_trained_summary(planner)}, "
            f"{planner.counts.depth_blocks} blocks, hidden {hidden}{experts}{_lora_summary(planner)}"
            f"{_audio_summary(planner)} | "
            f"per GPU: sp={p.sp} tp={p.tp} pp={p.pp} fsdp shard={p.shard} | "
            f"{'bf16 autocast' if planner.bf16 else 'fp32'} | checkpointing={m.checkpointing}"
            f"{f' every {m.checkpoint_every}' if m.checkpoint_every > 1 else ''}"
            f"{f' fraction {m.checkpoint_fraction}' if m.checkpoint_fraction < 1 else ''}"
            f"{''.join(f' {kind} {n}' for kind, n in (m.checkpoint_blocks or {}).items())}"
            f"{' offload' if m.offload else ''}{f' compression={m.compression}' if m.compression != 'none' else ''}"
            f"{''.join(f' {lever}' for lever in planner.levers.describe())} | "
            f"budget {gib(planner.budget)} of {gib(gpu_bytes)} GiB ({planner.margin:.0%} margin)")


def _trained_summary(planner: Planner) -> str:
    """How many train, where the config freezes some (LTX-2's audio stream without model.train_audio)."""
    trained = planner.counts.trained_params
    if planner.lora is not None or trained is None or trained == planner.counts.num_params:
        return ""
    return f" ({trained * planner.experts:,} trained)"


def _audio_summary(planner: Planner) -> str:
    return "" if planner.audio_fps is None else \
        f" | with its audio stream (model.train_audio): 25 audio tokens a second at {planner.audio_fps:g} fps"


def _lora_summary(planner: Planner) -> str:
    lora = planner.lora
    return "" if lora is None else \
        f" | LoRA rank {lora.rank}: {lora.params * planner.experts:,} adapter parameters train, the base is frozen"


def plan_json(planner: Planner, plans: list[BucketFit], gpu_bytes: int, advice: Advice | None = None,
              commands: Callable[[Fix], list[str]] | None = None) -> str:
    first = plans[0].estimate if plans else None
    model = {"num_params": planner.counts.num_params * planner.experts, "experts": planner.experts,
             "trained_params": (sum(planner.counts.trained) if planner.lora is None else planner.lora.params)
             * planner.experts, "audio_fps": planner.audio_fps,
             "levers": planner.levers.describe(),
             "params_per_gpu": int(first.detail["params_per_gpu"]) if first else 0}
    if planner.lora is not None:
        model.update(lora_rank=planner.lora.rank, adapter_params=planner.lora.params * planner.experts)
    if first:
        model.update({f"{k}_bytes": v for k, v in first.as_dict().items()
                      if k in ("params", "grads", "optimizer", "ema", "encoders", "ddp_buckets", "critic_params",
                               "critic_grads", "critic_optimizer", "critic_ddp_buckets", "teacher")})
    if planner.distill is not None:
        model["distill"] = planner.distill.method
    advised = None
    if advice is not None:
        advised = advice.as_dict()
        for key, fix in (("same_gpus", advice.fix), ("more_gpus", advice.more)):
            if fix is not None and commands is not None:
                advised[key]["commands"] = commands(fix)
    return json.dumps({"gpu_bytes": gpu_bytes, "budget_bytes": int(planner.budget), "world_size": planner.world_size,
                       "model": model, "buckets": [p.as_dict() for p in plans], "advice": advised}, indent=2)


def write_bucket_config(path: str | Path, bucket_config: dict, header: str) -> None:
    """A YAML file that ``data.bucket_config_file`` reads; an existing file is replaced atomically."""
    path = Path(path)
    text = f"# {header}\n" + yaml.safe_dump({"bucket_config": bucket_config}, sort_keys=False,
                                             default_flow_style=None)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write {path}: {exc.strerror or exc}; check the folder and free space") from None
