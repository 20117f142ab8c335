"""Training data pipeline decode throughput against raw PyAV decoding of the same files.

    python benchmarks/dataloader.py [--size 128] [--frames 16] [--clips-per-combination 6]
                                    [--batch-size 16] [--workers 0 2] [--repeats 2] [--threads 0]

A toy dataset (``make_toy_dataset``: 54 seen combinations x clips-per-combination mp4
clips of ``size x size`` and ``frames`` frames) is written to a temporary folder, then:

* raw: for each file of ``train.csv``, ``av.open`` it and decode every frame of the first
  video stream to an rgb24 ndarray (PyAV defaults, no threading options, no stacking).
  This is the reference (ratio 1). A second raw row passes ``threads=1`` to
  ``to_ndarray`` as ``read_video`` does for small frames: PyAV's default builds a
  swscale thread pool per frame, which dominates at toy sizes;
* pipeline: ``build_training_data`` from the ``tiny`` config with ``data.num_frames``,
  ``data.height`` and ``data.width`` equal to the clips' own (so every decoded frame is
  delivered and resize/crop is a no-op), iterating the DataLoader for one epoch with
  ``data.num_workers`` = each of ``--workers``. That is ``read_video`` (the sampled frames
  only) + float conversion/normalisation + batching (+ worker transfer).
  ``benchmarks/decode.py`` compares the same against tuned raw decoding of the same frames.

Each measurement is repeated ``--repeats`` times (the first repeat also warms the page
cache) and the best is reported. ``ratio`` is throughput / naive raw throughput, on
clips/s (frames/s gives the same ratio since every clip delivers all its frames).

``--threads`` sets torch's intra-op threads in this process (0 = torch's default, one
per core); DataLoader workers always use one. On a machine whose cores are busy with
other processes, OpenMP's spin-waiting barriers make multi-threaded elementwise ops in
the main process (uint8 -> float, normalise) many times slower, which shows up in the
``num_workers=0`` row only; compare ``--threads 1``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import av
import torch

from videodit.config import load_config
from videodit.data.loader import build_training_data
from videodit.data.metadata import read_metadata
from videodit.toy.make import make_toy_dataset


def raw_decode(paths: list[str], sws_threads: int | None = None) -> tuple[int, int]:
    """Decode every frame of every file with plain PyAV; returns (clips, frames)."""
    options = {} if sws_threads is None else {"threads": sws_threads}
    frames = 0
    for path in paths:
        with av.open(path) as container:
            for frame in container.decode(video=0):
                frame.to_ndarray(format="rgb24", **options)
                frames += 1
    return len(paths), frames


def pipeline_decode(csv: str, frames: int, size: int, batch_size: int, workers: int) -> tuple[int, int]:
    """One epoch of the training DataLoader; returns (clips, frames) delivered."""
    cfg = load_config("tiny", [f"data.csv={csv}", f"data.num_frames={frames}", f"data.height={size}",
                               f"data.width={size}", f"data.num_workers={workers}",
                               "data.make_toy_if_missing=false", f"train.batch_size={batch_size}"])
    data = build_training_data(cfg.data, batch_size=cfg.train.batch_size, seed=0)
    clips = delivered = 0
    for batch in data.loader:
        video = batch.video   # [B, C, T, H, W]
        assert video.shape[1:] == (3, frames, size, size) and not batch.failed, video.shape
        clips += video.shape[0]
        delivered += video.shape[0] * video.shape[2]
    return clips, delivered


def best_of(repeats: int, fn, *args) -> tuple[float, int, int]:
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        clips, frames = fn(*args)
        seconds = time.perf_counter() - start
        if best is None or seconds < best[0]:
            best = (seconds, clips, frames)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=128, help="clip height and width (even)")
    parser.add_argument("--frames", type=int, default=16, help="frames per clip")
    parser.add_argument("--clips-per-combination", type=int, default=6,
                        help="training clips = 54 x this")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2],
                        help="DataLoader num_workers values to measure")
    parser.add_argument("--repeats", type=int, default=2, help="runs per measurement; the best counts")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads in this process (0 = torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        made = make_toy_dataset(Path(tmp) / "toy", clips_per_combination=args.clips_per_combination,
                                num_frames=args.frames, height=args.size, width=args.size, seed=0)
        paths = read_metadata(made["train_csv"]).paths
        print(f"dataset: {len(paths)} training clips of {args.frames}x{args.size}x{args.size} mp4 "
              f"(generated in {made['seconds']:.1f} s); {os.cpu_count()} CPU cores, "
              f"torch threads {torch.get_num_threads()}, PyAV {av.__version__}, "
              f"batch size {args.batch_size}, best of {args.repeats}")

        results = [("raw PyAV", *best_of(args.repeats, raw_decode, paths)),
                   ("raw PyAV, sws threads=1", *best_of(args.repeats, raw_decode, paths, 1))]
        for workers in args.workers:
            results.append((f"pipeline, num_workers={workers}",
                            *best_of(args.repeats, pipeline_decode, made["train_csv"], args.frames,
                                     args.size, args.batch_size, workers)))

    raw_rate = results[0][2] / results[0][1]
    print()
    print(f"| {'reader':<26} | {'clips':>5} | {'seconds':>7} | {'clips/s':>8} | {'frames/s':>9} | {'ratio':>5} |")
    print("|" + "|".join("-" * (w + 2) for w in (26,)) + "|"
          + "|".join("-" * (w + 1) + ":" for w in (5, 7, 8, 9, 5)) + "|")
    for name, seconds, clips, frames in results:
        rate = clips / seconds
        print(f"| {name:<26} | {clips:>5} | {seconds:>7.2f} | {rate:>8.1f} | {frames / seconds:>9.0f} | "
              f"{rate / raw_rate:>5.2f} |")
    print("\nratio = clips/s / raw PyAV clips/s (raw rows: one process; DataLoader workers "
          "are extra processes)")


if __name__ == "__main__":
    main()
