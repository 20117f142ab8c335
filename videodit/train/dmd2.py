"""DMD2 (``distill.method=dmd2``): the training step of few-step distillation, and its roles.

    student (the run's model)  --rollout-->  x0  --noise at t-->  teacher (frozen, guided): x0_real
                                                                   critic (trained):       x0_fake
    every distill.generator_every-th step: student <- 0.5 * |x0 - sg(x0 - g)|^2,  g = DMD gradient
    every step:                            critic  <- flow matching on (sg(x0), noise, t)

The student is the trainer's own model (its optimizer, LR schedule, EMA, checkpoints and
samples as in any run); the critic is a second trained role, registered with ``TrainState``
so checkpoints and exact resume cover it; the teacher is frozen and never saved (the run's
config names it). Student and critic start from the teacher (``distill.teacher``, default
``model.init_from``).

Every role takes the student's layout (DDP, FSDP2/HSDP, SP; ``_parallel``). With ``lora.rank`` the
roles share one model instead (``shared_base.py``): the student's and the critic's adapters on the
teacher's frozen weights, the teacher being those weights with adapters off.

Every draw comes from the batch's noise seed, and the rollout's exit step from the step's seed,
so every rank runs the same number of forwards and a resumed run draws what the first would.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math

import numpy as np
import torch

from videodit.components import build_model
from videodit.config import Config
from videodit.diffusion.objectives import objective_name
from videodit.distill.dmd import dmd_gradient, generator_loss, guided, score_timesteps
from videodit.distill.schedule import StudentSchedule
from videodit.errors import UserError
from videodit.models.families import get_spec
from videodit.models.lora import ADAPTER
from videodit.models.spec import Conditions
from videodit.parallel.gradients import gradient_sync
from videodit.parallel.parallelize import parallelize
from videodit.sample import negative_condition
from videodit.train.optimizer import build_optimizer, warmup_schedule
from videodit.train.shared_base import CRITIC, AdapterRole, frozen_base
from videodit.train.state import Role, init_weights_from

NO_TP = ("distillation (distill.method) runs under DDP, FSDP2/HSDP and SP; tensor parallelism is not wired into its "
         "roles yet: set parallel.tp=1")


def check_distillation(cfg: Config) -> None:
    """What this DMD2 does not run yet, refused in one line each before anything is built."""
    d, p = cfg.distill, cfg.parallel
    if d.method is None:
        return
    if not (d.teacher or cfg.model.init_from):
        raise UserError(f"distill.method={d.method} distils a trained model: set distill.teacher (or model.init_from) to "
                        "its checkpoint or exported folder")
    if p.pp > 1:
        raise UserError(f"distill.method={d.method} runs several forwards of three models per step, which no pipeline "
                        "schedule holds: set parallel.pp=1")
    if p.tp > 1:
        raise UserError(NO_TP)
    if cfg.lora.rank and d.teacher and cfg.model.init_from and cfg.model.init_from != d.teacher:
        raise UserError(f"distill.method={d.method} with lora.rank trains adapters on the teacher's own weights "
                        f"(a shared base): model.init_from={cfg.model.init_from} is not distill.teacher; leave "
                        "model.init_from unset, or set lora.rank=0 to start a full-weight student elsewhere")
    if cfg.model.expert in ("high", "low"):
        raise UserError(f"distill.method={d.method} distils both experts of a two-expert model in one run (the "
                        f"student's steps cross the boundary): set model.expert=both, not {cfg.model.expert}")
    if cfg.diffusion.mask_ratios is not None or cfg.memory.swap_blocks:
        raise UserError(f"distill.method={d.method} does not take diffusion.mask_ratios or memory.swap_blocks yet; "
                        "distil without frame masks or block swapping")
    if objective_name(get_spec(cfg.model.family)) not in ("flow", "ltx2") or cfg.diffusion.condition_config is not None \
            or cfg.diffusion.first_frame_p:
        raise UserError(f"distill.method={d.method} distils text-to-video models (STDiT, Wan, Open-Sora 2.0, LTX-2's "
                        "video); given frames (diffusion.condition_config, diffusion.first_frame_p) are not wired yet: "
                        "remove them")
    if d.trajectories and d.method != "trajectory":
        raise UserError(f"distill.trajectories holds a trajectory run's teacher trajectories; distill.method={d.method} "
                        "does not read them: remove distill.trajectories (or set distill.method=trajectory)")
    if d.score_t_range[0] >= d.score_t_range[1]:
        raise UserError(f"distill.score_t_range={d.score_t_range} must be [low, high] with low < high")


def distillation_teacher(cfg: Config, model: torch.nn.Module, vae, text) -> torch.nn.Module | None:
    """The frozen teacher of a full-weight distillation run: a copy of the student's starting
    weights (``model``), or ``distill.teacher``'s where the student starts elsewhere. None for
    other runs, for a shared-base LoRA run, whose teacher is its own base (``shared_base.py``),
    and where the teacher's trajectories are read from ``distill.trajectories``."""
    if cfg.distill.method is None or cfg.lora.rank or cfg.distill.trajectories:
        return None
    source = cfg.distill.teacher
    if source is None or source == cfg.model.init_from:
        return copy.deepcopy(model)
    teacher = build_model(cfg, vae, text)
    init_weights_from(teacher, source)
    return teacher


