"""The distillation objectives a run may name (``distill.method``), and what they share before
any is built: the refusals (``dmd2.check_distillation``), the teacher (``distillation_teacher``) and a
LoRA run's adapters (``role_adapters``)."""

from __future__ import annotations

from videodit.config import Config
from videodit.models.lora import ADAPTER
from videodit.train.dmd2 import DMD2, check_distillation, distillation_teacher
from videodit.train.shared_base import CRITIC
from videodit.train.trajectory import TrajectoryDistillation

OBJECTIVES = {"dmd2": DMD2, "trajectory": TrajectoryDistillation}


def role_adapters(cfg: Config) -> tuple[str, ...]:
    """The adapters a LoRA run's model carries: the student's, and a shared-base DMD2 run's critic's."""
    return (ADAPTER, CRITIC) if cfg.distill.method == "dmd2" else (ADAPTER,)


__all__ = ["OBJECTIVES", "check_distillation", "distillation_teacher", "role_adapters"]
