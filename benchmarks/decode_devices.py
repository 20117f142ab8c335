"""``gpu_suite.py``'s data section: decoding clips on the CPU (PyAV, torchcodec) against NVDEC
(torchcodec with ``data.decode_device=cuda``), on the same clips and frame windows.

Clips are made with PyAV/libx264 into a temporary folder: 832x480 x 81 frames at 16 fps with a
keyframe every 48 (the dry run: 64x48 x 17), a panned texture with grain. Each read takes a random
window of 33 frames (the dry run: 8) as a uint8 tensor: host memory for the CPU decoders, GPU
memory for NVDEC (synchronised before the clock stops). Reads run round-robin over the decoders;
the median of the rounds counts. ``max abs diff vs PyAV`` compares every decoder's frames with PyAV's
(NVDEC converts colours on the GPU, so small differences are expected there; the CPU decoders
are bit-identical).

The second table trains on those clips (``videodit train``: the tiny STDiT, no VAE, a
bucket of the clip size, batch 2, 8 steps) with 0 and 2 workers and reports the logged
``data_wait``: the share of the loop's time spent waiting for the next batch, while the device
has nothing queued. The first step's wait (the workers' start) is left out.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch


def make_clip(path: Path, width: int, height: int, frames: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    texture = rng.integers(0, 256, (height, width + 2 * frames, 3)).astype(np.float32)
    texture = (texture + np.roll(texture, 1, 0) + np.roll(texture, 1, 1) + np.roll(texture, (1, 1), (0, 1))) / 4
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=16)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.time_base = Fraction(1, 16)
        stream.options = {"crf": "23", "preset": "veryfast", "x264-params": "keyint=48:min-keyint=48"}
        for t in range(frames):
            frame = texture[:, 2 * t : 2 * t + width] + rng.normal(0, 6, (height, width, 3))
            video_frame = av.VideoFrame.from_ndarray(np.clip(frame, 0, 255).astype(np.uint8), format="rgb24")
            video_frame.pts, video_frame.time_base = t, Fraction(1, 16)
            container.mux(stream.encode(video_frame))
        container.mux(stream.encode(None))


def section_data(w, report, args) -> None:
    """Decode clips/s of PyAV and torchcodec on the CPU and of NVDEC, and their frames' difference."""
    from videodit.data import decoder_choice
    from videodit.data.decode_torchcodec import read_tensor
    from videodit.data.decoder_choice import DecoderChoice, using_decoder
    from videodit.data.video import read_video

    width, height, frames, window, count = (64, 48, 17, 8, 2) if w.dry else (832, 480, 81, 33, 4)
    rounds = 2 if w.dry else 5
    problem = decoder_choice.torchcodec_problem()
    decoders = {"PyAV, CPU": ("pyav", "cpu")}
    if problem is None:
        decoders["torchcodec, CPU"] = ("torchcodec", "cpu")
    else:
        report.skip("data: torchcodec CPU decode", problem)
    if problem is not None:
        report.skip("data: NVDEC decode", problem)
    elif w.device.type != "cuda":
        report.skip("data: NVDEC decode", "needs a GPU (data.decode_device=cuda)")
    else:
        decoders["torchcodec, NVDEC"] = ("torchcodec", "cuda")
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"clip{i}.mp4" for i in range(count)]
        for i, path in enumerate(paths):
            make_clip(path, width, height, frames, seed=i)
        rng = np.random.default_rng(0)
        reads = [(path, int(rng.integers(0, frames - window + 1))) for _ in range(3) for path in paths]

        def read(decoder: str, device: str, path: Path, start: int) -> torch.Tensor:
            indices = list(range(start, start + window))
            if device == "cuda":
                return read_tensor(path, lambda total: np.asarray(indices), device="cuda")[0]
            with using_decoder(DecoderChoice(decoder, device)):
                return torch.from_numpy(read_video(path, indices=indices, threaded=True)[0])

        reference = [read("pyav", "cpu", path, start) for path, start in reads]
        rates: dict[str, list[float]] = {name: [] for name in decoders}
        for round_number in range(rounds + 1):   # round 0 warms up (NVDEC's context, the page cache)
            for name, (decoder, device) in decoders.items():
                if w.device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for path, first in reads:
                    read(decoder, device, path, first)
                if device == "cuda":
                    torch.cuda.synchronize()
                if round_number:
                    rates[name].append(len(reads) / (time.perf_counter() - start))
        rows = []
        for name, (decoder, device) in decoders.items():
            diff = max(int((read(decoder, device, path, first).cpu().int() - want.int()).abs().max())
                       for (path, first), want in zip(reads, reference))
            rate = statistics.median(rates[name])
            rows.append([name, f"{rate:.2f}", f"{rate * window:.0f}", diff,
                         "GPU" if device == "cuda" else "host"])
        waits = [[workers, *training_data_wait(w, paths, tmp, width, height, window, workers)] for workers in (0, 2)]
    report.table(f"Data: decode clips/s, CPU vs NVDEC ({width}x{height} x {frames} h264)",
                 ["decoder", "clips/s", "frames/s", "max abs diff vs PyAV (levels)", "frames land in"], rows,
                 note=f"{len(reads)} reads of a random {window}-frame window ({count} clips x 3), uint8; FFmpeg's "
                      f"threads on the CPU; median of {rounds} rounds after a warm-up, round-robin.")
    report.table(f"Data: the training step waiting for data ({width}x{height} x {window} frames of those clips)",
                 ["data.num_workers", "data_wait (share of step time)", "samples/s"], waits,
                 note=f"videodit train, tiny STDiT without a VAE on {w.device.type}, batch 2, 8 steps, PyAV; the mean "
                      "of the logged data_wait after step 1.")


def training_data_wait(w, paths: list[Path], tmp: str, width: int, height: int, frames: int,
                       workers: int) -> list[str]:
    """(data_wait, samples/s) of a short run on ``paths`` with ``workers`` DataLoader workers."""
    from videodit.cli import main

    csv = Path(tmp) / "train.csv"
    rows = [f"{p},a panned texture,{frames},{height},{width},{width / height:.4f},16.0" for p in paths]
    csv.write_text("path,text,num_frames,height,width,aspect_ratio,fps\n" + "\n".join(rows * 4) + "\n")
    out = Path(tmp) / f"run-{workers}"
    args = [f"data.csv={csv}", f"data.num_frames={frames}", f"data.height={height}", f"data.width={width}",
            f"data.num_workers={workers}", "data.make_toy_if_missing=false", "data.frame_interval=1",
            "vae.kind=identity", "model.depth=1", "model.hidden_size=64", "model.num_heads=2",
            "model.patch_size=[1,8,8]", "train.batch_size=2", "train.max_steps=8", "train.log_every=1",
            "checkpoint.every_steps=0", "sample.steps=1", "sample.prompts=[a panned texture]", "validation.csv=null",
            f"train.device={w.device.type}"]
    if main(["train", "tiny", *args, "--out", str(out)]) != 0:
        return ["failed", "-"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    return [f"{statistics.mean(r['data_wait'] for r in records):.3f}",
            f"{statistics.mean(r['samples_per_s'] for r in records):.1f}"]
