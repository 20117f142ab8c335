"""Print docs/ltx2.md's memory tables for LTX-2.3 22B (predictions of `videodit plan`).

    python scripts/ltx2_plan_tables.py

At LTX's bucket, 960x544 x 49 frames (7 x 17 x 30 latents: 3,570 video tokens, 1,024 text tokens),
bf16, every block checkpointed (the recipes'):

1. LoRA rank 32 (ltx2.3-22b-lora) on one GPU: the base in bf16, in fp8 (``lora.base_dtype=fp8``),
   and in fp8 with K of the 48 blocks' frozen weights swapped from host memory
   (``memory.swap_blocks``); the encoders cached by ``videodit cache build`` (Gemma 3 12B alone is
   ~23 GiB in bf16), and, in the first row, on the GPU;
2. the full fine-tune (ltx2.3-22b-finetune) on 8 GPUs, FSDP2 over all 8, with and without
   sequence parallelism and 8-bit AdamW, the encoders cached.

Each cell: the largest batch per GPU (its batch-1 peak in GiB beside it), or, where batch 1 does
not fit, the planner's cheapest fix. The planner's 10% margin applies (24 GiB: 21.6 GiB usable).
Offline: nothing is loaded but the config.

The planner does not know LTX-2's encoders yet (``vae.kind: ltx2``, ``text.kind: gemma3-ltx2``):
their geometry is given here as ``videodit plan --latent 128,8,32 --caption 4096,1024`` gives it.
Under checkpointing the planner's LTX-2 activations are not yet held to 5% of a measurement
(tests/planner/test_ltx2_plan.py): the checkpointed blocks' inputs include the per-token
modulation, which the profile does not count.
"""

from __future__ import annotations

from videodit.config import load_config
from videodit.planner.plan import LatentGeometry, planner_from_config

GIB = 2**30
LATENT = LatentGeometry(128, 8, 32)          # LTX-2's video VAE: 128 channels, 8 x 32 x 32, causal
CAPTION = (4096, 1024)                       # LTX-2.3's connectors: 1024 tokens as wide as the video stream
SHAPE = (49, 544, 960)                       # frames, height, width
# Gemma 3 12B (12.19B parameters) + the release's text side (connectors and feature projection, 3.17B)
# + the video VAE (1.22B, diffusers' AutoencoderKLLTX2Video), all bf16
ENCODERS_ON_GPU = int((12.19e9 + 3.17e9 + 1.22e9) * 2)
GPU_SIZES = (24, 32, 48, 80)
SWAPS = (16, 32, 48)

LORA_ROWS = [("bf16 base, encoders on the GPU", [], ENCODERS_ON_GPU),
             ("bf16 base", [], 0),
             ("fp8 base", ["lora.base_dtype=fp8"], 0)] + [
            (f"fp8 base + swap {k}", ["lora.base_dtype=fp8", f"memory.swap_blocks={k}"], 0) for k in SWAPS]
FINETUNE_ROWS = [("AdamW", []), ("AdamW, sp 2", ["parallel.sp=2"]), ("AdamW, sp 4", ["parallel.sp=4"]),
                 ("8-bit AdamW", ["train.optimizer=adamw8bit"]),
                 ("8-bit AdamW, sp 2", ["train.optimizer=adamw8bit", "parallel.sp=2"])]


def cells(recipe: str, overrides: list[str], gpus: int, encoders: int) -> tuple[float, list[str]]:
    cfg = load_config(recipe, overrides)
    out, peak = [], None
    for size in GPU_SIZES:
        planner = planner_from_config(cfg, size * GIB, world_size=gpus, latent=LATENT, caption=CAPTION,
                                      encoder_bytes=encoders)
        peak = planner.estimate(1, *SHAPE).peak / GIB
        best = planner.max_batch(*SHAPE)
        out.append(str(best) if best else f"0 ({planner.cheapest_fix(*SHAPE) or 'no fix'})")
    return peak, out


def table(title: str, rows) -> None:
    print(f"\n**{title}**\n")
    print("| setting | batch-1 peak GiB | " + " | ".join(f"max batch {g} GiB" for g in GPU_SIZES) + " |")
    print("|---|---:|" + "---:|" * len(GPU_SIZES))
    for label, peak, row in rows:
        print(f"| {label} | {peak:.1f} | " + " | ".join(row) + " |")


def fewest_swapped(size: int, bf16_base: bool = False) -> int | None:
    """The fewest blocks ``memory.swap_blocks`` must hold for batch 1 of the LoRA recipe to fit on
    a ``size`` GiB GPU (fp8 base unless ``bf16_base``), or None if none does."""
    cfg = load_config("ltx2.3-22b-lora", [] if bf16_base else ["lora.base_dtype=fp8"])
    planner = planner_from_config(cfg, size * GIB, world_size=1, latent=LATENT, caption=CAPTION, encoder_bytes=0)
    return next((k for k in range(49) if planner.max_batch(*SHAPE, levers={"swap_blocks": k})), None)


def main() -> None:
    lora = [(label, *cells("ltx2.3-22b-lora", overrides, 1, encoders)) for label, overrides, encoders in LORA_ROWS]
    table("LTX-2.3 22B, LoRA rank 32, 1 GPU, 960x544 x 49", lora)
    fewest = [f"{size} GiB: fp8 base {fewest_swapped(size)}, bf16 base {fewest_swapped(size, True)}"
              for size in (16, 24, 32)]
    print("\nfewest swapped blocks for batch 1 (encoders cached): " + "; ".join(fewest))
    full = [(label, *cells("ltx2.3-22b-finetune", overrides, 8, 0)) for label, overrides in FINETUNE_ROWS]
    table("LTX-2.3 22B, full fine-tune (video stream), 8 GPUs, FSDP2 over 8, 960x544 x 49", full)


if __name__ == "__main__":
    main()
