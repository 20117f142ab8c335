"""Print docs/memory.md's DMD2 tables (predictions of `videodit plan`): Wan 2.1 T2V 1.3B and 14B
distilled with DMD2 at 480p (832x480) x 81 frames, bf16, on 24/48/80 GiB GPUs, 1 GPU and 8 (DDP),
with full-weight roles and with shared-base LoRA roles (``lora.rank=64``).

    python scripts/distill_plan_tables.py

Every row is the recipe ``wan2.1-t2v-1.3b-finetune`` (480p x 81, bf16, memory.checkpointing=full,
EMA off; its model.init_from is the teacher) with ``distill.method=dmd2`` and the row's levers that
DMD2 takes: checkpointing (the recipe's), 8-bit AdamW (student and critic), activation offload.
8 GPUs is DDP (``parallel.dp_shard=1 parallel.dp_replicate=8``: every role whole on each GPU) or
FSDP2 (``parallel.dp_shard=8``: every role sharded like the student). Features cached (``--encoders-cached``; umT5-XXL on the GPU would add
~10.6 GiB). Each cell: the largest batch per GPU, or 0 and the batch-1 peak. Offline: nothing is
loaded but the config. Under each table: its least batch-1 peak and the state in it.
"""

from __future__ import annotations

import shlex

from videodit.config import load_config
from videodit.planner.plan import planner_from_config

GIB = 2**30
RECIPE = "wan2.1-t2v-1.3b-finetune"
SHAPE = (81, 480, 832)                       # frames, height, width
GPU_SIZES = (24, 48, 80)
MODELS = {"Wan 2.1 T2V 1.3B": ["distill.method=dmd2"],
          "Wan 2.1 T2V 14B": ["model.preset=wan2.1-t2v-14b", "distill.method=dmd2"]}
LEVERS = [("AdamW (recipe)", []), ("8-bit AdamW", ["train.optimizer=adamw8bit"]),
          ("8-bit AdamW + offload", ["train.optimizer=adamw8bit", "memory.offload=true"])]
# Shared-base LoRA (train/shared_base.py): student and critic are rank-64 adapters of the teacher's
# frozen bf16 weights; 8-bit moments save little on adapters.
SHARED_BASE = ["lora.rank=64"]
SHARED_BASE_LEVERS = [("AdamW (recipe)", []), ("offload", ["memory.offload=true"])]
LAYOUTS = [(1, [], ""), (8, ["parallel.dp_shard=1", "parallel.dp_replicate=8"], "DDP"),
           (8, ["parallel.dp_shard=8"], "FSDP2")]


def command(overrides: list[str], gpus: int) -> str:
    """The row's command; the cells are its --gpu-mem 24GiB, 48GiB and 80GiB."""
    return shlex.join(["videodit", "plan", RECIPE, *overrides, "--gpu-mem", "24GiB", "--encoders-cached"]
                      + (["--world-size", str(gpus)] if gpus > 1 else []))


def state_bytes(e) -> int:
    """Student, critic and teacher state: everything but the graded pass and the encoders."""
    return e.peak - e.activations - e.temporaries - e.passes - e.encoders


def table(name: str, model: list[str], levers: list[tuple[str, list[str]]], roles: str) -> None:
    print(f"\n**{name}, DMD2 ({roles}), 480p x 81, bf16, full checkpointing**\n")
    print("| levers | GPUs | batch-1 peak GiB | max batch 24 GiB | 48 GiB | 80 GiB |")
    print("|---|---|---:|---:|---:|---:|")
    commands, smallest = [], None
    for label, lever in levers:
        for gpus, layout, label_layout in LAYOUTS:
            overrides = model + lever + layout
            cfg = load_config(RECIPE, overrides)
            cells, peak = [], None
            for size in GPU_SIZES:
                planner = planner_from_config(cfg, size * GIB, world_size=gpus, encoder_bytes=0)
                e = planner.estimate(1, *SHAPE)
                peak = e.peak / GIB
                cells.append(str(planner.max_batch(*SHAPE)))
                if smallest is None or e.peak < smallest.peak:
                    smallest = e
            print(f"| {label} | {gpus} {label_layout} | {peak:.1f} | " + " | ".join(cells) + " |")
            commands.append(command(overrides, gpus))
    e = smallest
    print(f"\nleast batch-1 peak: {e.peak / GIB:.1f} GiB, of which state (student, critic, teacher) "
          f"{state_bytes(e) / GIB:.1f} GiB, graded pass {(e.activations + e.temporaries + e.passes) / GIB:.1f} GiB")
    print("\nthe rows' commands (the cells: --gpu-mem 24GiB, 48GiB, 80GiB):")
    print("\n".join(f"    {c}" for c in commands))


def main() -> None:
    for name, model in MODELS.items():
        table(name, model, LEVERS, "full weights: student, critic, teacher")
        table(name, model + SHARED_BASE, SHARED_BASE_LEVERS, "shared-base LoRA rank 64: one bf16 base, two adapters")


if __name__ == "__main__":
    main()
