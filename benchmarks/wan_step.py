"""One fp32 CPU training step (forward + loss + backward + AdamW) of videodit's Wan 2.1 DiT vs diffusers'.

    python benchmarks/wan_step.py [--steps 10] [--warmup 2] [--threads 1] [--profile]

Both sides compute the same function with the same weights: videodit's
``videodit.models.wan.model.WanDiT`` is built from a :class:`WanGeometry` and given seeded random
weights (every matrix ~ N(0, 1/fan_in), biases and modulation tables ~ N(0, 0.2), norm scales
~ 1 + N(0, 0.2), so nothing is zero, not even the output projection Wan zero-initialises); the
state dict goes through ``layouts.to_diffusers`` and is loaded *strictly* into the diffusers
``WanTransformer3DModel`` built from ``layouts.diffusers_config(geometry)``. Before timing, the
forward outputs are compared (eval mode, no grad) and must agree to 1e-5 relative
(max |diff| / max |output|).

The model is "S-sized", a Wan 2.1 shape scaled down so that a CPU step takes seconds: dim 512,
8 heads of 64, 6 layers, ffn 2048 (4x), text_dim 4096 (umT5-XXL's width, so the text embedder,
which sees all 512 caption tokens, is its real size), patch 1x2x2, 16 latent channels. The latents
are a batch of 2 clips of 16 x 3 x 24 x 32 (9 frames at 192x256 through Wan's VAE), 576 tokens
each, 1,152 in the batch: attention is a visible but not dominant part of the step, as in real Wan
training. Each clip has its own time t and a caption of 200 or 120 random tokens zero-padded to 512
(Wan attends the padding; diffusers' pipeline pads the same way); both models get the already
padded [2, 512, 4096] context (``encoder_hidden_states`` for diffusers, with ``timestep=t*1000``).

The loss is the flow-matching MSE of both: x_t = (1 - t) x0 + t noise, target noise - x0, on the
model's output. Each side has its own ``torch.optim.AdamW`` (lr 1e-4, default betas, weight decay
0.01, torch's default CPU implementation); gradients are set to None before the clock starts. The
steps alternate (videodit, diffusers, videodit, ...) so machine noise hits both alike; after
``--warmup`` steps of each, the median and min of ``--steps`` are reported with the ratio
videodit / diffusers of the medians and the median of the ratios of each videodit step to the
diffusers step of the same round, the split into forward / backward / optimizer, and the peak RSS
growth during a step (before each step glibc's ``malloc_trim(0)`` hands freed heap back to the OS
and ``/proc/self/clear_refs`` resets VmHWM; the figure is VmHWM after minus VmRSS before: the
activations, gradients and optimizer temporaries of the step, approximately). The CPU time of the
process during the step (``time.process_time``) is reported too: with one intra-op thread it counts
the step's own work and not the time it waited for a core other jobs held, so on a busy machine its
ratio is the steadier one. ``--profile`` adds a torch.profiler table of the top operators of one
step of each model.

``--threads`` defaults to 1: on a 2-core machine that other jobs share, 2 intra-op threads make
steps slower and noisier (see the Open-Sora step benchmark).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from diffusers import WanTransformer3DModel  # noqa: E402
from make_wan_fixtures import randomize  # noqa: E402  (the fixtures' weights: nothing zero or one)

from videodit.models.wan import layouts  # noqa: E402
from videodit.models.wan.model import WanDiT, WanGeometry  # noqa: E402

SEED = 2024
GEOMETRY = WanGeometry(dim=512, ffn_dim=2048, num_heads=8, num_layers=6, text_dim=4096)
LATENT = (2, 16, 3, 24, 32)          # B, C, T, H, W
CAPTION_TOKENS = (200, 120)           # real tokens per sample; the rest of the 512 are zeros
TIMES = (0.3, 0.8)


def build_models(geometry: WanGeometry):
    torch.manual_seed(SEED)
    ours = WanDiT(geometry)
    randomize(ours, torch.Generator().manual_seed(SEED))
    config = {k: v for k, v in layouts.diffusers_config(geometry).items() if not k.startswith("_")}
    theirs = WanTransformer3DModel(**config)
    theirs.load_state_dict(layouts.to_diffusers(ours.state_dict()), strict=True)
    return ours, theirs


def make_inputs(generator: torch.Generator) -> dict:
    batch = LATENT[0]
    context = torch.zeros(batch, layouts.DIFFUSERS_TEXT_LEN, GEOMETRY.text_dim)
    for i, n in enumerate(CAPTION_TOKENS[:batch]):
        context[i, :n] = torch.randn(n, GEOMETRY.text_dim, generator=generator)
    x0 = torch.randn(LATENT, generator=generator)
    noise = torch.randn(LATENT, generator=generator)
    t = torch.tensor(TIMES[:batch])
    s = t.view(-1, 1, 1, 1, 1)
    return {"xt": (1 - s) * x0 + s * noise, "t": t, "context": context, "target": noise - x0}


def run_ours(model, i: dict) -> torch.Tensor:
    return model(i["xt"], i["t"], i["context"])


def run_theirs(model, i: dict) -> torch.Tensor:
    return model(hidden_states=i["xt"], timestep=i["t"] * 1000, encoder_hidden_states=i["context"]).sample


try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:
    _LIBC = None


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> bool:
    """Hand freed heap memory back to the OS (so the other model's cached blocks are not reused for
    free) and reset VmHWM to the current RSS."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def train_step(model, run, optimizer, inputs: dict) -> dict:
    """Seconds of forward (with the loss), backward and optimizer step, the loss, and the peak RSS
    growth in MiB (None where VmHWM cannot be reset)."""
    optimizer.zero_grad(set_to_none=True)
    can_reset = _reset_peak_rss()
    rss_before = _status_kb("VmRSS")
    c0, t0 = time.process_time(), time.perf_counter()
    loss = F.mse_loss(run(model, inputs), inputs["target"])
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optimizer.step()
    t3, c3 = time.perf_counter(), time.process_time()
    peak = (_status_kb("VmHWM") - rss_before) / 1024 if can_reset else None
    return {"total": t3 - t0, "cpu": c3 - c0, "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2,
            "loss": loss.item(), "rss": peak}


