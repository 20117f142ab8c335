"""Kill ``videodit cache build`` with SIGKILL at random moments, start it again each time, and
check that the finished cache is byte for byte the cache of an uninterrupted build.

    python scripts/kill_cache_build.py --kills 10

Each kill waits for 0-2 more finished shards, then a random moment within the next shard;
every other kill waits for a write in progress (a temporary file in the cache), so about half
of them land while a shard or the index is being written (the output counts them). The build
is the tiny toy config (identity VAE, toy text encoder) with its validation set, in shards of
4 samples.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build_command(out: Path, toy: Path) -> list[str]:
    overrides = [f"data.csv={toy / 'train.csv'}", f"validation.csv={toy / 'val.csv'}", "validation.max_samples=40",
                 "data.num_frames=4", "data.frame_interval=1", "data.height=16", "data.width=16", "train.threads=1"]
    return [sys.executable, "-m", "videodit", "cache", "build", "tiny", *overrides, "--out", str(out),
            "--shard-size", "4", "--batch-size", "4"]


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def finished_shards(out: Path) -> int:
    return sum(len(list((d / "shards").glob("shard-*.parquet"))) for d in (out, out / "validation")
               if (d / "shards").is_dir())


def writing_now(out: Path, pid: int) -> bool:
    """Whether process ``pid`` has a temporary file open (leftovers of killed builds do not count)."""
    folders = (out, out / "shards", out / "validation", out / "validation" / "shards")
    return any(p.name.endswith(f".tmp-{pid}") for d in folders if d.is_dir() for p in d.iterdir())


def complete(out: Path) -> bool:
    return (out / "index.parquet").is_file() and (out / "validation" / "index.parquet").is_file()


def run_with_kills(out: Path, toy: Path, kills: int, rng: random.Random, log=print) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stats = {"kills": 0, "during_write": 0, "starts": 0}
    while True:
        stats["starts"] += 1
        errors = tempfile.TemporaryFile()
        proc = subprocess.Popen(build_command(out, toy), stdout=subprocess.DEVNULL, stderr=errors, env=env)
        if stats["kills"] < kills:
            target = finished_shards(out) + rng.randint(0, 2)
            aim_at_write = stats["kills"] % 2 == 1
            deadline = time.time() + 120
            while proc.poll() is None and time.time() < deadline and finished_shards(out) < target:
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.15))
            while aim_at_write and proc.poll() is None and time.time() < deadline and not writing_now(out, proc.pid):
                time.sleep(0.0002)
            if proc.poll() is None:
                during = writing_now(out, proc.pid)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                stats["kills"] += 1
                stats["during_write"] += during
                log(f"kill {stats['kills']}: {finished_shards(out)} shards finished, "
                    f"{'during a write' if during else 'between writes'}")
                continue
        proc.wait()
        errors.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"cache build exited with {proc.returncode}: {errors.read().decode()[-3000:]}")
        if complete(out):
            return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from videodit.toy.make import make_toy_dataset

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_toy_dataset(tmp / "toy", clips_per_combination=3, num_frames=8, height=16, width=16)
        straight = tmp / "straight"
        subprocess.run(build_command(straight, tmp / "toy"), check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        killed = tmp / "killed"
        started = time.time()
        stats = run_with_kills(killed, tmp / "toy", args.kills, random.Random(args.seed))
        a, b = digests(straight), digests(killed)
        identical = a == b
        manifest = json.loads((straight / "manifest.json").read_text())
        print(json.dumps({**stats, "files": len(a), "shards": manifest["shards"], "samples": manifest["items"],
                          "identical": identical, "differing": sorted(k for k in set(a) | set(b)
                                                                      if a.get(k) != b.get(k))[:5],
                          "seconds": round(time.time() - started, 1)}))
        return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
