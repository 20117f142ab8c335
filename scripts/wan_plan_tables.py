"""Print docs/wan.md's memory tables for Wan 2.2 and image-to-video (predictions of `videodit plan`).

    python scripts/wan_plan_tables.py

For each model (I2V-14B, TI2V-5B, one A14B expert, both A14B experts in one run), LoRA and full fine-tune: the predicted peak at
batch 1 and the largest batch per GPU size, with the encoders on the GPU (``--encoder-mem``) or
cached, on 1 and 8 GPUs (FSDP over every rank, sp as listed). Offline: nothing is loaded but the
config; the encoder sizes are those of the released files (docs/wan.md).
"""

from __future__ import annotations

from videodit.config import load_config
from videodit.planner.plan import planner_from_config

GIB = 2**30
UMT5_BYTES = 11.4e9
ENCODERS = {"wan2.1": UMT5_BYTES + 0.5e9, "wan2.2": UMT5_BYTES + 2.8e9}   # + the VAE in fp32
# name: (recipe, overrides, (frames, height, width), CLIP's ViT-H/14 in bf16 for I2V-14B (bytes))
MODELS = {
    "Wan 2.1 I2V-14B, 480p x 81": ("wan2.1-t2v-14b-lora", ["model.preset=wan2.1-i2v-14b",
                                                            "model.init_from=null"], (81, 480, 832), 1.3e9),
    "Wan 2.2 TI2V-5B, 1280x704 x 121": ("wan2.2-ti2v-5b-lora", ["model.init_from=null"], (121, 704, 1280), 0),
    "Wan 2.2 A14B, one expert, 480p x 81": ("wan2.2-t2v-a14b-high-lora", ["model.init_from=null"],
                                           (81, 480, 832), 0),
    "Wan 2.2 A14B, both experts in one run, 480p x 81": ("wan2.2-t2v-a14b-lora", ["model.init_from=null"],
                                                         (81, 480, 832), 0),
}
LAYOUTS = [(1, 1), (8, 1), (8, 2), (8, 4), (8, 8)]   # (GPUs, sp)
GPU_SIZES = (24, 48, 80)


def rows(recipe: str, overrides: list[str], shape, extra_encoder: float, lora: bool):
    frames, height, width = shape
    tuning = [] if lora else ["lora.rank=0", "train.lr=1e-5"]
    for cached in (False, True):
        for gpus, sp in LAYOUTS:
            cfg = load_config(recipe, overrides + tuning + [f"parallel.sp={sp}"])
            vae = cfg.vae.kind
            encoder = 0 if cached else int(ENCODERS[vae] + extra_encoder)
            cells, peak = [], None
            for size in GPU_SIZES:
                planner = planner_from_config(cfg, size * GIB, world_size=gpus, encoder_bytes=encoder)
                peak = planner.estimate(1, frames, height, width).peak / GIB
                best = planner.max_batch(frames, height, width)
                fix = "" if best else f" ({planner.cheapest_fix(frames, height, width) or 'no fix'})"
                cells.append(f"{best}{fix}")
            yield (f"| {'cached' if cached else 'on GPU'} | {gpus} | {sp} | {peak:.1f} | " + " | ".join(cells) + " |")


def main() -> None:
    for name, (recipe, overrides, shape, clip) in MODELS.items():
        for lora in (True, False):
            print(f"\n**{name}, {'LoRA rank 32' if lora else 'full fine-tune'}**\n")
            print("| encoders | GPUs | sp | batch-1 peak GiB | max batch 24 GiB | 48 GiB | 80 GiB |")
            print("|---|---|---|---|---|---|---|")
            for row in rows(recipe, overrides, shape, clip, lora):
                print(row)


if __name__ == "__main__":
    main()
