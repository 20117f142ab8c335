"""The training data pipeline at real clip sizes against a tuned raw PyAV reader (issue 27).

    python benchmarks/data_real_size.py --work /tmp/data_real_size [--datasets toy 480p-81 ...]
        [--clips 24] [--toy-clips 64] [--window 33] [--batch-size 4] [--workers 0 2]
        [--repeats 3] [--stages]

Datasets (h264 mp4, generated once into ``--work`` with PyAV/libx264 and reused): ``toy``
(128x128 x 48 frames, 16-frame windows, bucket 128x128), ``480p-81`` / ``480p-121`` (832x480 x 81
or 121 frames) and ``720p-81`` / ``720p-121`` (1280x720), whose ``--window``-frame windows go to
an 832x480 bucket: 480p clips are copied as they are, 720p ones resized (to cover, antialiased)
and cropped. The content is a panned smooth texture with a moving disc and film grain, a keyframe
every 48 frames (2 s at 24 fps), CRF 23: bitrates of ordinary footage, not of flat toy clips.

Per dataset, every configuration reads the same samples (epoch 0 of the sampler: the same
files, windows and order), round-robin over ``--repeats`` rounds after a warm-up round, so that
load from other processes hits all of them alike; the best round counts (the median is shown
beside it):

* raw PyAV (the reference: the faster of two rows): open, seek to the keyframe before the window,
  decode to its last frame, ``to_ndarray(format="rgb24")`` per wanted frame (no resize, no copy
  into a batch). Row 1 single-threaded (``threads=1``); row 2 with FFmpeg's frame threads
  (``thread_type="AUTO"``) and swscale's automatic threads;
* pipeline: ``build_training_data`` (tiny config, ``data.num_workers`` each of ``--workers``),
  iterated for epoch 0 each round: decode, resize/crop on uint8, batching, and with workers the
  transfer through shared memory. Workers persist across rounds, as across epochs in training
  (their start is the warm-up round's, shown as ``first epoch s``);
* pipeline, fresh shared memory: the same with every worker batch in new shared memory, as
  before the workers reused their buffers (``shared_slots.py``);
* pipeline, host float32 (before issue 27): the same dataset with the float path it replaced
  (``dataset.clip_tensor`` into a float32 shared-memory batch, workers restarted every epoch,
  ``prefetch_factor`` 2), for the ratio against before and the bytes.

``ratio`` = clips/s / the reference's clips/s in the same dataset; ``CPU ms/clip`` = CPU time of
this process and the DataLoader workers (steadier than wall time on a shared machine); ``host
MB/sample`` = bytes of one clip in the batch the loader hands over (through shared and pinned
memory). ``--stages``
adds a single-process breakdown per clip: raw decode, ``read_video`` (the pipeline's decode)
and ``crop_resize_uint8``, against the float path's resize + normalise.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import platform
import resource
import statistics
import subprocess
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from videodit.config import load_config
from videodit.data import dataset as dataset_module
from videodit.data.dataset import VideoDataset, clip_tensor, collate, sample_frame_indices
from videodit.data.loader import build_training_data
from videodit.data.pixels import crop_resize_uint8, to_model_input
from videodit.data.video import read_video

SEED = 0
FPS = 24
GOP = 48
# name: (width, height, frames per clip, window, bucket height, bucket width)
DATASETS = {
    "toy": (128, 128, 48, 16, 128, 128),
    "480p-81": (832, 480, 81, None, 480, 832),
    "480p-121": (832, 480, 121, None, 480, 832),
    "720p-81": (1280, 720, 81, None, 480, 832),
    "720p-121": (1280, 720, 121, None, 480, 832),
}


# --------------------------------------------------------------------------- clips


def synthetic_frames(num_frames: int, height: int, width: int, seed: int):
    """uint8 [H, W, 3] frames: a smooth random texture panned diagonally, a disc crossing it,
    grain: about the detail and motion of ordinary footage."""
    rng = np.random.default_rng(seed)
    cells = (1, 3, (height + 48) // 4 + 2, (width + 48) // 4 + 2)   # 4-pixel detail, 48 pixels to pan over
    coarse = torch.from_numpy(rng.uniform(0, 255, cells).astype(np.float32))
    texture = F.interpolate(coarse, scale_factor=4, mode="bicubic", align_corners=False)[0]
    texture = texture.clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()   # [H', W', 3]
    colour = rng.integers(0, 256, 3, dtype=np.uint8)
    yy, xx = np.mgrid[:height, :width]
    radius = min(height, width) / 6
    for t in range(num_frames):
        dy, dx = (t * 2) % 48, (t * 3) % 48
        frame = texture[dy : dy + height, dx : dx + width].copy()
        cx, cy = width * (0.2 + 0.6 * t / max(num_frames - 1, 1)), height / 2
        frame[(xx - cx) ** 2 + (yy - cy) ** 2 < radius**2] = colour
        grain = rng.integers(-4, 5, frame.shape, dtype=np.int16)
        yield np.clip(frame.astype(np.int16) + grain, 0, 255).astype(np.uint8)


def write_clip(path: Path, num_frames: int, height: int, width: int, seed: int) -> None:
    tmp = path.with_suffix(".tmp.mp4")
    with av.open(str(tmp), "w") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.time_base = Fraction(1, FPS)
        stream.options = {"preset": "veryfast", "crf": "23",
                          "x264-params": f"keyint={GOP}:min-keyint={GOP}:scenecut=0"}
        for t, rgb in enumerate(synthetic_frames(num_frames, height, width, seed)):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = t
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    tmp.replace(path)


def make_dataset(work: Path, name: str, clips: int) -> Path:
    """``clips`` clips of dataset ``name`` and their metadata CSV in ``work/name`` (made once)."""
    width, height, frames = DATASETS[name][:3]
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    csv = folder / f"meta-{clips}.csv"
    if csv.is_file():
        return csv
    started = time.perf_counter()
    rows = ["path,text,num_frames,height,width,aspect_ratio,fps"]
    for i in range(clips):
        path = folder / f"clip{i:03d}.mp4"
        if not path.is_file():
            write_clip(path, frames, height, width, seed=i)
        rows.append(f"{path.name},clip {i},{frames},{height},{width},{height / width:.4f},{FPS}")
    csv.write_text("\n".join(rows) + "\n")
    size = sum((folder / f"clip{i:03d}.mp4").stat().st_size for i in range(clips))
    print(f"{name}: made {clips} clips of {width}x{height} x {frames} frames in {time.perf_counter() - started:.0f} s "
          f"({size * 8 / clips / (frames / FPS) / 1e6:.1f} Mbit/s)", flush=True)
    return csv


# --------------------------------------------------------------------------- readers


def config(csv: Path, name: str, window: int, batch_size: int, workers: int):
    _, _, _, toy_window, height, width = DATASETS[name]
    return load_config("tiny", [f"data.csv={csv}", f"data.num_frames={toy_window or window}",
                                f"data.height={height}", f"data.width={width}", "data.frame_interval=1",
                                f"data.num_workers={workers}", "data.make_toy_if_missing=false",
                                f"train.batch_size={batch_size}"])


def epoch_samples(data) -> list[tuple[str, np.ndarray]]:
    """(path, frame numbers) of every sample the pipeline delivers in epoch 0, in order."""
    samples, num_frames = [], data.plan.buckets[0].num_frames
    data.sampler.set_position(0, 0)
    for keys in data.sampler:
        for index, epoch, _bucket in keys:
            rng = np.random.default_rng([SEED, epoch, index])   # the dataset's draw
            total = int(data.meta.num_frames[index])
            samples.append((data.meta.paths[index], sample_frame_indices(total, num_frames, 1, rng)))
    return samples


def raw_decode(samples: list[tuple[str, np.ndarray]], threaded: bool = False) -> int:
    """Hand-written PyAV: seek to the keyframe before the window, decode to its last frame,
    rgb24 per wanted frame. Returns (clips read, None: no batch is made)."""
    for path, wanted in samples:
        counts = {int(n): int(c) for n, c in zip(*np.unique(wanted, return_counts=True))}
        first, last = min(counts), max(counts)
        with av.open(path) as container:
            stream = container.streams.video[0]
            if threaded:
                stream.thread_type = "AUTO"
            ticks = float(1 / (stream.average_rate * stream.time_base))   # pts ticks per frame
            if first:
                container.seek(round(first * ticks), stream=stream, backward=True)
            number = None
            for frame in container.decode(stream):
                # Constant frame rate: the first frame's pts numbers it, the rest count on.
                number = round(frame.pts / ticks) if number is None else number + 1
                if number in counts:
                    frame.to_ndarray(format="rgb24", **({} if threaded else {"threads": 1}))
                if number >= last:
                    break
    return len(samples), None


def pipeline_epoch(data) -> tuple[int, int]:
    """Epoch 0 of the training DataLoader; returns (clips delivered, bytes of one clip in a batch)."""
    data.sampler.set_position(0, 0)
    clips = size = 0
    for batch in data.loader:
        assert not batch.failed, batch.failed
        clips += len(batch)
        size = batch.video[0].numel() * batch.video.element_size()
    return clips, size


class FloatVideoDataset(VideoDataset):
    """The host float32 path this change replaced: ``clip_tensor`` (resize in float, normalise)
    written into a float32 batch, in shared memory in workers."""

    def __getitems__(self, keys):
        shape = self.plan.buckets[keys[0][2]]
        dims = (len(keys), 3, shape.num_frames, shape.height, shape.width)
        if dataset_module._in_worker():
            elem = torch.empty(0)
            batch = elem.new(elem._typed_storage()._new_shared(math.prod(dims), device=elem.device)).resize_(*dims)
        else:
            batch = torch.empty(dims)
        with dataset_module._one_torch_thread():
            return [self._float_sample(key, out) for key, out in zip(keys, batch)]

    def _float_sample(self, key, out):
        index, epoch, bucket = key
        shape = self.plan.buckets[bucket]
        frames, _ = read_video(self.meta.paths[index], threaded=self._threaded(index),
                               indices=lambda total: self._frame_indices(index, epoch, shape.num_frames, total),
                               max_pixels=self.max_pixels, fit=(shape.height, shape.width))
        return {"video": clip_tensor(frames, shape.height, shape.width, out), "text": self.meta.texts[index],
                "fps": 1.0, "failed": []}


def float_loader(data, workers: int) -> DataLoader:
    dataset = FloatVideoDataset(data.meta, data.plan, 1, seed=SEED, max_pixels=data.dataset.max_pixels)
    return DataLoader(dataset, batch_sampler=data.sampler, collate_fn=collate, num_workers=workers,
                      persistent_workers=False)


class FloatData:
    """``build_training_data``'s result with the float loader in place of its own."""

    def __init__(self, data, workers: int):
        self.sampler, self.loader = data.sampler, float_loader(data, workers)


