"""Write a small run folder with the OLD (pre-restructuring) code, as a resume fixture.

    python scripts/make_legacy_run.py OLD_CHECKOUT OUT_DIR

OLD_CHECKOUT is a checkout of the old code (e.g. ``git worktree add /tmp/legacy 66be50c``).
The old code trains a tiny model for 4 steps on a tiny toy dataset, saving checkpoints at steps
2 and 4 and keeping the newest (``checkpoint.save_total_limit=1``, to keep the fixture small).
OUT_DIR receives the run folder without its sample videos and without the toy data
(``data.csv`` stays the relative ``videodit-toy/train.csv`` with ``data.make_toy_if_missing``,
so a resume run from a working directory without it regenerates the same toy clips). A
README.md in OUT_DIR records the commit and the exact command.

tests/train/test_legacy_resume.py resumes this fixture with the current code.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TRAIN_ARGS = [
    "train", "tiny",
    "model.depth=1", "model.hidden_size=16", "model.num_heads=2", "model.mlp_ratio=1", "text.dim=8",
    "data.num_frames=4", "data.frame_interval=1", "data.height=16", "data.width=16",
    "toy.clips_per_combination=1", "toy.num_frames=4",
    "train.max_steps=4", "train.batch_size=2", "train.warmup_steps=2", "train.log_every=1",
    "train.device=cpu", "train.precision=fp32", "train.threads=2",
    "checkpoint.every_steps=2", "checkpoint.save_total_limit=1",
    "validation.csv=null",
    "sample.steps=2", "sample.prompts=[a red circle moving right]",
]

# What the fixture keeps of the run folder (samples and toy videos are left out).
KEEP = ("config.yaml", "run_info.json", "metrics.jsonl", "checkpoints.jsonl", "checkpoints")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="checkout of the old code")
    parser.add_argument("out", type=Path, help="fixture folder to write (replaced if it exists)")
    ns = parser.parse_args(argv)
    checkout = ns.checkout.resolve()
    if not (checkout / "videodit" / "__init__.py").is_file():
        parser.error(f"{checkout} holds no videodit package")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True,
                            text=True).stdout.strip() or "unknown"

    env = dict(os.environ, PYTHONPATH=str(checkout), CUDA_VISIBLE_DEVICES="", PYTHONHASHSEED="0")
    with tempfile.TemporaryDirectory(prefix="legacy-run-") as tmp:
        command = [sys.executable, "-m", "videodit", *TRAIN_ARGS, "--out", "run"]
        print("running:", shlex.join(command), f"(cwd {tmp}, PYTHONPATH={checkout})", flush=True)
        subprocess.run(command, cwd=tmp, env=env, check=True)
        run = Path(tmp) / "run"
        out = ns.out
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for name in KEEP:
            source = run / name
            if source.is_dir():
                shutil.copytree(source, out / name)
            elif source.is_file():
                shutil.copy2(source, out / name)

    shown = shlex.join(["python", "-m", "videodit", *TRAIN_ARGS, "--out", "run"])
    (out / "README.md").write_text(
        f"# Legacy run fixture ({commit[:7]})\n\n"
        f"Written by the code of commit `{commit}` (before the package restructuring) with\n"
        f"`scripts/make_legacy_run.py`, which ran, in an empty temporary directory with\n"
        f"`PYTHONPATH` set to that checkout (and `CUDA_VISIBLE_DEVICES=` so it ran on CPU):\n\n"
        f"    {shown}\n\n"
        "Kept: `config.yaml`, `run_info.json`, `metrics.jsonl`, `checkpoints.jsonl` and\n"
        "`checkpoints/step-0000004` (step 2 was saved, then removed by `save_total_limit=1`).\n"
        "Left out: the sample videos and the toy dataset; `data.csv` is the relative\n"
        "`videodit-toy/train.csv` with `data.make_toy_if_missing`, so\n"
        "training from a working directory without it regenerates the same toy clips\n"
        "(`toy.clips_per_combination=1`, `toy.num_frames=4`, seed 0).\n\n"
        "`tests/train/test_legacy_resume.py` resumes it with the current code (`resume=auto`).\n")
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
