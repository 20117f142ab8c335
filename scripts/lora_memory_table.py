"""Print the table of docs/memory.md "Full fine-tuning vs LoRA": Open-Sora 1.2 (XL, the built-in
``opensora-v1.2-stage1`` config: bf16, full checkpointing, EMA) on one GPU, per bucket, the
largest batch the planner fits for full fine-tuning and LoRA, with the frozen encoders on the GPU
(10 GB, as in the stage-1 table) or cached (0 bytes), at 24, 48 and 80 GiB.

    python scripts/lora_memory_table.py [--rank 16] [extra key=value overrides]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json

from videodit.cli import main

GPUS = (24, 48, 80)
MODES = (("full", []), ("LoRA", None))
ENCODERS = (("Frozen encoders on the GPU (10 GB, as in the stage-1 table)", ["--encoder-mem", "10GB"]),
            ("Features cached (`data.cache` or `--encoders-cached`: encoders 0 bytes)", ["--encoders-cached"]))


def plan(overrides: list[str], gpu: int, encoders: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "opensora-v1.2-stage1", *overrides, "--gpu-mem", f"{gpu}GiB", "--latent",
                     "opensora-v1.2", "--caption", "4096,300", "--json", *encoders]) == 0
    return json.loads(out.getvalue())


def main_() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    for label, encoders in ENCODERS:
        rows: dict = {}
        for mode, overrides in MODES:
            overrides = [f"lora.rank={args.rank}"] if overrides is None else overrides
            for gpu in GPUS:
                for b in plan(overrides + args.overrides, gpu, encoders)["buckets"]:
                    rows.setdefault((b["resolution"], b["num_frames"]), []).append(b["max_batch_size"] or "-")
        print(f"{label}:\n")
        print("| bucket | " + " | ".join(f"{mode} {gpu} GiB" for mode, _ in MODES for gpu in GPUS) + " |")
        print("|---|" + "---:|" * (len(MODES) * len(GPUS)))
        for (resolution, frames), values in rows.items():
            print(f"| {resolution} x {frames} | " + " | ".join(map(str, values)) + " |")
        print()


if __name__ == "__main__":
    main_()