# --------------------------------------------------------------------------- measuring


def cpu_seconds(loaders: list) -> float:
    """CPU time of this process, its finished children (workers restarted every epoch) and the
    live workers of ``loaders`` (persistent ones, counted from /proc until they exit)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    for loader in loaders:
        for worker in getattr(getattr(loader, "_iterator", None), "_workers", []):
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{worker.pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime
    return total


def interleaved(rounds: int, runs: dict, loaders: list) -> dict:
    """Seconds and CPU seconds of each run per round, the runs round-robin; round 0 is the
    warm-up (not in the CPU figure)."""
    seconds = {name: [] for name in runs}
    cpu = {name: 0.0 for name in runs}
    delivered = {}
    for round_ in range(rounds + 1):
        for name, fn in runs.items():
            start, used = time.perf_counter(), cpu_seconds(loaders)
            delivered[name] = fn()
            seconds[name].append(time.perf_counter() - start)
            cpu[name] += (cpu_seconds(loaders) - used) if round_ else 0.0
    return {name: (times[0], times[1:], cpu[name] / rounds, *delivered[name]) for name, times in seconds.items()}


def measure(name: str, csv: Path, args) -> list[dict]:
    data = {w: build_training_data(config(csv, name, args.window, args.batch_size, w).data,
                                   batch_size=args.batch_size, seed=SEED) for w in args.workers}
    samples = epoch_samples(data[args.workers[0]])
    runs = {"raw PyAV, threads=1": lambda: raw_decode(samples),
            "raw PyAV, FFmpeg threads": lambda: raw_decode(samples, threaded=True)}
    for w in args.workers:
        runs[f"pipeline uint8, num_workers={w}"] = lambda d=data[w]: pipeline_epoch(d)
    float_workers = max(args.workers)
    if float_workers:   # the same without reusing shared memory: what the slots save
        cfg = config(csv, name, args.window, args.batch_size, float_workers)
        fresh = data["fresh"] = build_training_data(cfg.data, batch_size=args.batch_size, seed=SEED)
        fresh.dataset.slots = None
        runs[f"pipeline uint8, num_workers={float_workers}, fresh shared memory"] = lambda: pipeline_epoch(fresh)
    runs[f"pipeline float32 (before), num_workers={float_workers}"] = \
        lambda d=FloatData(data[float_workers], float_workers): pipeline_epoch(d)
    results = interleaved(args.repeats, runs, [d.loader for d in data.values()])
    reference = max(clips / min(times) for key, (_, times, _, clips, _) in results.items() if key.startswith("raw"))
    rows = [{"dataset": name, "reader": key, "clips": clips, "best": min(times), "median": statistics.median(times),
             "first": first, "cpu": cpu, "ratio": clips / min(times) / reference, "bytes": size}
            for key, (first, times, cpu, clips, size) in results.items()]
    del data, runs   # the persistent workers end here, not in another dataset's timing
    gc.collect()
    return rows


def stages(name: str, csv: Path, args, clips: int = 6) -> dict:
    """Per-clip milliseconds on one thread, in this process: raw decode, read_video, and the
    host pixel work after decoding (uint8 crop/resize vs the float path); and the largest
    difference, in [-1, 1] units, between the uint8 clip normalised by ``to_model_input`` and the
    float path's clip."""
    data = build_training_data(config(csv, name, args.window, args.batch_size, 0).data,
                               batch_size=args.batch_size, seed=SEED)
    samples = epoch_samples(data)[:clips]
    bucket = data.plan.buckets[0]
    torch.set_num_threads(1)
    timings = {"raw decode": [], "read_video": [], "crop/resize uint8": [], "float path (before)": []}
    difference = 0.0
    for path, wanted in samples:
        start = time.perf_counter()
        raw_decode([(path, wanted)])
        timings["raw decode"].append(time.perf_counter() - start)
        start = time.perf_counter()
        frames, _ = read_video(path, indices=wanted, threaded=False, fit=(bucket.height, bucket.width))
        timings["read_video"].append(time.perf_counter() - start)
        start = time.perf_counter()
        clip = crop_resize_uint8(frames, bucket.height, bucket.width)
        timings["crop/resize uint8"].append(time.perf_counter() - start)
        start = time.perf_counter()
        before = clip_tensor(frames, bucket.height, bucket.width)
        timings["float path (before)"].append(time.perf_counter() - start)
        difference = max(difference, float((to_model_input(clip[None])[0] - before).abs().max()))
    return {**{f"{key} ms": 1000 * statistics.median(values) for key, values in timings.items()},
            "max abs diff vs float path": difference}


