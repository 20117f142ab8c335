"""Activation memory, step time and loss effect of each ``memory.*`` lever.

    python benchmarks/memory.py [--presets tiny,S] [--threads 1] [--loss-steps 20] [--device cpu]

For each model preset, one STDiT built as the Trainer builds it (identity VAE: latents are
3-channel pixels; toy text encoder), fp32, on toy clips (``render_clip``), with each lever
setting applied by ``apply_memory_levers`` to a copy of the same initial weights:

* activation MiB: bytes created by forward that are still alive when backward starts,
  measured with ``videodit.planner.measure.LiveMemory`` (it also sees the inputs that
  non-reentrant checkpointing keeps; on CUDA ``torch.cuda.memory_allocated`` is used);
  peak MiB: the most that was alive at any moment of forward + backward (gradients
  included, parameters not).
* step s: forward + backward (the optimizer step does not depend on the lever), median of
  ``--repeats``, settings interleaved so machine noise hits them alike.
* grad err: relative L2 error of the whole first-step gradient against the plain run's.
* loss diff: the same run (same weights, data, noise, AdamW) for ``--loss-steps`` steps with
  and without the lever; |loss - plain loss| / plain loss at the last step, and the largest
  over all steps. Only for presets listed in ``--loss-presets`` (S is too slow on 2 cores).

Offload moves CUDA tensors to pinned host memory; on CPU it is a no-op, so its row is only
measured when the device is CUDA.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import numpy as np
import torch

from videodit.components import build_encoders, build_model
from videodit.config import load_config
from videodit.toy.make import COLOURS, DIRECTIONS, SHAPES, caption, render_clip
from videodit.diffusion.rectified_flow import RectifiedFlow
from videodit.parallel.parallelize import apply_memory_levers
from videodit.planner.measure import LiveMemory
from videodit.parallel.saved_tensors import saved_tensor_stats

MiB = 2**20
SETTINGS = {   # name -> memory.* overrides
    "plain": {},
    "checkpoint full": {"memory.checkpointing": "full"},
    "checkpoint selective": {"memory.checkpointing": "selective"},
    "checkpoint full, every 2nd": {"memory.checkpointing": "full", "memory.checkpoint_every": 2},
    "compression bf16": {"memory.compression": "bf16"},
    "compression fp8": {"memory.compression": "fp8"},
    "offload": {"memory.offload": True},
}
# One video batch per preset: (batch, frames, height, width) of pixel latents.
SHAPES_BY_PRESET = {"tiny": (8, 8, 16, 16), "S": (1, 8, 32, 32)}


def make_batches(text, shape, count: int, device) -> list[tuple]:
    """``count`` toy batches: (video [B,3,T,H,W] in [-1, 1], caption tokens, mask)."""
    b, frames, height, width = shape
    rng = np.random.default_rng(0)
    combos = [(c, s, d) for c in COLOURS for s in SHAPES for d in DIRECTIONS]
    batches = []
    for _ in range(count):
        picks = [combos[i] for i in rng.choice(len(combos), size=b)]
        clips = np.stack([render_clip(*p, frames, height, width, rng) for p in picks])
        video = torch.from_numpy(clips).permute(0, 4, 1, 2, 3).float() / 127.5 - 1
        y, y_mask = text.encode([caption(*p) for p in picks])
        batches.append((video.to(device), y.to(device), y_mask.to(device)))
    return batches


class Setup:
    """Model inputs and the loss of a step, identical for every lever setting."""

    def __init__(self, cfg, vae, flow, batches, device):
        self.cfg, self.vae, self.flow, self.batches, self.device = cfg, vae, flow, batches, device

    def inputs(self, step: int):
        video, y, y_mask = self.batches[step % len(self.batches)]
        x0 = self.vae.encode(video)
        generator = torch.Generator().manual_seed(step)
        ratio = self.flow.shift_ratio(video.shape[-2], video.shape[-1], x0.shape[2])
        t = self.flow.sample_timesteps(x0.shape[0], ratio, generator, self.device)
        noise = torch.randn(x0.shape, generator=generator).to(self.device)
        fps = torch.full((x0.shape[0],), 4.0, device=self.device)
        return self.flow.interpolate(x0, noise, t), t, y, y_mask, fps, self.flow.velocity_target(x0, noise)

    def loss(self, model, inputs):
        x_t, t, y, y_mask, fps, target = inputs
        return self.flow.loss(model(x_t, t, y, y_mask, fps), x_t, t, target)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_memory(model, setup, device) -> tuple[float, float, torch.Tensor]:
    """(activation MiB, peak MiB, flat gradient) of one forward + backward."""
    inputs = setup.inputs(0)
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = setup.loss(model, inputs)
        sync(device)
        activations = torch.cuda.memory_allocated() - base
        loss.backward()
        del loss
        sync(device)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with LiveMemory() as tracker:
            loss = setup.loss(model, inputs)
            activations = tracker.live
            loss.backward()
            del loss
        peak = tracker.peak
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return activations / MiB, peak / MiB, grad


def time_steps(models: dict, setup, device, repeats: int) -> dict[str, float]:
    """Median forward + backward seconds per setting, settings interleaved (the memory
    measurement already ran each model once: that was the warm-up)."""
    timings = {name: [] for name in models}
    inputs = setup.inputs(0)
    for _ in range(repeats):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            sync(device)
            start = time.perf_counter()
            setup.loss(model, inputs).backward()
            sync(device)
            timings[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) for name, v in timings.items()}


def train_losses(model, setup, steps: int, lr: float) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = setup.loss(model, setup.inputs(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def run_preset(preset: str, device, args) -> list[dict]:
    b, frames, height, width = SHAPES_BY_PRESET[preset]
    base_overrides = [f"model.preset={preset}", f"data.num_frames={frames}", f"data.height={height}",
                      f"data.width={width}"]
    cfg = load_config("tiny", base_overrides)
    vae, text = build_encoders(cfg, device)
    torch.manual_seed(0)
    base = build_model(cfg, vae, text).to(device)
    # DiT zero-inits the final projection; a small random one lets every block get a gradient.
    torch.nn.init.normal_(base.final_layer.proj.weight, std=0.02)
    setup = Setup(cfg, vae, RectifiedFlow(cfg.diffusion),
                  make_batches(text, (b, frames, height, width), 4, device), device)
    x_t = setup.inputs(0)[0]
    pt, ph, pw = base.geometry.patch_size
    tokens = b * (frames // pt) * (height // ph) * (width // pw)
    print(f"\n{preset}: {sum(p.numel() for p in base.parameters()) / 1e6:.1f} M parameters, "
          f"{len(base.blocks)} blocks, batch {b} x {frames} frames x {height}x{width} latents "
          f"({tuple(x_t.shape)}), {tokens} tokens", flush=True)

    models, rows = {}, {}
    for name, levers in SETTINGS.items():
        if levers.get("memory.offload") and device.type != "cuda":
            rows[name] = {"setting": name, "skipped": "n/a on CPU (no-op)"}
            continue
        lever_cfg = load_config("tiny", base_overrides + [f"{k}={v}" for k, v in levers.items()])
        model = copy.deepcopy(base)
        checkpointed = apply_memory_levers(model, lever_cfg.memory)
        models[name] = model
        start = time.perf_counter()
        act, peak, grad = measure_memory(model, setup, device)
        stats = saved_tensor_stats(model)
        rows[name] = {"setting": name, "act": act, "peak": peak, "grad": grad,
                      "checkpointed": len(checkpointed), "packed_mib": stats.bytes_in / MiB,
                      "stored_mib": stats.bytes_stored / MiB}
        print(f"  {name:<28} activations {act:8.1f} MiB  peak {peak:8.1f} MiB  "
              f"({time.perf_counter() - start:.1f} s)", flush=True)

    plain_grad = rows["plain"]["grad"]
    for row in rows.values():
        if "grad" in row:
            row["grad_err"] = ((row.pop("grad") - plain_grad).norm() / plain_grad.norm()).item()

    repeats = args.repeats if args.repeats else (5 if preset == "tiny" else 2)
    for name, seconds in time_steps(models, setup, device, repeats).items():
        rows[name]["step"] = seconds
    print(f"  timed {repeats} interleaved repeats", flush=True)

    if preset in args.loss_presets.split(","):
        plain_losses = None
        for name, model in models.items():
            losses = train_losses(model, setup, args.loss_steps, cfg.train.lr)
            plain_losses = plain_losses or losses
            diffs = [abs(a - p) / p for a, p in zip(losses, plain_losses)]
            rows[name].update(loss_last=diffs[-1], loss_max=max(diffs), final_loss=losses[-1])
        print(f"  trained {args.loss_steps} steps per setting; plain loss "
              f"{plain_losses[0]:.4f} -> {plain_losses[-1]:.4f}", flush=True)
    return list(rows.values())


def print_table(preset: str, rows: list[dict], loss_steps: int) -> None:
    plain = rows[0]
    print(f"\n{preset}")
    print(f"| setting | activation MiB | x plain | peak MiB | step s | x plain | grad rel. err "
          f"| loss diff @{loss_steps} | max loss diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        if "skipped" in row:
            print(f"| {row['setting']} | {row['skipped']} | | | | | | | |")
            continue
        loss = (f"{row['loss_last']:.2e} | {row['loss_max']:.2e}" if "loss_last" in row else "- | -")
        print(f"| {row['setting']} | {row['act']:.1f} | {row['act'] / plain['act']:.2f} | {row['peak']:.1f} "
              f"| {row['step']:.3f} | {row['step'] / plain['step']:.2f} | {row['grad_err']:.1e} | {loss} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,S")
    parser.add_argument("--loss-presets", default="tiny", help="presets to train --loss-steps steps on")
    parser.add_argument("--loss-steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=0, help="timed repeats (0: 5 for tiny, 2 for S)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    start = time.perf_counter()
    print(f"torch {torch.__version__}, {args.threads} thread(s), device {device}")
    results = {preset: run_preset(preset, device, args) for preset in args.presets.split(",")}
    for preset, rows in results.items():
        print_table(preset, rows, args.loss_steps)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
