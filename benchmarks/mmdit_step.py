"""One fp32 CPU training step of videodit's MMDiT vs Open-Sora 2.0's own ``MMDiTModel``.

    python benchmarks/mmdit_step.py --checkout /work/refs/opensora2 [--size S|tiny] [--steps 10]
        [--warmup 2] [--threads 1] [--profile]

The checkout is hpcaitech/Open-Sora main; ``scripts/opensora2_reference.py`` imports its MMDiT on
CPU (flash_attn as SDPA, Liger's rotate-half RoPE and llama RMSNorm in plain torch: on a GPU
Open-Sora runs Triton kernels there, so this compares the two models' own code on equal kernels).
Open-Sora's model is built in its released configuration (``fused_qkv=False``,
``use_liger_rope=True``, ``cond_embed``, qkv bias) at a smaller size, given seeded random weights
(``make_opensora2_fixtures.build``: nothing zero, not even ``cond_in``) and its state dict loaded
*strictly* into videodit's ``MMDiT``: the same function, the same FLOPs. Before timing the forward
outputs must agree to 1e-5 relative (max |diff| / max |output|).

Sizes: ``S`` is hidden 512, 8 heads of 64 (RoPE axes 16/24/24), 2 double + 4 single blocks, mlp 4,
16 latent channels with a 2x2 patch, T5's width 4096 and CLIP's 768, and a batch of 2 clips of
16 x 3 x 24 x 32 latents (576 image tokens each) with 512 caption tokens, as Open-Sora pads them:
1,088 tokens in each joint attention. ``tiny`` is a seconds-long smoke run. Both sides take the
same packed inputs: Open-Sora's ``img`` tokens with their (frame, row, column) ids, text ids 0,
t, the pooled vector and the i2v condition (frame 0 given) packed like the latents.

The loss is the MSE against a fixed random target (the same for both); the timing (interleaved
steps, medians, paired ratios, CPU time, peak RSS growth, ``--profile``) is ``step_race.py``'s.
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

import step_race  # noqa: E402  (benchmarks/, this script's folder)
from make_opensora2_fixtures import build, image_ids, make_cond, pack, unpack  # noqa: E402
from opensora2_reference import import_opensora2  # noqa: E402

from videodit.models.mmdit.model import MMDiT, MMDiTGeometry  # noqa: E402

SEED = 2024
SIZES = {   # Open-Sora's MMDiTConfig fields; latents [B, C, T, H, W]; caption tokens
    "S": (dict(hidden_size=512, num_heads=8, depth=2, depth_single_blocks=4, axes_dim=[16, 24, 24], mlp_ratio=4.0,
               vec_in_dim=768, context_in_dim=4096), (2, 16, 3, 24, 32), 512),
    "tiny": (dict(hidden_size=64, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[4, 14, 14], mlp_ratio=2.0,
                  vec_in_dim=16, context_in_dim=32), (2, 4, 2, 8, 8), 8),
}
TIMES = (0.3, 0.8)


def build_models(module, size: str):
    options, latent, _ = SIZES[size]
    channels = latent[1]
    theirs = build(module, {**options, "in_channels": channels * 4, "theta": 10000, "qkv_bias": True,
                            "guidance_embed": False, "cond_embed": True, "fused_qkv": False, "use_liger_rope": True,
                            "patch_size": 2}, SEED).train()
    ours = MMDiT(MMDiTGeometry(hidden_size=options["hidden_size"], num_heads=options["num_heads"],
                               depth=options["depth"], depth_single_blocks=options["depth_single_blocks"],
                               latent_channels=channels, mlp_ratio=options["mlp_ratio"],
                               vec_in_dim=options["vec_in_dim"], context_in_dim=options["context_in_dim"],
                               axes_dim=tuple(options["axes_dim"])))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours, theirs


def make_inputs(size: str, generator: torch.Generator) -> dict:
    options, latent, tokens = SIZES[size]
    b, _, frames, h, w = latent
    x0 = torch.randn(latent, generator=generator)
    return {"x": torch.randn(latent, generator=generator), "t": torch.tensor(TIMES[:b]),
            "y": torch.randn(b, tokens, options["context_in_dim"], generator=generator),
            "pooled": torch.randn(b, options["vec_in_dim"], generator=generator),
            "cond": make_cond("head", x0, generator), "ids": image_ids(b, frames, h, w),
            "target": torch.randn(latent, generator=generator)}


def run_ours(model, i: dict) -> torch.Tensor:
    return model(i["x"], i["t"], i["y"], i["pooled"], i["cond"])


def run_theirs(model, i: dict) -> torch.Tensor:
    b, tokens = i["y"].shape[:2]
    out = model(img=pack(i["x"]), img_ids=i["ids"], txt=i["y"], txt_ids=torch.zeros(b, tokens, 3),
                timesteps=i["t"], y_vec=i["pooled"], cond=pack(i["cond"]))
    return unpack(out, i["x"].shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", required=True, help="an Open-Sora 2.0 checkout (hpcaitech/Open-Sora main)")
    parser.add_argument("--size", choices=tuple(SIZES), default="S")
    step_race.add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_before = os.getloadavg()

    (module,) = import_opensora2(args.checkout, "models.mmdit.model")
    ours, theirs = build_models(module, args.size)
    inputs = make_inputs(args.size, torch.Generator().manual_seed(SEED))
    sides = {"videodit": (ours, run_ours), "Open-Sora 2.0": (theirs, run_theirs)}
    relative, scale = step_race.forward_error(sides["videodit"], sides["Open-Sora 2.0"], inputs)
    print(f"forward check (eval, no grad): max |videodit - Open-Sora| / max |Open-Sora| = {relative:.2e} "
          f"(outputs up to {scale:.2f})", flush=True)
    if relative > 1e-5:
        sys.exit("videodit and Open-Sora disagree: the model or the weight names are wrong")

    records = step_race.race(sides, inputs, args.steps, args.warmup, args.profile_rows if args.profile else 0)
    load_after = os.getloadavg()
    options, latent, tokens = SIZES[args.size]
    b, c, frames, h, w = latent
    image_tokens = frames * (h // 2) * (w // 2)
    print(f"\nMMDiT {args.size}: hidden {options['hidden_size']}, {options['num_heads']} heads, "
          f"{options['depth']} double + {options['depth_single_blocks']} single blocks, mlp {options['mlp_ratio']}; "
          f"{sum(p.numel() for p in ours.parameters()):,} parameters (both sides)")
    print(f"latents {b} x {c} x {frames} x {h} x {w} ({image_tokens} image + {tokens} caption tokens per sample), "
          f"i2v condition, fp32, {torch.get_num_threads()} thread(s), torch {torch.__version__}; median of "
          f"{args.steps} interleaved steps after {args.warmup} warm-up; loadavg {load_before[0]:.2f} before, "
          f"{load_after[0]:.2f} after")
    step_race.print_table(records, "Open-Sora 2.0")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
