"""Trajectory distillation (``distill.method=trajectory``): the student regresses the teacher's ODE.

    noise --teacher, guided Euler (distill.teacher_substeps per student step)--> x0_teacher
            |  the state at the student's sigma k (k drawn per step)
            v
    student(x at sigma_k) -> x0  <-  mean |x0 - x0_teacher|^2

FastVideo's knowledge distillation and Self-Forcing's ODE initialisation regress the student's x0
onto the end of a teacher trajectory at the student's own steps; both write the trajectories to
disk once. Here the teacher runs them within the step, from the batch's seeded noise (a step costs
``len(distill.steps) x distill.teacher_substeps`` guided teacher calls), or, with
``distill.trajectories=DIR``, they are read from a cache that ``videodit distill trajectories``
wrote once (``build_trajectories``; the layout: ``distill/trajectory_cache.py``): each micro-batch
then regresses on cached items in place of its own samples, drawn from its noise seed among the
items of its clip shape, so a resumed run draws what the first would. A trajectory-distilled run
is also the usual start of a DMD2 run (``model.init_from=THIS_RUN distill.teacher=THE_TEACHER``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from safetensors import safe_open

from videodit.checkpoint.lora import base_record
from videodit.components import model_geometry
from videodit.config import Config
from videodit.data.feature_cache.format import encoder_identity, jsonable, regular, shard_name
from videodit.data.feature_cache.verify import records_of, shard_problem
from videodit.distill.schedule import StudentSchedule
from videodit.distill.trajectory_cache import (BUILD_FIX, INDEX, INDEX_SCHEMA, SHARDS, check_depends, draw,
                                               expected_tensors, read_manifest, teacher_trajectory, tensor_key)
from videodit.errors import UserError
from videodit.models.families import get_spec
from videodit.models.spec import Conditions
from videodit.parallel.gradients import gradient_sync
from videodit.train.dmd2 import StudentObjective


class TrajectoryDistillation(StudentObjective):
    """The student and the frozen teacher (or, with ``distill.trajectories``, the teacher's cached
    trajectories); no other role."""

    def __init__(self, trainer, teacher):
        super().__init__(trainer, teacher)
        self.cache = None
        if self.d.trajectories:
            self.cache = TrajectoryCache(self.d.trajectories)
            _refuse_given_frames(self.cfg, trainer.vae, trainer.text)
            self.cache.check(trajectory_depends(self.cfg, trainer.vae, trainer.text,
                                                known=self.cache.manifest["depends"].get("teacher")))
            self.teacher = None   # never called: its trajectories are on disk

    def train_step(self, micro_batches) -> tuple[float, float]:
        """One step: every micro-batch's trajectory, the student's regression at the step's
        exit sigma; returns (loss, gradient norm), both global."""
        student = self.trainer.parallel
        student.train()
        exit_index = self._exit_index(self.trainer.step)
        scale, last, total = 1.0 / len(micro_batches), len(micro_batches) - 1, 0.0
        for i, batch in enumerate(micro_batches):
            x_k, target, cond = self._regression_pair(batch, exit_index)
            with gradient_sync(student.module, enabled=i == last):
                sigma = torch.full((x_k.shape[0],), self.sigmas[exit_index], device=x_k.device)
                x0 = self._x0(student.module, student.autocast, x_k, sigma, cond)
                loss = torch.nn.functional.mse_loss(x0.float(), target.float()) * scale
                loss.backward()
            total += loss.item()
        loss, grad_norm = self._step_student(total)
        self.last.update(trajectory_loss=loss, student_grad_norm=grad_norm)
        return loss, grad_norm

    def _regression_pair(self, batch, exit_index: int):
        """(the teacher's state at ``exit_index``, its endpoint, the conditions) of one micro-batch:
        run now from the batch's seeded noise, or read for the cached items it draws."""
        if self.cache is not None:
            return self.cache.pair(self.items_of(batch), exit_index, self.trainer.device)
        x0_data, cond, generator = self._conditions(batch)
        noise = torch.randn(x0_data.shape, generator=generator).to(self.trainer.device)
        return (*self.trajectory(noise, cond, exit_index), cond)

    def items_of(self, batch) -> np.ndarray:
        """The cached items a micro-batch trains on: as many as it holds, of its clip shape (so the
        bucket mix and memory stay the run's), drawn from its noise seed alone."""
        pixels = getattr(batch, "pixels", None) or tuple(batch.video.shape[-3:])   # a CachedBatch has no video
        return self.cache.draw(tuple(int(p) for p in pixels), len(batch), batch.noise_seed)

    @torch.no_grad()
    def trajectory(self, noise: torch.Tensor, cond, exit_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the teacher's state at the student's sigma ``exit_index``, its x0 at the end): guided
        Euler steps from ``noise`` (``distill/trajectory_cache.py``'s ``teacher_trajectory``)."""
        states, end = teacher_trajectory(lambda x, t: self._teacher_x0(x, t, cond), noise, self.sigmas,
                                         self.d.teacher_substeps)
        return states[exit_index], end


# --------------------------------------------------------------------------- what the trajectories depend on


def teacher_source(cfg: Config) -> str:
    """Where the teacher's weights come from, on a config whose ``model.init_from`` the trainer
    has resolved (``distillation_teacher``'s rule: ``distill.teacher`` where it differs)."""
    teacher = cfg.distill.teacher
    return cfg.model.init_from if teacher is None or teacher == cfg.model.init_from else teacher


def trajectory_depends(cfg: Config, vae, text, known: dict | None = None) -> dict:
    """What a run's teacher trajectories depend on, as the manifest records it: the teacher's
    weights (``checkpoint/lora.py``'s fingerprint: SHA-256 from a checkpoint's manifest, else of
    the files; ``known``, a record made before), architecture, output kind, the student's sigmas,
    guidance, substeps, the negative prompt and the encoders (latent space, caption features)."""
    spec, encoders = get_spec(cfg.model.family), encoder_identity(cfg)
    geometry = model_geometry(cfg, vae.latent_channels, text.dim)
    teacher = base_record(teacher_source(cfg), known)
    return jsonable({
        # Without its stat keys (inode, times), which differ between copies and builds: the files stay the same.
        "teacher": {"path": teacher["path"], "fingerprint": teacher["fingerprint"]},
        "model": {"family": cfg.model.family, "geometry": spec.geometry_config(geometry)},
        "prediction": cfg.diffusion.prediction, "sigmas": StudentSchedule.of(cfg).sigmas.tolist(),
        "teacher_cfg": cfg.distill.teacher_cfg, "teacher_substeps": cfg.distill.teacher_substeps,
        "negative_prompt": cfg.sample.negative_prompt, "vae": encoders["vae"], "text": encoders["text"],
    })


def _refuse_given_frames(cfg: Config, vae, text) -> None:
    """The cache holds text-to-video items: an i2v model's given frame (and image features) is not stored."""
    geometry = model_geometry(cfg, vae.latent_channels, text.dim)
    if get_spec(cfg.model.family).takes_first_frame(geometry) or cfg.model.image_dim is not None:
        raise UserError("distill.trajectories holds text-to-video trajectories; an image-to-video model's given "
                        "frames are not cached: set distill.trajectories=null to run the teacher in the step")


# --------------------------------------------------------------------------- reading


def _shard_check(folder: Path, shard: int, manifest: dict, rows: dict, record) -> str | None:
    """Why shard ``shard`` is damaged (its SHA-256 and size as written, its header against the
    index rows ``rows``), or None."""
    path = folder / SHARDS / f"{shard_name(shard)}.safetensors"
    return shard_problem(path, expected_tensors(manifest, rows), record)


def _damaged(path: Path, problem: str, folder: Path) -> UserError:
    return UserError(f"trajectory cache shard {path} is damaged ({problem}); run "
                     f"`{BUILD_FIX.replace('DIR', str(folder))}` again with the config it was built with: it checks "
                     "every shard and recomputes the damaged ones")


class TrajectoryCache:
    """A finished trajectory cache: its index read once, each shard's SHA-256 checked at its first
    read in this process, the items' tensors read by name (a memory map, one tensor at a time)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        index, shards = self.folder / INDEX, self.manifest["shards"]
        if not regular(index):
            done = sum(_part_done(self.folder, s) for s in range(shards))
            raise UserError(f"distill.trajectories={self.folder} is not complete ({done} of {shards} shards); run "
                            f"`{BUILD_FIX.replace('DIR', str(self.folder))}` again to finish it")
        try:
            table = pq.read_table(index, schema=INDEX_SCHEMA)
            self.records = records_of(pq.read_schema(index).metadata) or {}
            self.columns = {name: table.column(name).to_numpy(zero_copy_only=False) for name in INDEX_SCHEMA.names
                            if name != "caption"}
        except Exception as exc:   # pyarrow's own error types, metadata that is not JSON
            raise UserError(f"{index} cannot be read ({' '.join(str(exc).split())[:200]}); run "
                            f"`{BUILD_FIX.replace('DIR', str(self.folder))}` again: it writes the index anew") from None
        if not np.array_equal(self.columns["item"], np.arange(self.manifest["items"])) or len(self.records) != shards:
            raise UserError(f"{index} does not list the manifest's {self.manifest['items']} items in {shards} shards; "
                            f"run `{BUILD_FIX.replace('DIR', str(self.folder))}` again: it writes the index anew")
        shapes = np.stack([self.columns[k] for k in ("frames", "height", "width")], axis=1)
        self.by_shape = {tuple(int(v) for v in s): np.flatnonzero((shapes == s).all(axis=1))
                         for s in np.unique(shapes, axis=0)}
        self.checked: set[int] = set()

    def check(self, wanted: dict) -> None:
        check_depends(self.manifest, wanted, str(self.folder))

    def draw(self, pixels: tuple[int, int, int], n: int, seed: int) -> np.ndarray:
        candidates = self.by_shape.get(pixels)
        if candidates is None:
            frames, height, width = pixels
            raise UserError(f"distill.trajectories={self.folder} holds no trajectory of a {frames}x{height}x{width} "
                            f"clip, which this run's batches have (it holds {len(self.by_shape)} clip shape(s), "
                            f"epoch 0's buckets): compute it with this run's data.* "
                            f"(`{BUILD_FIX.replace('DIR', 'NEW_DIR')}`)")
        return draw(candidates, n, seed)

    def _verify(self, shard: int) -> None:
        if shard in self.checked:
            return
        rows = {k: self.columns[k][self.columns["shard"] == shard] for k in ("item", "bucket", "text_len")}
        problem = _shard_check(self.folder, shard, self.manifest, rows, self.records.get(shard))
        if problem:
            raise _damaged(self.folder / SHARDS / f"{shard_name(shard)}.safetensors", problem, self.folder)
        self.checked.add(shard)

    def pair(self, items: np.ndarray, exit_index: int, device: torch.device):
        """(states at ``exit_index`` [B, C, T', H', W'], endpoints, Conditions) of ``items``, in fp32
        on ``device``: the captions padded back to ``text.max_length`` with zeros (as encoded), no
        caption dropped (the online step's conditions)."""
        geometry, c = self.manifest["text_geometry"], self.columns
        length, dim = int(geometry["max_length"]), int(geometry["dim"])
        n = len(items)
        x_k, end, pooled = [], [], []
        y, y_mask = torch.zeros(n, length, dim), torch.zeros(n, length, dtype=torch.bool)
        for j, item in enumerate(int(i) for i in items):
            shard = int(c["shard"][item])
            self._verify(shard)
            with safe_open(str(self.folder / SHARDS / f"{shard_name(shard)}.safetensors"), framework="pt") as f:
                x_k.append(f.get_tensor(tensor_key(item, f"state{exit_index}")).float())
                end.append(f.get_tensor(tensor_key(item, "x0")).float())
                offset, count = int(c["text_offset"][item]), int(c["text_len"][item])
                y[j, offset : offset + count] = f.get_tensor(tensor_key(item, "text")).float()
                y_mask[j, offset : offset + count] = True
                if geometry.get("pooled_dim"):
                    pooled.append(f.get_tensor(tensor_key(item, "pooled")).float())
        height, width = (torch.full((n,), float(c[k][items[0]]), device=device) for k in ("height", "width"))
        cond = Conditions(y.to(device), y_mask.to(device), torch.zeros(n, dtype=torch.bool, device=device),
                          torch.from_numpy(c["fps"][items].astype(np.float32)).to(device), height, width, None,
                          pooled=torch.stack(pooled).to(device) if pooled else None)
        return torch.stack(x_k).to(device), torch.stack(end).to(device), cond


def _part_done(folder: Path, shard: int) -> bool:
    return (folder / SHARDS / f"{shard_name(shard)}.parquet").is_file()
