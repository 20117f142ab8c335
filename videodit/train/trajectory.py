"""Trajectory distillation (``distill.method=trajectory``): the student regresses the teacher's ODE.

    noise --teacher, guided Euler (distill.teacher_substeps per student step)--> x0_teacher
            |  the state at the student's sigma k (k drawn per step)
            v
    student(x at sigma_k) -> x0  <-  mean |x0 - x0_teacher|^2

FastVideo's knowledge distillation and Self-Forcing's ODE initialisation regress the student's x0
onto the end of a teacher trajectory at the student's own steps; both write the trajectories to
disk once. Here the teacher runs them within the step, from the batch's seeded noise (no cache
yet): a step costs ``len(distill.steps) x distill.teacher_substeps`` guided teacher calls. A
trajectory-distilled run is also the usual start of a DMD2 run (``model.init_from=THIS_RUN
distill.teacher=THE_TEACHER``).
"""

from __future__ import annotations

import torch

from videodit.parallel.gradients import gradient_sync
from videodit.train.dmd2 import StudentObjective


class TrajectoryDistillation(StudentObjective):
    """The student and the frozen teacher; no other role."""

    def train_step(self, micro_batches) -> tuple[float, float]:
        """One step: every micro-batch's trajectory, the student's regression at the step's
        exit sigma; returns (loss, gradient norm), both global."""
        student = self.trainer.parallel
        student.train()
        exit_index = self._exit_index(self.trainer.step)
        scale, last, total = 1.0 / len(micro_batches), len(micro_batches) - 1, 0.0
        for i, batch in enumerate(micro_batches):
            x0_data, cond, generator = self._conditions(batch)
            noise = torch.randn(x0_data.shape, generator=generator).to(self.trainer.device)
            x_k, target = self.trajectory(noise, cond, exit_index)
            with gradient_sync(student.module, enabled=i == last):
                sigma = torch.full((noise.shape[0],), self.sigmas[exit_index], device=noise.device)
                x0 = self._x0(student.module, student.autocast, x_k, sigma, cond)
                loss = torch.nn.functional.mse_loss(x0.float(), target.float()) * scale
                loss.backward()
            total += loss.item()
        loss, grad_norm = self._step_student(total)
        self.last.update(trajectory_loss=loss, student_grad_norm=grad_norm)
        return loss, grad_norm

    @torch.no_grad()
    def trajectory(self, noise: torch.Tensor, cond, exit_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the teacher's state at the student's sigma ``exit_index``, its x0 at the end): guided
        Euler steps from ``noise``, ``distill.teacher_substeps`` of them between successive student
        sigmas (and from the last one to 0), so the student's sigmas lie on the teacher's grid."""
        levels = self.sigmas + [0.0]
        x, at_exit = noise.float(), None
        for k, (hi, lo) in enumerate(zip(levels[:-1], levels[1:])):
            if k == exit_index:
                at_exit = x
            grid = torch.linspace(hi, lo, self.d.teacher_substeps + 1).tolist()
            for s, s_next in zip(grid[:-1], grid[1:]):
                t = torch.full((x.shape[0],), s, device=x.device)
                v = (x - self._teacher_x0(x, t, cond)) / s   # the guided velocity: x0 = x - s v
                x = x + (s_next - s) * v
        return at_exit, x
