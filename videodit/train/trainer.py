"""The Trainer: one readable loop.

    batches -> frozen encoders -> rectified-flow loss -> backward (x grad_accum)
            -> clip, AdamW step, LR schedule, EMA -> metrics, samples, checkpoints

Features plug in as small objects (EMA, MetricsLogger, CheckpointManager, Validator,
BadFileGuard, StopSignals); what a checkpoint holds is ``TrainState`` (``train/state.py``);
the loop itself stays flat.

The same loop runs on one process and under torchrun: ``DistContext`` says which rank
this is and ``parallel.parallelize`` wraps the model; its ``forward_backward`` runs a
micro-batch whatever the layout (pipeline included). Every rank runs the loop; rank 0
alone writes the run folder (metrics, samples, checkpoint files other than DCP shards).
The noise, timesteps and caption dropout of a batch are seeded by its global batch index,
so a run draws the same noise whatever its data-parallel size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from videodit.checkpoint import CheckpointManager, LoadedCheckpoint, checkpoint_name, list_checkpoints
from videodit.checkpoint.lora import check_base, lora_model, run_base
from videodit.components import (POOLED_TEXT_KINDS, build_encoders, build_image_encoder, build_model,
                                 first_frame_features, first_frame_given)
from videodit.config import Config, to_dict, to_yaml
from videodit.data.dataset import BadFileGuard, Batch
from videodit.data.feature_cache import CachedBatch, build_cached_training_data
from videodit.data.loader import build_training_data
from videodit.data.pixels import to_model_input
from videodit.diffusion.expert_routing import ExpertRouting
from videodit.diffusion.frame_mask import FrameConditioning
from videodit.diffusion.visual_condition import visual_conditioning
from videodit.diffusion.objectives import objective_of
from videodit.diffusion.rectified_flow import RectifiedFlow
from videodit.errors import UserError, os_error_message
from videodit.models.flops import train_step_flops
from videodit.models.families import get_spec
from videodit.models.spec import Conditions, count_parameters
from videodit.parallel.compile import compile_options
from videodit.parallel.distributed import init_distributed
from videodit.parallel.float8 import float8_options, precompute_scales_after_step
from videodit.parallel.fp8_base import base_storage_dtype, check_base_dtype
from videodit.parallel.lora import apply_lora, lora_summary
from videodit.parallel.block_swap import place_beside_swapped
from videodit.parallel.parallelize import parallelize
from videodit.sample import NonFiniteLatents, takes_condition
from videodit.toy.make import ensure_toy_data
from videodit.train.audio_stream import AudioStream
from videodit.train.caption_dropout import EmptyCaptionDropout
from videodit.train.distillation import OBJECTIVES, check_distillation, distillation_teacher, role_adapters
from videodit.train.ema import EMA
from videodit.train.loggers import check_loggers
from videodit.train.metrics import MetricsLogger, Throughput, peak_tflops, significant
from videodit.train.optimizer import build_optimizer, last_lr, require_optimizer, warmup_schedule
from videodit.train.run_folder import RunFolder
from videodit.train.runtime import check_config_change, cuda_settings, run_info, seed_everything
from videodit.train.samples import TrainingSamples
from videodit.train.stop import StopSignals, StoppedWaitingForData
from videodit.train.state import TrainState, expert_init_source, init_weights_from
from videodit.train.validation import Validator


class Trainer:
    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg = cfg
        self.run_dir = run_dir
        self.ckpt_root = run_dir / "checkpoints"
        tc = cfg.train
        check_loggers(tc.loggers)   # wandb asked for but not installed: refused before anything is built
        require_optimizer(tc.optimizer)   # adamw8bit without torchao: the same
        if tc.threads:
            torch.set_num_threads(tc.threads)
        if tc.deterministic:
            torch.use_deterministic_algorithms(True)
        # Parallel sizes are checked against the world and the model before anything is built.
        check_distillation(cfg)   # what DMD2 does not run yet: one line, before anything is built
        self.ctx = init_distributed(cfg)
        self.is_main = self.ctx.is_main
        seed_everything(tc.seed)   # the same on every rank: identical initial weights
        self.device = self.ctx.device
        cuda_settings(self.device)
        use_bf16 = tc.precision == "bf16" or (tc.precision == "auto" and self.device.type == "cuda")
        check_base_dtype(cfg, use_bf16)   # lora.base_dtype against the run: one line, before anything is built

        # Data first: a bad CSV (or a cache built for other encoders) should fail before any model is built.
        if cfg.data.cache:   # stored latents and caption embeddings (data/feature_cache/)
            self.data = build_cached_training_data(cfg, batch_size=tc.batch_size, seed=tc.seed,
                                                   dp_rank=self.ctx.dp_rank, dp_size=self.ctx.dp_size,
                                                   pin_memory=self.device.type == "cuda")
        else:
            ensure_toy_data(cfg)
            self.data = build_training_data(cfg.data, batch_size=tc.batch_size, seed=tc.seed,
                                            dp_rank=self.ctx.dp_rank, dp_size=self.ctx.dp_size,
                                            pin_memory=self.device.type == "cuda", audio=cfg.model.train_audio,
                                            notice=lambda line: self.is_main and print(line, flush=True))
        self.meta, self.sampler = self.data.meta, self.data.sampler
        self.bad_files = BadFileGuard(cfg.data.max_bad_fraction)

        if cfg.data.cache:   # the cache's geometry stands in for the encoders, which are never built
            self.vae, self.text = self.data.vae, self.data.text
            if self.is_main:
                print(self.meta.describe(), flush=True)
        else:
            self.vae, self.text = build_encoders(cfg, self.device)
        # Wan 2.1 I2V's CLIP, for image features of the given frame (None for other models)
        self.image_encoder = None if cfg.data.cache else build_image_encoder(cfg, self.device)
        # On GPUs a bf16 run encodes in bf16, as Open-Sora does: the frozen text encoder's weights
        # (T5-XXL: 19 GB in fp32) are cast, the VAE's matmuls and convolutions run under autocast
        # (its weights stay fp32, whatever the adapter); the outputs are used in fp32.
        self.encode_in_bf16 = use_bf16 and self.device.type == "cuda" and not cfg.data.cache
        self.pooled_dropout = EmptyCaptionDropout(self.text, cfg.diffusion, self.encoding)
        if self.encode_in_bf16:
            self.text.to(torch.bfloat16)
        self.flow = RectifiedFlow(cfg.diffusion)
        self.routing = self._expert_routing()   # model.expert=both: the expert of each step
        self.spec = get_spec(cfg.model.family)
        # flow matching (self.flow), or the family's own objective (LTX-2's), its clip sizes checked
        self.objective = objective_of(self.spec, cfg.diffusion, self.flow, self.vae, self.data.plan.buckets)
        self.conditioning = (None if cfg.diffusion.mask_ratios is None else   # Open-Sora's frame masks
                             FrameConditioning(cfg.diffusion.mask_ratios, cfg.model.patch_size[0]))
        self.audio = AudioStream.of(cfg, self.text, self.objective, self.device)   # model.train_audio (LTX-2)
        if self.conditioning is not None and self.spec.frame_mask_index() is None:
            raise UserError(f"diffusion.mask_ratios (Open-Sora 1.2's frame masks) is not supported by the "
                            f"{cfg.model.family} family; remove it")
        model = build_model(cfg, self.vae, self.text)
        self.visual = visual_conditioning(cfg.diffusion, self.vae, takes_condition(model), cfg.model.family,
                                          cfg.parallel.pp)   # Open-Sora 2.0's condition_config
        cached_conditions = ()   # an i2v model's given frame (and image features) must be in the cache: one line if not
        if cfg.data.cache:
            cached_conditions = self.data.require_conditions(first_frame=self.spec.takes_first_frame(model.geometry),
                                                             image=cfg.model.image_dim is not None,
                                                             pooled=cfg.text.kind in POOLED_TEXT_KINDS)
        if cfg.distill.method:   # student (and critic) start from the teacher
            cfg.model.init_from = cfg.model.init_from or cfg.distill.teacher
        if cfg.model.init_from:
            cfg.model.init_from = expert_init_source(cfg)
        lora_base = None
        if cfg.lora.rank:   # the frozen base, recorded by its absolute path (config.yaml) and fingerprint
            lora_base = run_base(cfg)
            cfg.model.init_from = lora_base["path"]
        if cfg.model.init_from:
            taken = init_weights_from(model, cfg.model.init_from)
            if self.is_main:
                print(f"model.init_from: starting from the {taken}", flush=True)
        self.num_params = count_parameters(model)
        teacher = distillation_teacher(cfg, model, self.vae, self.text)   # None unless distill.method is set
        if cfg.lora.rank:   # adapters first, then every layer of parallelism (parallel/lora.py)
            # On the host: the base reaches the device already cast (bf16) or in fp8, never in
            # fp32 whole (Wan 14B: 57 GB).
            model = apply_lora(model, cfg.lora, base_dtype=base_storage_dtype(cfg.lora.base_dtype, use_bf16),
                               adapters=role_adapters(cfg))   # DMD2: the critic's too (shared_base.py)
            if self.is_main:
                print(lora_summary(model, cfg.lora), flush=True)
        if cfg.memory.swap_blocks:   # the swapped blocks' frozen weights stay on the host
            model = place_beside_swapped(model, cfg.memory.swap_blocks, self.device)
        else:
            model = model.to(self.device)
        loss_fn = self.objective.loss if self.conditioning is None else self.conditioning.loss(self.objective.loss)
        loss_fn = loss_fn if self.visual is None else self.visual.loss(loss_fn)   # no_i2v_ref_loss
        loss_fn = loss_fn if self.audio is None else self.audio.loss_fn(model)   # video + audio, ltx-trainer's
        self.parallel = parallelize(model, self.ctx, cfg.parallel, memory=cfg.memory, loss_fn=loss_fn,
                                    autocast_dtype=torch.bfloat16 if use_bf16 else None,
                                    bucket_batch_sizes={f"{b.resolution}/{b.num_frames}/{b.ratio}": b.batch_size
                                                        for b in self.data.plan.buckets if b.batch_size},
                                    base_grid=self._base_grid(model), compile=compile_options(tc),
                                    fp8=float8_options(tc, self.device, self.ctx.dims.data_parallel))
        # This rank's parameters, named as in the whole model (FSDP2 and TP shard in place,
        # a pipeline stage keeps its parts).
        self.model = self.parallel.local_model
        self.ema = EMA(self.model, tc.ema_decay) if tc.ema_decay > 0 else None
        self.optimizer = build_optimizer(self.model, tc, lora=bool(cfg.lora.rank))   # train/optimizer.py
        precompute_scales_after_step(self.optimizer, self.model)   # train.fp8 under FSDP2: one all-reduce
        self.scheduler = warmup_schedule(self.optimizer, tc.warmup_steps)
        self.state = TrainState(self.parallel, self.optimizer, self.scheduler, self.ema, self.sampler, lora_base)
        self.distill = None if cfg.distill.method is None else OBJECTIVES[cfg.distill.method](self, teacher)   # + roles
        if self.distill is not None:
            self.state.roles = self.distill.roles()

        self.folder = RunFolder(run_dir)
        self.samples = TrainingSamples(cfg, run_dir, self.vae, self.text, self.flow, self.device, is_main=self.is_main,
                                       takes_image=self.spec.takes_first_frame(self.model.geometry))
        ck = cfg.checkpoint
        self.checkpoints = CheckpointManager(run_dir, every_steps=ck.every_steps, every_minutes=ck.every_minutes,
                                             save_total_limit=ck.save_total_limit, keep_best=ck.keep_best,
                                             metric=ck.metric, mode=ck.mode)
        self.validator = Validator(cfg, cfg.validation.csv, device=self.device,
                                   num_timesteps=cfg.validation.num_timesteps, max_samples=cfg.validation.max_samples,
                                   conditions=cached_conditions) if cfg.validation.csv else None
        self.last_validation: dict = {}
        self.output_error: str | None = None   # a failed write of samples (see _write_outputs)
        self.skipped_steps = 0   # updates skipped for a NaN/inf loss or gradient (train.on_nonfinite=skip)

    @property
    def step(self) -> int:
        return self.state.progress.step

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        self.start_run()
        try:
            return self._train()
        finally:
            if self.is_main:
                self.folder.unlock()

    def _train(self) -> dict:
        tc = self.cfg.train
        progress = self.state.progress
        metrics = MetricsLogger(self.run_dir, enabled=self.is_main, loggers=tc.loggers, config=to_dict(self.cfg),
                                resuming=progress.step > 0)   # W&B goes on in the run it logged before
        throughput = Throughput()
        batches = self.batches()
        bar = tqdm(total=tc.max_steps, initial=progress.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=None if self.is_main else True)
        last = {}
        stopping = False
        sampled_at = None   # the step whose clips were written last: the end does not make them again
        try:
            with StopSignals() as stop:
                while progress.step < tc.max_steps and not stopping:
                    waiting = time.perf_counter()
                    with stop.waiting_for_data():   # a stop signal here ends the run at once
                        micro_batches = [next(batches) for _ in range(tc.grad_accum)]
                    waited = time.perf_counter() - waiting
                    loss, grad_norm = self.train_step(micro_batches)
                    progress.step += 1
                    throughput.add(sum(len(b) for b in micro_batches), sum(map(self.model_flops, micro_batches)), waited)
                    bar.update(1)
                    if progress.step % tc.log_every == 0 or progress.step == tc.max_steps:
                        last = {"epoch": progress.epoch, "loss": loss, "lr": last_lr(self.scheduler),
                                "grad_norm": grad_norm, **self._speed(throughput),
                                **(self.audio.metrics(self.ctx) if self.audio else {}),
                                **(self.distill.metrics() if self.distill else {})}
                        if self.skipped_steps:
                            last["skipped_steps"] = self.skipped_steps
                        metrics.log(progress.step, last)
                        bar.set_postfix(loss=f"{loss:.4f}", sps=f"{last['samples_per_s']:.1f}")
                        if bar.disable and self.is_main:
                            print(f"step {progress.step}/{tc.max_steps} loss {loss:.4f} "
                                  f"samples/s {last['samples_per_s']:.1f}", flush=True)
                    if tc.sample_every and progress.step % tc.sample_every == 0:
                        self._write_outputs(lambda: self.write_samples(metrics))
                        sampled_at = progress.step
                    # Clocks, signals and full disks differ between ranks: act when any rank asks.
                    failed = metrics.error or self.output_error
                    saving = self.ctx.any(self.checkpoints.should_save(progress.step))
                    stopping = self.ctx.any(stop.requested is not None or failed is not None)
                    if self.validator and (saving or self._validation_due()):
                        self.validate(metrics)
                    if saving:
                        self.save()
                if stopping and self.is_main:
                    reason = stop.requested or metrics.error or self.output_error or "a signal to another rank"
                    print(f"stopping on {reason} after step {progress.step}; saving, then resume with resume=auto",
                          flush=True)
            if not self._saved_at_step():
                if self.validator:
                    self.validate(metrics)
                self.save()
            self.checkpoints.wait()
            done = progress.step >= tc.max_steps and not (metrics.error or self.output_error)
            if done and sampled_at != progress.step:
                self._write_outputs(lambda: self.write_samples(metrics))   # the last clips, before the loggers close
        except StoppedWaitingForData as stopped:
            if self.is_main:
                self.checkpoints.wait()
                latest = self.checkpoints.latest()
                kept = f"{latest.name} is intact: resume with resume=auto" if latest else "no checkpoint was saved yet"
                print(f"stopping on {stopped} while waiting for data after step {progress.step}, without saving "
                      f"(the next step's batches were partly read); {kept}", file=sys.stderr, flush=True)
            raise
        finally:
            bar.close()
            metrics.close()
            self.checkpoints.wait()
            if self.bad_files.summary():
                print(self.bad_files.summary(), flush=True)
            if self.is_main and self.parallel.compile_stats is not None:
                print(self.parallel.compile_stats.summary(), flush=True)   # graphs per block kind and shape
        failed = metrics.error or self.output_error
        if failed is not None:   # the checkpoint is saved; the run still did not finish cleanly
            raise UserError(f"{failed}; the checkpoint of step {progress.step} was saved; fix that, then resume "
                            "with resume=auto")
        return {"step": progress.step, **last, **self.last_validation}

    def _write_outputs(self, write) -> None:
        """Run a write that is not a checkpoint (samples); a failure (a full disk) stops the run
        after the next save instead of losing it. Samples of a model whose output is not finite
        (weights grown huge under train.on_nonfinite=skip) are not written, and the run goes on:
        the samples only show the training, the checkpoints are what it makes."""
        try:
            write()
        except NonFiniteLatents as exc:
            print(f"warning: no sample videos at step {self.step}: {exc}", file=sys.stderr, flush=True)
        except OSError as exc:
            self.output_error = self.output_error or f"could not write samples: {os_error_message(exc)}"

    def train_step(self, micro_batches: list[Batch]) -> tuple[float, float]:
        """One optimizer step over ``micro_batches``; returns (loss, grad norm), both global."""
        if self.distill is not None:   # the objective's own step over its roles
            return self.distill.train_step(micro_batches)
        self.parallel.train()
        total = 0.0
        with self.routed_step() as time_range:
            for i, batch in enumerate(micro_batches):
                inputs, target = self.prepare(batch, time_range)
                total += self.parallel.forward_backward(inputs, target, scale=1.0 / len(micro_batches),
                                                        sync=i == len(micro_batches) - 1)
        grad_norm = self.parallel.clip_gradients(self.cfg.train.grad_clip)
        loss = self.parallel.global_loss(total)   # both are global: every rank decides alike
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            self._nonfinite(loss, grad_norm)
            return loss, grad_norm
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(self.model)
        return loss, grad_norm

    def _nonfinite(self, loss: float, grad_norm: float) -> None:
        """A NaN/inf loss or gradient norm: the weights are not updated; stop, or count a skip."""
        what = f"loss {loss} and gradient norm {grad_norm} at step {self.step + 1}"
        if self.cfg.train.on_nonfinite == "stop":
            raise UserError(f"{what}: stopped without updating the weights (the last checkpoint is intact); "
                            "lower train.lr, check the data, or set train.on_nonfinite=skip")
        self.skipped_steps += 1
        if self.is_main:
            print(f"{what}: update skipped ({self.skipped_steps} so far)", flush=True)

    def loss(self, batch: Batch) -> torch.Tensor:
        """The rectified-flow loss of one micro-batch (not under pipeline parallelism)."""
        with self.routed_step() as time_range:
            return self.parallel.loss(*self.prepare(batch, time_range))

    @contextlib.contextmanager
    def routed_step(self):
        """With ``model.expert=both``: this step's expert pinned (every micro-batch on every rank
        trains it), yielding the range its timesteps are drawn from; unpinned after, so sampling
        and validation route each sample by its time. Yields None for other models."""
        if self.routing is None:
            yield None
            return
        route = self.routing.route(self.step)
        self.model.pinned = route.expert
        try:
            yield route.time_range
        finally:
            self.model.pinned = None

    def prepare(self, batch: Batch, time_range: tuple[float, float] | None = None) -> tuple[tuple, torch.Tensor]:
        """The model inputs of one micro-batch (the family's ``model_inputs``: x_t, t, then its
        conditions) and its velocity target; the batch's ``noise_seed`` draws its noise,
        timesteps (within ``time_range`` if given), dropout and frame masks (x_mask only with
        ``diffusion.mask_ratios``)."""
        x0, y, y_mask, pooled, size, given, image = self.features(batch)
        n = x0.shape[0]
        generator = torch.Generator().manual_seed(batch.noise_seed)
        x_t, t, target, x_mask = self.objective.noised(x0, size, generator, self.device, time_range)
        audio = None if self.audio is None else self.audio.noised(batch, generator, self.encoding)   # drawn next
        drop = (torch.rand(n, generator=generator) < self.cfg.diffusion.caption_dropout).to(self.device)
        if pooled is not None:   # dropped here, to the encoding of "": the model sees no drop flags
            y, y_mask, pooled = self.pooled_dropout(y, y_mask, pooled, drop, generator)
            drop = None
        height, width = (torch.full((n,), float(side), device=self.device) for side in size[-2:])
        if self.conditioning is not None:
            x_t, x_mask = self.conditioning.apply(x_t, x0, generator)
        cond = Conditions(y, y_mask, drop, batch.fps.to(self.device, non_blocking=True), height, width, x_mask,
                          image=image, given=given, pooled=pooled, audio=audio)
        return self.spec.model_inputs(x_t, t, cond), target

    def encoding(self):
        """The context the frozen encoders run in: bf16 autocast where they were cast to bf16."""
        return (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.encode_in_bf16
                else contextlib.nullcontext())

    def features(self, batch: Batch | CachedBatch) -> tuple:
        """(x0 latents, caption embeddings, caption mask, the pooled caption vector or None, (frames,
        height, width) in pixels, the given first frame's input channels of an i2v model or None, its
        image features or None) of one micro-batch: encoded here, or read from ``data.cache``."""
        if isinstance(batch, CachedBatch):   # the given frame's mask is derived here, not stored
            first, image = batch.conditions(self.device)
            given = None if first is None else self.spec.first_frame_condition(first)
            x0, *text = batch.features(self.device)
            given = given if self.visual is None else self.visual.apply(x0, batch.noise_seed)
            return (x0, *text, batch.pooled_on(self.device), batch.pixels, given, image)
        # uint8, pinned by the loader on GPUs: copied asynchronously, made float in [-1, 1] on the device
        video = to_model_input(batch.video, self.device)
        with torch.no_grad(), self.encoding():
            seeded = getattr(self.vae, "sample_posterior", False)   # vae.sample_posterior: a draw seeded by the batch
            posterior = {"generator": torch.Generator(self.device).manual_seed(batch.noise_seed)} if seeded else {}
            x0 = self.vae.encode(video, **posterior).float()
            y, y_mask = self.text.encode(batch.text)
            pooled = self.text.encode_pooled(batch.text)
            given = first_frame_given(self.model, self.vae, video)
            if self.visual is not None:
                given = self.visual.apply(x0, batch.noise_seed, video, self.vae.encode)
            image = first_frame_features(self.image_encoder, video)
        pooled = None if pooled is None else pooled.float()
        return x0, y.float(), y_mask, pooled, tuple(video.shape[-3:]), given, image

    def batches(self):
        """Batches forever, each with its noise seed; ``state.progress`` (epoch, offset) always
        names the next unconsumed global batch."""
        progress = self.state.progress
        while True:
            self.sampler.set_position(progress.epoch, progress.offset)
            for batch in self.data.loader:
                seed = noise_seed(self.cfg.train.seed, progress.epoch, progress.offset + self.sampler.dp_rank)
                progress.offset += self.sampler.dp_size
                self.bad_files.update(batch)
                yield dataclasses.replace(batch, noise_seed=seed)
            progress.epoch += 1
            progress.offset = 0

    def model_flops(self, batch: Batch) -> float:
        """Model FLOPs (forward + backward, no recompute) of one micro-batch: the MFU numerator."""
        size = batch.pixels if isinstance(batch, CachedBatch) else batch.video.shape[-3:]
        frames, height, width = self.vae.latent_size(*size)
        return train_step_flops(self.parallel.local_model.geometry, len(batch), frames, height, width,
                                self.cfg.text.max_length).model

    def _speed(self, throughput: Throughput) -> dict:
        """samples/s over all ranks, and per device the achieved model TFLOP/s and the MFU
        (where the device's peak is known). Both rates are this rank's, averaged over ranks:
        ranks of one sequence/tensor/pipeline group share a batch and its FLOPs."""
        samples, flops, waiting = throughput.read()
        samples, flops, waiting = self.ctx.mean(samples), self.ctx.mean(flops), self.ctx.mean(waiting)
        groups = self.ctx.world_size // self.ctx.dp_size   # ranks that split one batch's work
        speed = {"samples_per_s": round(samples * self.ctx.dp_size, 2), "tflops": significant(flops / groups / 1e12),
                 "data_wait": round(waiting, 3)}
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        peak = peak_tflops(name, self.cfg.train.peak_tflops)
        if peak:
            speed["mfu"] = significant(speed["tflops"] / peak)
        speed.update(self.parallel.compile_metrics())   # {"recompiles": n} under train.compile
        return speed

    def _base_grid(self, model) -> tuple[int, int, int]:
        """(latent frames, positions per frame, caption tokens) after patching, at the data's
        base shape: where pipeline stages are balanced."""
        cfg = self.cfg
        frames, height, width = self.vae.latent_size(cfg.data.num_frames, cfg.data.height, cfg.data.width)
        return (*self.spec.token_grid(model.geometry, frames, height, width), cfg.text.max_length)

    def _expert_routing(self) -> ExpertRouting | None:
        cfg = self.cfg
        if cfg.model.expert != "both":
            return None
        frames, height, width = self.vae.latent_size(cfg.data.num_frames, cfg.data.height, cfg.data.width)
        ratio = self.flow.shift_ratio(cfg.data.height, cfg.data.width, frames, (height, width))
        return ExpertRouting(self.flow, cfg.model.expert_boundary, ratio, cfg.train.seed)

    def _validation_due(self) -> bool:
        every = self.cfg.validation.every_steps
        return bool(every) and self.step % every == 0

    def _saved_at_step(self) -> bool:
        if self.is_main:
            self.checkpoints.wait()
            found = list_checkpoints(self.ckpt_root)
            saved = bool(found) and found[-1].name == checkpoint_name(self.step)
        return self.ctx.broadcast(saved if self.is_main else None)

    def validate(self, metrics: MetricsLogger) -> dict:
        model = self.eval_model()
        if model is not None:
            self.last_validation = self.validator.evaluate(model, self.vae, self.text, self.flow,
                                                           self.parallel.autocast, self.image_encoder)
            metrics.log(self.step, self.last_validation)
        return self.last_validation

    # ------------------------------------------------------------------ run folder, samples

    def write_samples(self, metrics: MetricsLogger | None = None) -> list[Path]:
        """This step's sample clips (``train/samples.py``), with their soundtracks in an audio-trained
        run; every rank calls this (gathering the weights to sample with is a collective)."""
        return self.samples.write(self.step, self.eval_model, metrics)

    def eval_model(self):
        """The model to validate and sample with, on rank 0 (None on other ranks): a plain copy
        with the EMA weights if there are any, else the training weights gathered whole.
        Gathering is a collective, so every rank calls this."""
        if self.ema is None and not self.ctx.distributed and not self.cfg.lora.rank:
            return self.model
        weights = self.state.eval_weights()
        if not self.is_main:
            return None
        if self.cfg.lora.rank:   # the base in fp32 (read again) with these adapters, as `videodit sample` does
            return lora_model(self.cfg, self.cfg.model.init_from, weights).to(self.device)
        model = build_model(self.cfg, self.vae, self.text).to(self.device)
        model.load_state_dict(weights)
        return model

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> Path | None:
        """Save on every rank (a collective); rank 0 writes the files."""
        return self.state.save(self.checkpoints, config_yaml=to_yaml(self.cfg), metrics=self.last_validation or None,
                               blocking=not self.cfg.checkpoint.async_save)

    def start_run(self) -> None:
        """Check the run folder and the checkpoint to resume from, then take the folder and
        resume. Nothing in the folder changes until every check has passed."""
        source = self.ctx.on_main(self._checked_start)
        if source is not None:
            ckpt = LoadedCheckpoint(source)
            try:
                self.state.load(ckpt, self.cfg.data.on_change)
            except BaseException:   # a refused resume leaves the folder as it found it
                if self.is_main:
                    self.folder.unlock()
                raise
        if self.is_main:
            self.folder.write_start(to_yaml(self.cfg), run_info(self.num_params))
            self.checkpoints.cleanup_staging()
            self.checkpoints.set_aside_after(self.step)   # this run's saves never replace them
            if source is not None:
                self.checkpoints.record_resume(ckpt.path)
                # A run killed between a save and its retention left one checkpoint too many; a
                # resume at train.max_steps saves nothing, so retention runs here as well.
                self.checkpoints.apply_retention()
                print(f"resumed from {ckpt.path} at step {self.step}", flush=True)

    def _checked_start(self) -> Path | None:
        """On rank 0: every check, then the lock; the checkpoint to resume from (or None)."""
        has_checkpoints = bool(list_checkpoints(self.ckpt_root))
        self.folder.check(resuming=self.cfg.resume is not None, has_checkpoints=has_checkpoints)
        source = self._resume_source()
        if source is not None:
            loaded = LoadedCheckpoint(source)
            check_config_change(loaded.config_yaml(), self.cfg)
            if self.state.lora_base is not None:   # the adapters' base must not have changed (again in load)
                check_base(loaded.json_state().get("lora_base") or {}, self.state.lora_base["path"])
        self.folder.lock()
        return source

    def _resume_source(self) -> Path | None:
        """``cfg.resume``: ``auto`` (the newest checkpoint of the run folder that verifies) or a
        checkpoint path. A run folder whose every checkpoint is damaged is never started over."""
        source = self.cfg.resume
        if source != "auto":
            return None if source is None else Path(source)
        latest = self.checkpoints.latest()
        if latest is None and self.checkpoints.skipped:
            path, problem = self.checkpoints.skipped[0]
            raise UserError(f"resume=auto: every checkpoint in {self.ckpt_root} is damaged (newest: {path.name}: "
                            f"{problem}); nothing was changed. Start over with --out NEW_DIR, or keep the weights "
                            f"with model.init_from={path} --out NEW_DIR")
        if latest is None:
            print(f"resume=auto: no checkpoint in {self.ckpt_root}, starting fresh", flush=True)
        return latest


def noise_seed(seed: int, epoch: int, global_batch: int) -> int:
    """The seed of one global batch's noise, timesteps and caption dropout."""
    return int(np.random.SeedSequence((seed, epoch, global_batch)).generate_state(1)[0])
