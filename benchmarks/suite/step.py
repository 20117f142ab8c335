"""One training step as the Trainer runs it, on random latents and captions: the unit every
timing and memory section of the GPU suite measures."""

from __future__ import annotations

import statistics
import time

import torch

from videodit.components import model_of
from videodit.diffusion.rectified_flow import RectifiedFlow
from videodit.models.families import spec_of
from videodit.models.flops import train_step_flops
from videodit.models.spec import Conditions, count_parameters
from videodit.models.stdit.model import STDiT
from videodit.parallel.compile import CompileOptions
from videodit.parallel.parallelize import parallelize
from videodit.planner.measure import LiveMemory, optimizer_bytes, tensor_bytes

from suite.workload import Shape, Workload, free_memory, single_context, sync


class Step:
    """A model with its layout, levers and compile applied exactly as the Trainer does, its
    AdamW, and one batch of random latents and captions. The model is the workload's family's:
    STDiT (the XL workload) or, for the families section, Wan, the MMDiT or LTX-2."""

    def __init__(self, w: Workload, cfg, ctx, shape: Shape, batch: int, compile: CompileOptions | None = None,
                 seed: int = 0, shapes: int = 1):
        self.w, self.device, self.batch, self.shape = w, ctx.device, batch, shape
        self.geometry = w.geometry(cfg)
        torch.manual_seed(0)   # the same random weights on every rank
        self.spec = spec_of(self.geometry)
        self.stdit = self.spec.family == "stdit"
        with torch.device(ctx.device):   # another family: built and configured (frozen parts) as the Trainer's
            model = STDiT(self.geometry) if self.stdit else model_of(cfg, self.geometry)
        self.num_params = count_parameters(model)
        self.flow = RectifiedFlow(cfg.diffusion)
        frames, height, width = w.latent_shape(shape)
        grid = (*self.spec.token_grid(self.geometry, frames, height, width), w.caption[1])
        self.parallel = parallelize(model, ctx, cfg.parallel, memory=cfg.memory, loss_fn=self.flow.loss,
                                    autocast_dtype=torch.bfloat16 if w.bf16 else None,
                                    bucket_batch_sizes={f"b{i}": batch for i in range(shapes)}, base_grid=grid,
                                    compile=compile)
        params = list(self.parallel.local_model.parameters())
        fused = bool(params) and all(p.device.type == "cuda" for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True if fused else None)
        self.inputs, self.target = self.make_inputs(seed, frames, height, width)
        self.flops = train_step_flops(self.geometry, batch, frames, height, width, w.caption[1], cfg.memory)

    def make_inputs(self, seed: int, frames: int, height: int, width: int):
        g = torch.Generator().manual_seed(seed)
        b, (channels, length) = self.batch, self.w.caption
        x0 = torch.randn(b, self.geometry.in_channels if self.stdit else self.w.latent.channels, frames, height,
                         width, generator=g)
        noise = torch.randn(x0.shape, generator=g)
        t = torch.rand(b, generator=g)
        y = torch.randn(b, length, channels, generator=g)
        y_mask = torch.arange(length)[None] < torch.randint(1, length + 1, (b, 1), generator=g)
        x_t = self.flow.interpolate(x0, noise, t)
        drop = torch.zeros(b, dtype=torch.bool)
        if self.stdit:
            inputs = (x_t, t, y, y_mask, torch.full((b,), 24.0), drop)
        else:   # the family's own inputs, as the Trainer hands them (spec.model_inputs)
            pooled = getattr(self.geometry, "vec_in_dim", 0)   # the MMDiT's pooled CLIP vector
            cond = Conditions(y=y, y_mask=None, drop=drop,   # unmasked captions, as Wan, Open-Sora 2.0, LTX-2
                              pooled=torch.randn(b, pooled, generator=g) if pooled else None)
            inputs = self.spec.model_inputs(x_t, t, cond)
        inputs = tuple(v.to(self.device) for v in inputs)
        return inputs, self.flow.velocity_target(x0, noise).to(self.device)

    def __call__(self) -> None:
        self.parallel.forward_backward(self.inputs, self.target, scale=1.0, sync=True)
        self.parallel.clip_gradients(1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed(self, warmup: int, steps: int, barrier=None) -> tuple[float, float]:
        """(first step s, median step s): the first includes compiling."""
        times = []
        for _ in range(warmup + steps):
            sync(self.device)
            if barrier:
                barrier()
            start = time.perf_counter()
            self()
            sync(self.device)
            times.append(time.perf_counter() - start)
        return times[0], statistics.median(times[warmup:])

    def state_bytes(self) -> int:
        params = list(self.parallel.local_model.parameters())
        return tensor_bytes(params) + tensor_bytes(p.grad for p in params) + optimizer_bytes(self.optimizer)

    def peak_bytes(self) -> int:
        """The most memory one step (after the first, which creates the optimizer state) holds:
        ``max_memory_allocated`` on CUDA; on CPU the state plus what LiveMemory saw."""
        self()
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            self()
            sync(self.device)
            return torch.cuda.max_memory_allocated()
        with LiveMemory() as tracker:
            self()
        return self.state_bytes() + tracker.peak



def trial_peak(w: Workload, cfg, shape: Shape, batch: int) -> int | None:
    """The peak memory of a training step at ``batch`` (as ``Step.peak_bytes``); None when it
    runs out of GPU memory, which ``videodit tune`` counts as "does not fit" too."""
    try:
        return Step(w, cfg, single_context(w, cfg), shape, batch).peak_bytes()
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        free_memory()

