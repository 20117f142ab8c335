"""Decode speed: the training data pipeline against tuned raw PyAV on the same files and frames.

    python benchmarks/decode.py [--size 128] [--frames 16] [--long-frames 240]
                                [--clips-per-combination 6] [--batch-size 16] [--workers 0 2]
                                [--repeats 5] [--memory-frames 1500]

Two toy datasets (``make_toy_dataset``, 54 seen combinations x clips-per-combination mp4
clips of ``size x size``) are written to a temporary folder:

* short: clips of ``--frames`` frames; the pipeline takes every frame;
* long: clips of ``--long-frames`` frames; the pipeline takes a ``--frames``-frame window
  at a random start (``frame_interval`` 1), so it decodes from the keyframe before it.

For each dataset, in one run and interleaved (A, B, C, A, B, C, ...; best of ``--repeats``):

* raw PyAV (the reference, ratio 1): for every sample the pipeline delivers in the epoch
  (same files, same frame numbers, same order) ``av.open``, seek to the keyframe before
  the first wanted frame (long clips; frame numbers from pts, the clips being constant
  rate), decode up to the last wanted frame and ``to_ndarray(format="rgb24", threads=1)``
  each wanted frame: no stacking, no float conversion. A second row with FFmpeg frame
  threading (``thread_type="AUTO"``); the faster raw row is the reference;
* pipeline: ``build_training_data`` from the ``tiny`` config with the clips' size as the
  bucket (no resize), built before the clock starts; one epoch of its DataLoader with
  ``data.num_workers`` = each of ``--workers``: read_video + frame sampling + float
  conversion/normalisation + collate (+ starting the workers and the transfer from them).

``ratio`` = pipeline clips/s / reference clips/s. Raw rows run in one process; DataLoader
workers are extra processes, whose CPU time is counted in ``CPU ms/clip``. The machine may
be shared: compare rows of one run only. ``--memory-frames``: peak memory (RSS growth, in a
fresh process) of one ``read_video`` of a 256x256 clip that long, whole vs a window of
``--frames`` frames from its middle.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import av
import numpy as np
import torch

from videodit.config import load_config
from videodit.data.dataset import sample_frame_indices
from videodit.data.loader import build_training_data
from videodit.data.video_write import write_video
from videodit.toy.make import make_toy_dataset, render_clip

SEED = 0


def pipeline_config(csv: str, frames: int, size: int, batch_size: int, workers: int):
    return load_config("tiny", [f"data.csv={csv}", f"data.num_frames={frames}", f"data.height={size}",
                                f"data.width={size}", "data.frame_interval=1", f"data.num_workers={workers}",
                                "data.make_toy_if_missing=false", f"train.batch_size={batch_size}"])


def epoch_samples(csv: str, frames: int, size: int, batch_size: int) -> list[tuple[str, np.ndarray]]:
    """(path, frame numbers) of every sample the pipeline delivers in epoch 0, in order."""
    data = build_training_data(pipeline_config(csv, frames, size, batch_size, 0).data,
                               batch_size=batch_size, seed=SEED)
    samples = []
    for keys in data.sampler:
        for index, epoch, _bucket in keys:
            rng = np.random.default_rng([SEED, epoch, index])   # the dataset's draw
            total = int(data.meta.num_frames[index])
            samples.append((data.meta.paths[index], sample_frame_indices(total, frames, 1, rng)))
    return samples


def raw_decode(samples: list[tuple[str, np.ndarray]], thread_type: str | None = None) -> tuple[int, int]:
    """Hand-written PyAV: seek, decode to the last wanted frame, rgb24 per wanted frame."""
    delivered = 0
    for path, wanted in samples:
        counts = {int(n): int(c) for n, c in zip(*np.unique(wanted, return_counts=True))}
        first, last = min(counts), max(counts)
        with av.open(path) as container:
            stream = container.streams.video[0]
            if thread_type:
                stream.thread_type = thread_type
            ticks = float(1 / (stream.average_rate * stream.time_base))   # pts ticks per frame
            if first:
                container.seek(round(first * ticks), stream=stream, backward=True)
            number = None
            for frame in container.decode(stream):
                # Constant frame rate: the first frame's pts numbers it, the rest count on.
                number = round(frame.pts / ticks) if number is None else number + 1
                if number in counts:
                    frame.to_ndarray(format="rgb24", threads=1)
                    delivered += counts[number]
                if number >= last:
                    break
    return len(samples), delivered


def training_loader(csv: str, frames: int, size: int, batch_size: int, workers: int):
    cfg = pipeline_config(csv, frames, size, batch_size, workers)
    return build_training_data(cfg.data, batch_size=batch_size, seed=SEED).loader


def pipeline_decode(loader, frames: int, size: int) -> tuple[int, int]:
    """One epoch of the training DataLoader (worker start included); returns (clips, frames)."""
    clips = delivered = 0
    for batch in loader:
        video = batch.video   # [B, C, T, H, W]
        assert video.shape[1:] == (3, frames, size, size) and not batch.failed, (video.shape, batch.failed)
        clips += video.shape[0]
        delivered += video.shape[0] * video.shape[2]
    return clips, delivered


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (DataLoader workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def interleaved_best(repeats: int, runs: dict) -> dict:
    """Best (seconds, cpu seconds, clips, frames) of each run, the runs interleaved so that
    load from other processes hits all of them alike."""
    best = {}
    for _ in range(repeats):
        for name, (fn, args) in runs.items():
            start, cpu = time.perf_counter(), cpu_seconds()
            clips, frames = fn(*args)
            seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, cpu, clips, frames)
    return best


def measure(name: str, csv: str, args) -> list[tuple]:
    samples = epoch_samples(csv, args.frames, args.size, args.batch_size)
    runs = {"raw PyAV, rgb24 threads=1": (raw_decode, (samples,)),
            "raw PyAV, + thread_type=AUTO": (raw_decode, (samples, "AUTO"))}
    for workers in args.workers:
        loader = training_loader(csv, args.frames, args.size, args.batch_size, workers)
        runs[f"pipeline, num_workers={workers}"] = (pipeline_decode, (loader, args.frames, args.size))
    best = interleaved_best(args.repeats, runs)
    reference = max(clips / seconds for key, (seconds, _, clips, _) in best.items() if key.startswith("raw"))
    return [(name, key, seconds, cpu, clips, frames, clips / seconds / reference)
            for key, (seconds, cpu, clips, frames) in best.items()]


_PEAK_RSS = """
import json, sys
from videodit.data.video import read_video
def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key))
    return int(line.split()[1]) / 1024