class StudentObjective:
    """What every distillation objective shares: the student (the trainer's model), its few-step
    schedule, the frozen ``teacher`` (guided as ``distill.teacher_cfg`` says), the batch's
    conditions and the step's seeded exit index. Subclasses add their roles and their step."""

    def __init__(self, trainer, teacher: torch.nn.Module | None):
        cfg = trainer.cfg
        self.trainer, self.cfg, self.d = trainer, cfg, cfg.distill
        self.schedule = StudentSchedule.of(cfg)
        self.sigmas = self.schedule.sigmas.tolist()
        self.shared_base = bool(cfg.lora.rank)   # every role is the run's model (shared_base.py)
        if self.shared_base:
            self.teacher = frozen_base(trainer.parallel)
        else:   # None: trajectories read from distill.trajectories, no teacher is run
            self.teacher = None if teacher is None else self._parallel(teacher, frozen=True).module
        self.negative = None if trainer.text is None else negative_condition(trainer.text, cfg.sample.negative_prompt)
        self.spec = trainer.spec
        self.expert: str | None = None   # DMD2 on two experts: the step's (dmd2.py, model.expert=both)
        self.last: dict = {}

    def roles(self) -> dict[str, Role]:
        """The trained roles besides the student, for ``TrainState`` (none here)."""
        return {}

    def _parallel(self, model: torch.nn.Module, frozen: bool):
        """A full-weight role with the student's layout (FSDP2 shards, SP, checkpointing): the
        frozen teacher, or a trained copy (DMD2's critic). Built from the teacher as it was read,
        before anything of the student's layout touched it."""
        trainer, cfg = self.trainer, self.trainer.cfg
        model = model.requires_grad_(not frozen).train(not frozen).to(trainer.device)
        return parallelize(model, trainer.ctx, cfg.parallel, memory=cfg.memory, loss_fn=trainer.objective.loss,
                           autocast_dtype=trainer.parallel.autocast_dtype)

    def metrics(self) -> dict:
        return dict(self.last)

    def _step_student(self, loss: float) -> tuple[float, float]:
        """Clip, step (unless not finite), schedule, EMA: the student's update after its backward;
        returns (global loss, gradient norm)."""
        trainer, student = self.trainer, self.trainer.parallel
        grad_norm = student.clip_gradients(self.cfg.train.grad_clip)
        loss = student.global_loss(loss)
        if self._finite(loss, grad_norm):
            trainer.optimizer.step()
            trainer.scheduler.step()
            if trainer.ema is not None:
                trainer.ema.update(trainer.model)
        trainer.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm

    def _teacher_x0(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditions) -> torch.Tensor:
        """The teacher's x0 at (x_t, t), guided (Ho-Salimans ``distill.teacher_cfg``)."""
        autocast = self.trainer.parallel.autocast
        real = self._x0(self.teacher, autocast, x_t, t, cond)
        if self.d.teacher_cfg == 1:
            return real
        uncond = self._x0(self.teacher, autocast, x_t, t, self.spec.unconditional(cond, self.negative))
        return guided(real, uncond, self.d.teacher_cfg)

    def _finite(self, loss: float, grad_norm: float) -> bool:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return True
        self.trainer._nonfinite(loss, grad_norm)   # stop, or count a skipped update
        return False

    def _exit_index(self, step: int) -> int:
        """The student step whose output is trained (backward simulation): the same on every rank."""
        seed = np.random.SeedSequence((self.cfg.train.seed, step, 0xD3D2)).generate_state(1)[0]
        return int(np.random.default_rng(seed).integers(len(self.sigmas)))

    def _conditions(self, batch) -> tuple[torch.Tensor, Conditions, torch.Generator]:
        """(x0 latents, the captions' conditions, the batch's generator): no caption dropout, the
        student learns the guided teacher's outputs from the captions themselves."""
        trainer = self.trainer
        x0, y, y_mask, pooled, size, given, image = trainer.features(batch)
        n, device = x0.shape[0], trainer.device
        height, width = (torch.full((n,), float(side), device=device) for side in size[-2:])
        keep = torch.zeros(n, dtype=torch.bool, device=device)
        cond = Conditions(y, y_mask, keep, batch.fps.to(device), height, width, None, image=image, given=given,
                          pooled=pooled)
        return x0, cond, torch.Generator().manual_seed(batch.noise_seed)

    def _x0(self, model, autocast, x: torch.Tensor, sigma: torch.Tensor, cond: Conditions) -> torch.Tensor:
        """The clean sample a model's output at (x, sigma) implies, x0 = x - sigma * v, in fp32."""
        with autocast():
            out = model(*self.spec.model_inputs(x, sigma, cond))
        v = self.trainer.flow.model_velocity(out.float(), x, sigma)
        return x - sigma.view(-1, *([1] * (x.dim() - 1))) * v

