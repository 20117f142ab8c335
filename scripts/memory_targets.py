"""Print docs/memory.md's "Big models on small GPUs" table: the planner's verdict for each target
of issue 25, with the levers it needs (predictions of `videodit plan`, nothing is measured).

    python scripts/memory_targets.py

Each row starts from the recipe as shipped (encoders cached: `data.cache`, so only the DiT is on
the GPU), then adds levers in the order of their step-time cost until batch 1 fits within the
planner's 10% margin: 8-bit AdamW (full fine-tunes) or the fp8 base (LoRA), fp8 compute (full
fine-tunes), the checkpointed blocks' inputs offloaded, and the fewest swapped blocks (LoRA).
"""

from __future__ import annotations

from videodit.config import load_config
from videodit.planner.plan import planner_from_config

GIB = 2**30
# name, recipe, overrides, (frames, height, width), GPU GiB, GPUs, the levers to try in order
TARGETS = [
    ("Wan 2.1 T2V-14B, LoRA r32, cached", "wan2.1-t2v-14b-lora", [], (81, 480, 832), 24, 1,
     ["lora.base_dtype=fp8", "memory.offload=true", "swap"]),
    ("Wan 2.1 T2V-14B, LoRA r32, cached", "wan2.1-t2v-14b-lora", ["data.height=720", "data.width=1280"],
     (81, 720, 1280), 48, 1, ["lora.base_dtype=fp8", "memory.offload=true", "swap"]),
    ("Wan 2.2 A14B, LoRA r32, one expert, cached", "wan2.2-t2v-a14b-high-lora", [], (81, 480, 832), 24, 1,
     ["lora.base_dtype=fp8", "memory.offload=true", "swap"]),
    ("Wan 2.1 T2V-1.3B, full fine-tune, cached", "wan2.1-t2v-1.3b-finetune", [], (81, 480, 832), 24, 1,
     ["train.optimizer=adamw8bit", "train.fp8=true", "memory.offload=true"]),
]


def plan(recipe: str, overrides: list[str], gpus: int, gpu_gib: int):
    cfg = load_config(recipe, [*overrides, "model.init_from=null"])
    return planner_from_config(cfg, gpu_gib * GIB, world_size=gpus, encoder_bytes=0)


def fitted(recipe, overrides, shape, gpu_gib, gpus, levers):
    """(levers used, batch-1 peak GiB, fits) after adding levers until batch 1 fits."""
    used, planner = [], plan(recipe, overrides, gpus, gpu_gib)
    peak = planner.estimate(1, *shape).peak
    for lever in [None, *levers]:
        if lever == "swap":
            depth = planner.counts.depth_blocks
            for count in range(1, depth + 1):
                trial = plan(recipe, overrides + used + [f"memory.swap_blocks={count}"], gpus, gpu_gib)
                peak = trial.estimate(1, *shape).peak
                if peak <= trial.budget:
                    return used + [f"memory.swap_blocks={count}"], peak / GIB, True
            return used + [f"memory.swap_blocks={depth}"], peak / GIB, False
        if lever is not None:
            used.append(lever)
        planner = plan(recipe, overrides + used, gpus, gpu_gib)
        peak = planner.estimate(1, *shape).peak
        if peak <= planner.budget:
            return used, peak / GIB, True
    return used, peak / GIB, False


def main() -> None:
    print("| model, job | bucket | GPU | as shipped, batch-1 peak GiB | levers the planner needs | peak GiB | fits |")
    print("|---|---|---|---|---|---|---|")
    for name, recipe, overrides, shape, gpu_gib, gpus, levers in TARGETS:
        shipped = plan(recipe, overrides, gpus, gpu_gib).estimate(1, *shape).peak / GIB
        used, peak, fits = fitted(recipe, overrides, shape, gpu_gib, gpus, levers)
        frames, height, width = shape
        print(f"| {name} | {height}p x {frames}, batch 1 | {gpu_gib} GiB x {gpus} | {shipped:.1f} | "
              f"{', '.join(used) or 'none'} | {peak:.1f} | {'yes' if fits else 'no (10% margin)'} |")


if __name__ == "__main__":
    main()
