"""Print docs/opensora2.md's plan tables for Open-Sora 2.0's stage 1 (predictions of `videodit plan`).

    python scripts/opensora2_plan_tables.py [RECIPE]

For each bucket of the recipe (256px clips at the longest clip of each of Open-Sora's batch groups,
768px and 1024px images), the largest batch per GPU next to Open-Sora's own (stage1.py, searched on
an H200): on 141 GiB (H200) and 80 GiB (H100), with Open-Sora's checkpointing of the first 8 double
and every single block ("(8, 100)"), with every block checkpointed ("all"), and with sequence
parallelism. One node of 8 GPUs (FSDP2 over all 8, weights kept gathered as ZeRO-2) and the planner's
10% margin, except the first column (64 GPUs, the whole GPU: closer to how Open-Sora searched). The
frozen encoders are on the GPU (T5-XXL and CLIP-L's text tower in bf16 and the Hunyuan VAE: 9.6 GiB).
Each cell: the largest batch per GPU (its predicted peak in GiB). Offline: nothing is loaded but the
config.
"""

from __future__ import annotations

import sys

from videodit.config import load_config
from videodit.planner.plan import bucket_rows, plan_buckets, planner_from_config

GIB = 2**30
ENCODERS = int(9.6 * GIB)   # T5-XXL encoder 8.9 GiB + CLIP-L text 0.2 GiB (bf16) + Hunyuan VAE 0.5 GiB
GPUS = 8
# (label, GPU GiB, GPUs, margin, overrides)
ALL = "memory.checkpoint_blocks={double: 100, single: 100}"
COLUMNS = [
    ("141 GiB, 64 GPUs, no margin", 141, 64, 0.0, []),   # as Open-Sora searched: the whole GPU, sharded wide
    ("141 GiB, (8, 100)", 141, GPUS, 0.1, []),
    ("141 GiB, all", 141, GPUS, 0.1, [ALL]),
    ("80 GiB, (8, 100)", 80, GPUS, 0.1, []),
    ("80 GiB, all", 80, GPUS, 0.1, [ALL]),
    ("80 GiB, all, sp 2", 80, GPUS, 0.1, [ALL, "parallel.sp=2", "parallel.sp_ring=2"]),
]
SHOWN_FRAMES = {"256px": (1, 5, 33, 37, 65, 69, 97, 101, 129)}   # Open-Sora's batch groups, both ends


def main(recipe: str = "opensora-v2-stage1") -> None:
    cells: dict[tuple[str, int], list[str]] = {}
    info: dict[tuple[str, int], tuple[int, int | None]] = {}
    for _, gpu, gpus, margin, overrides in COLUMNS:
        cfg = load_config(recipe, overrides)
        planner = planner_from_config(cfg, gpu * GIB, world_size=gpus, margin=margin, encoder_bytes=ENCODERS)
        for plan in plan_buckets(planner, bucket_rows(cfg)):
            key = (plan.resolution, plan.num_frames)
            if plan.num_frames not in SHOWN_FRAMES.get(plan.resolution, (plan.num_frames,)):
                continue
            info[key] = (plan.tokens, plan.config_batch_size)
            peak = plan.estimate.peak / GIB
            cell = f"{plan.max_batch_size} ({peak:.0f})" if plan.max_batch_size else f"0: {plan.fix or 'no fix'}"
            cells.setdefault(key, []).append(cell)
    print(f"| bucket | image tokens | Open-Sora (H200) | {' | '.join(column[0] for column in COLUMNS)} |")
    print("|---" * (3 + len(COLUMNS)) + "|")
    for (resolution, frames), row in sorted(cells.items(), key=lambda item: (item[0][0] != "256px", item[0][1])):
        tokens, theirs = info[(resolution, frames)]
        print(f"| {resolution} x {frames} | {tokens:,} | {theirs} | {' | '.join(row)} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