class DMD2(StudentObjective):
    """DMD2: the student, its critic (a second trained role) and the frozen teacher."""

    def __init__(self, trainer, teacher: torch.nn.Module | None):
        critic = None if teacher is None else copy.deepcopy(teacher)   # before the teacher gets its layout
        super().__init__(trainer, teacher)
        tc = trainer.cfg.train
        if self.shared_base:   # the critic's adapter, beside the student's on the one model
            self.critic = AdapterRole(trainer.parallel, CRITIC)
        else:
            self.critic = self._parallel(critic, frozen=False)
        critic_tc = dataclasses.replace(tc, lr=self.d.critic_lr if self.d.critic_lr is not None else tc.lr,
                                        betas=list(self.d.critic_betas))
        self.critic_adapter = CRITIC if self.shared_base else ADAPTER
        self.critic_optimizer = build_optimizer(self.critic.local_model, critic_tc, lora=self.shared_base,
                                                adapter=self.critic_adapter)
        self.critic_scheduler = warmup_schedule(self.critic_optimizer, tc.warmup_steps)

    def roles(self) -> dict[str, Role]:
        """The trained roles besides the student, for ``TrainState``."""
        return {"critic": Role(self.critic, self.critic_optimizer, self.critic_scheduler, self.critic_adapter)}

    # ------------------------------------------------------------------ the step

    def train_step(self, micro_batches) -> tuple[float, float]:
        """One DMD2 step: the student on its turns, the critic always; returns (critic loss,
        the student's gradient norm of its last turn), both global."""
        trainer, student = self.trainer, self.trainer.parallel
        student.train()
        self.critic.train()
        generator_turn = trainer.step % self.d.generator_every == 0
        exit_index = self._exit_index(trainer.step)
        self.expert = self._expert_of(self.sigmas[exit_index])   # two experts: the one this step trains
        scale, last = 1.0 / len(micro_batches), len(micro_batches) - 1
        samples, generator_total = [], 0.0
        for i, batch in enumerate(micro_batches):
            x0_data, cond, generator = self._conditions(batch)
            with gradient_sync(student.module, enabled=i == last), torch.set_grad_enabled(generator_turn):
                x0 = self._rollout(x0_data, cond, exit_index, generator)
                if generator_turn:
                    loss = generator_loss(x0, self._dmd_gradient(x0.detach(), cond, generator)) * scale
                    loss.backward()
                    generator_total += loss.item()
            samples.append((x0.detach(), cond, generator))
        grad_norm = self.last.get("student_grad_norm", 0.0)
        if generator_turn:
            generator_total, grad_norm = self._step_student(generator_total)
            self.last.update(generator_loss=generator_total, student_grad_norm=grad_norm)
        with self._pinned():
            critic_total = sum(self.critic.forward_backward(*self._critic_inputs(*sample), scale=scale,
                                                            sync=i == last) for i, sample in enumerate(samples))
        critic_norm = self.critic.clip_gradients(self.cfg.train.grad_clip)
        critic_total = self.critic.global_loss(critic_total)
        if self._finite(critic_total, critic_norm):
            self.critic_optimizer.step()
            self.critic_scheduler.step()
        self.critic_optimizer.zero_grad(set_to_none=True)
        self.last.update(critic_loss=critic_total, critic_grad_norm=critic_norm)
        return critic_total, grad_norm

    def _rollout(self, x0_data: torch.Tensor, cond: Conditions, exit_index: int,
                 generator: torch.Generator) -> torch.Tensor:
        """The student's x0 at its step ``exit_index``: from noise through its earlier steps without
        gradients (``rollout=simulate``, re-noised as it samples), or from the data noised there."""
        student, device = self.trainer.parallel, self.trainer.device
        n = x0_data.shape[0]

        def noise() -> torch.Tensor:
            return torch.randn(x0_data.shape, generator=generator).to(device)

        def at(sigma: float) -> torch.Tensor:
            return torch.full((n,), sigma, device=device)

        if self.d.rollout == "data":
            sigma = self.sigmas[exit_index]
            x = (1 - sigma) * x0_data + sigma * noise()
        else:
            x = noise()
            for sigma, sigma_next in zip(self.sigmas[:exit_index], self.sigmas[1:exit_index + 1]):
                with torch.no_grad():
                    x0 = self._x0(student.module, student.autocast, x, at(sigma), cond)
                x = (1 - sigma_next) * x0 + sigma_next * noise()
        return self._x0(student.module, student.autocast, x, at(self.sigmas[exit_index]), cond)

    @torch.no_grad()
    def _dmd_gradient(self, x0: torch.Tensor, cond: Conditions, generator: torch.Generator) -> torch.Tensor:
        """Teacher (guided) and critic score ``x0`` noised at a score timestep: the DMD gradient."""
        device, d = self.trainer.device, self.d
        t = score_timesteps(x0.shape[0], tuple(d.score_t_range), d.shift, generator, self._side()).to(device)
        x_t = self.trainer.flow.interpolate(x0, torch.randn(x0.shape, generator=generator).to(device), t)
        with self._pinned():
            fake = self._x0(self.critic.module, self.critic.autocast, x_t, t, cond)
            return dmd_gradient(x0, fake, self._teacher_x0(x_t, t, cond), d.normaliser)

    def _critic_inputs(self, x0: torch.Tensor, cond: Conditions, generator: torch.Generator):
        """The critic's flow-matching step on the student's sample: (model inputs, velocity target)
        at a score timestep, the critic's own noise."""
        device, d, flow = self.trainer.device, self.d, self.trainer.flow
        t = score_timesteps(x0.shape[0], tuple(d.score_t_range), d.shift, generator, self._side()).to(device)
        noise = torch.randn(x0.shape, generator=generator).to(device)
        return self.spec.model_inputs(flow.interpolate(x0, noise, t), t, cond), flow.velocity_target(x0, noise)

    # ------------------------------------------------------------------ two experts (model.expert=both)
    #
    # Wan 2.2 A14B: each expert is distilled on its own side of the boundary. The step's expert is
    # the one its exit step belongs to (the same on every rank); teacher and critic score the
    # student's sample at timesteps on that side, pinned to that expert, so under FSDP2 every rank
    # gathers the same expert's blocks. The rollout's earlier steps route by their own sigma.

    def _expert_of(self, sigma: float) -> str | None:
        if self.cfg.model.expert != "both":
            return None
        return self.spec.expert_at(sigma, self.cfg.model.expert_boundary)

    def _side(self) -> tuple[float, float] | None:
        """The step's expert's timesteps (None: one model, every timestep)."""
        if self.expert is None:
            return None
        boundary = self.cfg.model.expert_boundary
        return (boundary, 1.0) if self.expert == "high" else (0.0, boundary)

    @contextlib.contextmanager
    def _pinned(self):
        """Every role's two-expert model pinned to the step's expert (nothing without experts)."""
        models = [m for m in (self.trainer.model, self.critic.local_model, self.teacher) if hasattr(m, "pinned")]
        for model in models:
            model.pinned = self.expert
        try:
            yield
        finally:
            for model in models:
                model.pinned = None
