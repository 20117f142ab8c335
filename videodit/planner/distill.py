"""A DMD2 run's memory by role (``distill.method=dmd2``, ``train/dmd2.py``), on top of the plain
estimate of its student (``estimate.py``).

A DMD2 run holds three models, each laid out as the student is (DDP, FSDP2/HSDP shards, SP; not
TP or pipelines): under DDP every GPU holds all three whole plus DDP's gradient buckets, 4 bytes
per parameter for each trained role; under FSDP2 each holds its shard of each:

* the **student**, the run's own model: fp32 weights, gradients, AdamW state, EMA (when
  ``train.ema_decay > 0``) and, under DDP, its reducer's gradient buckets: the plain estimate's terms;
* the **critic**, a trained copy of the teacher: fp32 weights, AdamW state (``train.optimizer``'s
  kind) and DDP buckets; no EMA; as many per GPU as the student's. Its gradients are made after the student's are freed (the
  student's optimizer steps and zeroes them, ``set_to_none``, before the critic's forward), so one
  set of gradients is alive at a time: the critic's gradient term is 0, the student's counts it;
* the frozen **teacher**: weights only, in the run's storage dtype (a deep copy of the model
  before any parallelism: fp32, also under bf16 autocast), sharded like the student's.

With ``lora.rank`` (shared-base LoRA, ``train/shared_base.py``) the three are one model: the
student's estimate already holds the frozen base (in ``lora.base_dtype``) and its adapter; the
critic adds an adapter of the same size with its AdamW state and DDP buckets; the teacher adds 0.

Activations: one graded pass at a time. On the student's turns its graded forward keeps its
activations while the teacher (cond and uncond) and the critic score the sample without
gradients; then its backward. The critic's graded forward + backward (every step) is a plain
training step of the same model on the same shapes. So activations and the backward's transients
are the plain step's; what the no-grad passes need on top is the ``passes`` term: their working
set (half a plain block, the planner's measure of one block's transient) and, under bf16, the
critic's autocast cache (autocast caches the bf16 copy of every leaf weight that requires grad,
with or without grad mode) beside the student's copies saved for backward, less what the
graded pass's gradients and transients occupy later (they do not exist yet). It is 0 but for
corner cases (``train.fp8``: the critic is not converted, so its graded pass keeps more).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from videodit.errors import UserError
from videodit.planner.estimate import Estimate

# train/dmd2.py's refusals, in the planner's words (the planner imports no runtime code).
REFUSED_LAYOUT = ("distillation (distill.method) runs under DDP, FSDP2/HSDP and SP; tensor parallelism and pipelines "
                  "are not wired into its roles: set parallel.tp=1 parallel.pp=1")


@dataclass(frozen=True)
class Distill:
    """What the planner needs of ``cfg.distill``."""
    method: str = "dmd2"
    teacher_cfg: float = 4.0      # != 1: the teacher also runs unconditioned (time, not memory)
    generator_every: int = 5
    shared_base: bool = False     # lora.rank: the roles are adapters of one frozen model
    cached: bool = False          # trajectory runs reading distill.trajectories: no teacher is held

    def describe(self) -> str:
        held = {("trajectory", False): "2 models per GPU", ("dmd2", False): "3 models per GPU"}.get(
            (self.method, self.shared_base), "one shared base per GPU")
        if self.cached:
            held = "its trajectories read from distill.trajectories, no teacher held"
        if self.method == "trajectory":
            return f"trajectory distillation: student trained, teacher frozen ({held}); teacher cfg {self.teacher_cfg:g}"
        return (f"DMD2: student + critic trained, teacher frozen ({held}); teacher cfg "
                f"{self.teacher_cfg:g}, student every {self.generator_every} step(s)")


def distill_from_config(cfg) -> Distill | None:
    d = cfg.distill
    if d.method is None:
        return None
    return Distill(d.method, d.teacher_cfg, d.generator_every, bool(cfg.lora.rank),
                   d.method == "trajectory" and bool(d.trajectories))


def check_distill_layout(cfg, parallel, world_size: int) -> None:
    """The layouts distillation refuses (``train/dmd2.py``), refused here in one line too."""
    p = cfg.parallel
    if cfg.distill.method is None:
        return
    if p.pp > 1 or p.tp > 1:
        raise UserError(REFUSED_LAYOUT)
    if cfg.diffusion.mask_ratios is not None or cfg.memory.swap_blocks:
        raise UserError("distillation does not take diffusion.mask_ratios or memory.swap_blocks yet; distil "
                        "without frame masks or block swapping")


def dmd2_estimate(student: Estimate, critic_pass: Estimate, num_params: int, precision_low_bytes: int,
                  with_critic: bool = True, teacher_held: bool = True) -> Estimate:
    """The DMD2 step's bytes per GPU: ``student``, the plain estimate of the run's model (its
    state, the graded pass's activations and transients); ``critic_pass``, the same step as the
    critic runs it (no train.fp8 conversion: otherwise equal to ``student``); ``num_params``: the
    model's parameters (whole on every GPU). ``with_critic`` False: trajectory distillation
    (``train/trajectory.py``), the student and the frozen teacher only (``teacher_held`` False: not
    even that, its trajectories are read from disk). A LoRA ``student``
    (``lora.rank``): the roles share its base (``train/shared_base.py``), so the teacher adds
    nothing and the critic is one more adapter, the size of the student's."""
    shared = "adapter_params" in student.detail
    # The roles' own weights, laid out as the student's: an fp32 model each (whole, or this GPU's
    # FSDP2 shard), or on a shared base one fp32 adapter.
    local = student.detail["params_per_gpu"]
    role_weights = student.grads if shared else local * 4
    teacher = 0 if shared or not teacher_held else local * 4   # full weights: fp32 (a copy of the model)
    held = {"distill": "dmd2" if with_critic else "trajectory", "shared_base": shared}
    if not with_critic:
        detail = {**student.detail, **held, "num_params_held": (1 if shared or not teacher_held else 2) * num_params}
        return dataclasses.replace(student, detail=detail, teacher=teacher)
    trained = role_weights // 4
    critic_cache = trained * precision_low_bytes if precision_low_bytes < 4 else 0   # bf16 autocast cache
    block = student.detail["per_block_plain"]
    graded = student.grads + student.activations + student.temporaries   # the student's graded pass, at its worst
    # The teacher's and critic's no-grad forwards, while the student's activations (and its bf16
    # weight copies, within its transients) are held, before its gradients exist.
    student_copies = student.detail.get("autocast_copies", 0)
    scoring = student.activations + student_copies + critic_cache + 0.5 * block
    critic = critic_pass.grads + critic_pass.activations + critic_pass.temporaries
    passes = int(max(0, scoring - graded, critic - graded))
    detail = {**student.detail, **held, "num_params_held": (1 if shared else 3) * num_params}
    return dataclasses.replace(student, detail=detail, critic_params=role_weights, critic_grads=0,
                               critic_optimizer=student.optimizer, critic_ddp_buckets=student.ddp_buckets,
                               teacher=teacher, passes=passes)


def role_terms(e: Estimate) -> int:
    """The critic's and teacher's terms: what a DMD2 run adds to a plain run of its model."""
    return e.critic_params + e.critic_grads + e.critic_optimizer + e.critic_ddp_buckets + e.teacher + e.passes