def print_table(rows: list[dict]) -> None:
    print("| dataset | reader | clips | best s | median s | clips/s | CPU ms/clip | first epoch s | host MB/sample "
          "| ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        size = "" if r["bytes"] is None else f"{r['bytes'] / 2**20:.1f}"
        print(f"| {r['dataset']} | {r['reader']} | {r['clips']} | {r['best']:.2f} | {r['median']:.2f} | "
              f"{r['clips'] / r['best']:.1f} | {1000 * r['cpu'] / r['clips']:.0f} | {r['first']:.2f} | {size} | "
              f"**{r['ratio']:.2f}** |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the generated clips (reused)")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--clips", type=int, default=24, help="clips per real-size dataset")
    parser.add_argument("--toy-clips", type=int, default=64, help="clips of the toy dataset")
    parser.add_argument("--window", type=int, default=33, help="frames per sample of real-size clips")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds after the warm-up; the best counts")
    parser.add_argument("--stages", action="store_true", help="add the per-clip breakdown of the host work")
    args = parser.parse_args()

    load = os.getloadavg()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"{os.cpu_count()} CPU cores ({cpu}), load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), PyAV {av.__version__} "
          f"(FFmpeg {av.ffmpeg_version_info}); batch {args.batch_size}, window {args.window}, "
          f"{args.repeats} rounds after a warm-up")
    rows, breakdown = [], {}
    for name in args.datasets:
        csv = make_dataset(args.work, name, args.toy_clips if name == "toy" else args.clips)
        rows += measure(name, csv, args)
        if args.stages:
            breakdown[name] = stages(name, csv, args)
    print()
    print_table(rows)
    print("\nratio = clips/s / the faster raw row's clips/s in the same dataset (best rounds); CPU = this process "
          "and the DataLoader workers, mean of the measured rounds; host MB/sample = one clip of the batch the "
          "loader hands over")
    if breakdown:
        print(f"\nper clip, one thread, median of {6} clips:\n")
        print("| dataset | " + " | ".join(next(iter(breakdown.values()))) + " |")
        print("|---|" + "---:|" * len(next(iter(breakdown.values()))))
        for name, values in breakdown.items():
            print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in list(values.values())[:-1])
                  + f" | {list(values.values())[-1]:.5f} |")
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
