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
model's output. The timing (interleaved steps, medians, paired ratios, CPU time, peak RSS growth,
``--profile``) is ``step_race.py``'s, shared with ``mmdit_step.py``.

``--threads`` defaults to 1: on a 2-core machine that other jobs share, 2 intra-op threads make
steps slower and noisier (see the Open-Sora step benchmark).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from diffusers import WanTransformer3DModel  # noqa: E402
from make_wan_fixtures import randomize  # noqa: E402  (the fixtures' weights: nothing zero or one)
import step_race  # noqa: E402  (benchmarks/, this script's folder)

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    step_race.add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = os.getloadavg()

    ours, theirs = build_models(GEOMETRY)
    inputs = make_inputs(torch.Generator().manual_seed(SEED))
    sides = {"videodit": (ours, run_ours), "diffusers": (theirs, run_theirs)}
    relative, scale = step_race.forward_error(sides["videodit"], sides["diffusers"], inputs)
    print(f"forward check (eval, no grad): max |videodit - diffusers| / max |diffusers| = {relative:.2e} "
          f"(outputs up to {scale:.2f})", flush=True)
    if relative > 1e-5:
        sys.exit("videodit and diffusers disagree: the weight conversion or the model is wrong")

    records = step_race.race(sides, inputs, args.steps, args.warmup, args.profile_rows if args.profile else 0)
    load_after = os.getloadavg()
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
    step_race.print_table(records, "diffusers")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
