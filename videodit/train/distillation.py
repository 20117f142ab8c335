"""The distillation objectives a run may name (``distill.method``), and what they share before
any is built: the refusals (``dmd2.check_distillation``) and the teacher (``distillation_teacher``)."""

from __future__ import annotations

from videodit.train.dmd2 import DMD2, check_distillation, distillation_teacher
from videodit.train.trajectory import TrajectoryDistillation

OBJECTIVES = {"dmd2": DMD2, "trajectory": TrajectoryDistillation}

__all__ = ["OBJECTIVES", "check_distillation", "distillation_teacher"]