def check(ours, theirs, inputs: dict) -> tuple[float, float]:
    """(max |videodit - diffusers| / max |diffusers|, max |diffusers|) of the forward outputs."""
    ours.eval(), theirs.eval()
    with torch.no_grad():
        mine, reference = run_ours(ours, inputs), run_theirs(theirs, inputs)
    ours.train(), theirs.train()
    scale = reference.abs().max().item()
    return (mine - reference).abs().max().item() / scale, scale


def profile(sides: dict, inputs: dict, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile
    for side, (model, run, optimizer) in sides.items():
        optimizer.zero_grad(set_to_none=True)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            loss = F.mse_loss(run(model, inputs), inputs["target"])
            loss.backward()
            optimizer.step()
        print(f"\n### profile: {side} (one step, top {rows} by self CPU time)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each model (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each model first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (fixed)")
    parser.add_argument("--profile", action="store_true", help="also print a torch.profiler table per model")
    parser.add_argument("--profile-rows", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = os.getloadavg()

    ours, theirs = build_models(GEOMETRY)
    inputs = make_inputs(torch.Generator().manual_seed(SEED))
    relative, scale = check(ours, theirs, inputs)
    print(f"forward check (eval, no grad): max |videodit - diffusers| / max |diffusers| = {relative:.2e} "
          f"(outputs up to {scale:.2f})", flush=True)
    if relative > 1e-5:
        sys.exit("videodit and diffusers disagree: the weight conversion or the model is wrong")

    models = {"videodit": (ours, run_ours)}
    models["diffusers"] = (theirs, run_theirs)
    sides = {side: (model, run, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01))
             for side, (model, run) in models.items()}
    records = {side: [] for side in sides}
    for rep in range(args.warmup + args.steps):
        for side, (model, run, optimizer) in sides.items():
            record = train_step(model, run, optimizer, inputs)
            if rep >= args.warmup:
                records[side].append(record)
        print(f"  step {rep}{' (warm-up)' if rep < args.warmup else ''}: " + ", ".join(
            f"{side} {records[side][-1]['total']:.3f} s" if rep >= args.warmup else side for side in sides),
            flush=True)
    load_after = os.getloadavg()

    def med(side, key):
        return statistics.median(r[key] for r in records[side])

    paired = {side: statistics.median(a["total"] / b["total"] for a, b in zip(records[side], records["diffusers"]))
              for side in sides if side != "diffusers"}
    loss_diff = max(abs(a["loss"] - b["loss"]) / b["loss"] for side in paired
                    for a, b in zip(records[side], records["diffusers"]))
    params = sum(p.numel() for p in ours.parameters())
    b, c, t, h, w = LATENT
    pt, ph, pw = GEOMETRY.patch_size
    tokens = (t // pt) * (h // ph) * (w // pw)
    print(f"\nWan geometry: dim {GEOMETRY.dim}, {GEOMETRY.num_heads} heads of {GEOMETRY.head_dim}, "
          f"{GEOMETRY.num_layers} layers, ffn {GEOMETRY.ffn_dim}, text_dim {GEOMETRY.text_dim}, patch "
          f"{pt}x{ph}x{pw}; {params:,} parameters (both sides)")
    print(f"latents {b} x {c} x {t} x {h} x {w} ({tokens} tokens per sample, {b * tokens} in the batch), context "
          f"{b} x {layouts.DIFFUSERS_TEXT_LEN} x {GEOMETRY.text_dim} (captions of {', '.join(map(str, CAPTION_TOKENS))}"
          f" tokens zero-padded), fp32, {torch.get_num_threads()} thread(s), torch {torch.__version__}, "
          f"diffusers {__import__('diffusers').__version__}; median of {args.steps} interleaved steps after "
          f"{args.warmup} warm-up; loadavg {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print("\n| model | ms/step median | ms/step min | ratio to diffusers | forward ms | backward ms | AdamW ms "
          "| CPU ms/step median | CPU ratio | peak RSS delta MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = med("diffusers", "total")
    for side in sides:
        rss = [r["rss"] for r in records[side] if r["rss"] is not None]
        rss_text = f"{statistics.median(rss):.0f}" if rss else "n/a"
        ratio = med(side, "total") / base
        print(f"| {side} | {1000 * med(side, 'total'):.0f} | {1000 * min(r['total'] for r in records[side]):.0f} "
              f"| **{ratio:.3f}** | {1000 * med(side, 'forward'):.0f} | {1000 * med(side, 'backward'):.0f} "
              f"| {1000 * med(side, 'optimizer'):.0f} | {1000 * med(side, 'cpu'):.0f} "
              f"| {med(side, 'cpu') / med('diffusers', 'cpu'):.3f} | {rss_text} |")
    print("\nmedian of paired ratios (each step / the diffusers step of the same round): "
          + "; ".join(f"{side} {ratio:.3f}" for side, ratio in paired.items())
          + f"\nlargest loss rel. diff to diffusers: {loss_diff:.1e}")
    if args.profile:
        profile(sides, inputs, args.profile_rows)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