before = status("VmRSS:")
read_video(sys.argv[1], indices=json.loads(sys.argv[2]))
print(status("VmHWM:") - before)
"""


def peak_memory(frames: int, window: int) -> tuple[float, float]:
    """Peak RSS growth (MB) of read_video on a frames-long 256x256 clip, whole and a window,
    each in a fresh process (frame buffers live in FFmpeg's memory, which tracemalloc misses)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "long.mp4"
        clip = render_clip("red", "circle", "right", frames, 256, 256, np.random.default_rng(0))
        write_video(path, clip, fps=24)
        del clip
        peaks = []
        for indices in (None, list(range(frames // 2, frames // 2 + window))):
            out = subprocess.run([sys.executable, "-c", _PEAK_RSS, str(path), json.dumps(indices)],
                                 capture_output=True, text=True, check=True).stdout
            peaks.append(float(out))
    return peaks[0], peaks[1]


def print_table(rows: list[tuple]) -> None:
    print(f"| dataset | {'reader':<30} | clips | seconds | clips/s | frames/s | CPU ms/clip | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for dataset, key, seconds, cpu, clips, frames, ratio in rows:
        print(f"| {dataset} | {key:<30} | {clips} | {seconds:.2f} | {clips / seconds:.1f} | "
              f"{frames / seconds:.0f} | {1000 * cpu / clips:.2f} | **{ratio:.2f}** |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=128, help="clip height and width (even)")
    parser.add_argument("--frames", type=int, default=16, help="frames per sample (and per short clip)")
    parser.add_argument("--long-frames", type=int, default=240, help="frames per long clip (0: skip)")
    parser.add_argument("--clips-per-combination", type=int, default=6, help="clips per dataset = 54 x this")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--repeats", type=int, default=5, help="runs per measurement; the best counts")
    parser.add_argument("--memory-frames", type=int, default=1500, help="long clip for the memory figure (0: skip)")
    args = parser.parse_args()

    print(f"{os.cpu_count()} CPU cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"PyAV {av.__version__} (FFmpeg {av.ffmpeg_version_info}), batch {args.batch_size}, "
          f"best of {args.repeats}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        lengths = {"short": args.frames, "long": args.long_frames}
        for name, length in lengths.items():
            if not length:
                continue
            made = make_toy_dataset(Path(tmp) / name, clips_per_combination=args.clips_per_combination,
                                    num_frames=length, height=args.size, width=args.size, seed=0)
            print(f"{name}: {made['num_train']} clips of {length}x{args.size}x{args.size}, "
                  f"{args.frames} frames per sample (generated in {made['seconds']:.1f} s)")
            rows += measure(name, made["train_csv"], args)
    print()
    print_table(rows)
    print("\nratio = clips/s / the faster raw row's clips/s, per dataset; CPU = this process and its "
          "DataLoader workers (raw rows: one process)")
    if args.memory_frames:
        whole, window = peak_memory(args.memory_frames, args.frames)
        print(f"\npeak memory (RSS growth) of read_video on a {args.memory_frames}x256x256 clip: "
              f"whole {whole:.0f} MB, {args.frames}-frame window {window:.0f} MB")


if __name__ == "__main__":
    main()
