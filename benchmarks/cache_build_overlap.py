"""The cache build's overlap of decode, encode and write, and PyAV vs torchcodec at real size (issue 27).

    python benchmarks/cache_build_overlap.py --work /tmp/cache_build_overlap [--sections build,decoders]
        [--clips 8] [--views 4] [--shard-size 8] [--batch-size 2] [--workers 1] [--bucket 240x416]
        [--frames 33] [--encoder kl|identity] [--decoder auto] [--repeats 3]

Clips (generated once into ``--work`` with PyAV/libx264 and reused): ``--clips`` h264 mp4s of
832x480 x 81 frames at 16 fps, a panned smooth texture with a moving disc and film grain, a
keyframe every 48 frames, CRF 23 (bitrates of ordinary footage, not of flat toy clips).

``build``: ``videodit cache build``'s own loop (``build_cache``; the clips/s it reports covers
decode, encode and write of every sample, not loading the encoders) against each of its stages
alone on the same samples (``--views`` windows of each clip, ``--frame``-frame windows resized to
the ``--bucket``, shards of ``--shard-size``):

* decode: the build's DataLoader (``data.num_workers`` = ``--workers``) iterated, nothing else;
* encode: the decoded batches held in memory, encoded as the build encodes them (uint8 -> float on
  the device, the VAE, the text encoder);
* write: the encoded samples held in memory, written as the build writes them (``ShardWriter``:
  bf16, safetensors, SHA-256, fsync, rename, Parquet index part), in this thread;
* build without overlap (before issue 27, for the ratio): ``num_workers`` 0 and shards written in
  line, so its time is the sum of the stages'.

``ratio`` = build clips/s / the slowest stage's clips/s (target >= 0.9). ``CPU s/clip`` is the
process's CPU time (its DataLoader workers' included) per clip; on a machine of N cores no
configuration can beat N / (its CPU s/clip), which the table gives as ``CPU bound``. The encoder:
``kl``, a random diffusers AutoencoderKL (8x spatial, 4 latent channels, narrow: blocks of
``--kl-channels``), or ``identity`` (pixels as latents: no encode, 20 MB bf16 samples to write at
240x416 x 33); the toy text encoder. ``--device-ms`` adds that many milliseconds per clip of
waiting to every encode, a stand-in for an encoder on a GPU: time that passes without this
machine's CPU (the build waits for the GPU's result as ``.cpu()`` does).

``decoders``: ``read_video`` of a random 33-frame window of each clip (every clip 3 times, the same
windows for both), whole frames (no resize), with PyAV and with torchcodec (where it loads),
single-threaded as in DataLoader workers and with FFmpeg's threads as in the main process; the
frames of the two decoders are compared.

Every configuration runs once per round, round-robin over ``--repeats`` rounds after a warm-up
round, so that load from other processes hits all of them alike; the median round counts (best
beside it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import platform
import shutil
import statistics
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch

from videodit import cache as cache_build
from videodit.cache import _Decode, _groups, build_cache
from videodit.components import build_encoders
from videodit.config import load_config
from videodit.data import decoder_choice
from videodit.data.buckets.plan import BucketPlan
from videodit.data.dataset import VideoDataset
from videodit.data.decoder_choice import DecoderChoice, resolve_decoder, using_decoder
from videodit.data.feature_cache.writer import ShardWriter, plan_items
from videodit.data.metadata import read_metadata
from videodit.data.pixels import to_model_input
from videodit.data.video import read_video

WIDTH, HEIGHT, FRAMES, FPS, KEYINT = 832, 480, 81, 16, 48


# --------------------------------------------------------------------------- clips


def make_clip(path: Path, seed: int) -> None:
    """A panned smooth texture with a moving disc and film grain, h264 CRF 23."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (HEIGHT // 16 + 2, WIDTH // 16 + 8, 3)).astype(np.float32)
    texture = torch.nn.functional.interpolate(torch.from_numpy(coarse).permute(2, 0, 1)[None],
                                              scale_factor=16, mode="bicubic")[0].permute(1, 2, 0).numpy()
    yy, xx = np.mgrid[:HEIGHT, :WIDTH]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.codec_context.time_base = Fraction(1, FPS)
        stream.options = {"crf": "23", "preset": "veryfast", "x264-params": f"keyint={KEYINT}:min-keyint={KEYINT}"}
        for t in range(FRAMES):
            frame = texture[:HEIGHT, t : t + WIDTH].copy()
            cy, cx = HEIGHT / 2 + 120 * np.sin(t / 9), 100 + 8 * t
            frame[(yy - cy) ** 2 + (xx - cx) ** 2 < 60 ** 2] = (230, 60, 40)
            frame += rng.normal(0, 6, frame.shape)
            video_frame = av.VideoFrame.from_ndarray(np.clip(frame, 0, 255).astype(np.uint8), format="rgb24")
            video_frame.pts, video_frame.time_base = t, Fraction(1, FPS)
            container.mux(stream.encode(video_frame))
        container.mux(stream.encode(None))


def make_clips(folder: Path, count: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = ["path,text,num_frames,height,width,aspect_ratio,fps"]
    for i in range(count):
        path = folder / f"clip{i:03d}.mp4"
        if not path.exists():
            make_clip(path, seed=i)
        rows.append(f"{path.name},a red disc moving right,{FRAMES},{HEIGHT},{WIDTH},{HEIGHT / WIDTH:.4f},{FPS}")
    (folder / "meta.csv").write_text("\n".join(rows) + "\n")
    return folder / "meta.csv"


# --------------------------------------------------------------------------- rounds


def cpu_seconds() -> float:
    """CPU time of this process and of its children that ended (DataLoader workers end with their loader)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def round_robin(configs: dict, repeats: int, clips: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``configs``: name -> fn() returning clips/s; a warm-up round, then ``repeats`` rounds.
    Returns clips/s and CPU seconds per clip, per configuration and round."""
    rates, cpu = {name: [] for name in configs}, {name: [] for name in configs}
    for round_number in range(repeats + 1):
        for name, fn in configs.items():
            before = cpu_seconds()
            rate = fn()
            used = (cpu_seconds() - before) / clips
            print(f"  round {round_number}{' (warm-up)' if round_number == 0 else ''}: {name}: {rate:.2f} clips/s, "
                  f"{used:.3f} CPU s/clip", flush=True)
            if round_number:
                rates[name].append(rate)
                cpu[name].append(used)
    return rates, cpu


def table(header: list[str], rows: list[list]) -> str:
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"
    lines = ["| " + " | ".join(header) + " |", rule]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


# --------------------------------------------------------------------------- the build


class InlineWriter:
    """``ShardWriterThread``'s interface, writing each shard at once in the building thread."""

    def __init__(self, depth: int = 1):
        pass

    def submit(self, writer: ShardWriter) -> None:
        writer.write()

    def close(self, *, abort: bool = False) -> None:
        pass


def build_section(args, csv: Path, work: Path) -> str:
    height, width = (int(v) for v in args.bucket.split("x"))
    overrides = [f"data.csv={csv}", f"data.num_frames={args.frames}", f"data.height={height}", f"data.width={width}",
                 f"data.num_workers={args.workers}", f"data.decoder={args.decoder}", "data.make_toy_if_missing=false",
                 "train.device=cpu", "text.kind=toy", "validation.csv=null"]
    if args.encoder == "kl":
        from videodit.toy.stand_ins import save_kl_vae

        vae = work / "vae-kl"
        channels = tuple(int(c) for c in args.kl_channels.split(","))
        vae = work / f"vae-kl-{'-'.join(map(str, channels))}"
        if not vae.exists():
            save_kl_vae(vae, block_out_channels=channels, layers_per_block=1, norm_num_groups=min(channels),
                        scaling_factor=0.18215)
        overrides += ["vae.kind=diffusers", f"vae.path={vae}"]
    else:
        overrides += ["vae.kind=identity"]
    cfg = load_config("tiny", overrides)
    choice = resolve_decoder(cfg.data.decoder, cfg.data.decode_device, notice=print)
    device = torch.device("cpu")
    vae, text = build_encoders(cfg, device)
    if args.device_ms:
        vae = DeviceStandIn(vae, args.device_ms / 1e3)
    meta = read_metadata(cfg.data.csv)
    plan = BucketPlan(meta, cfg.data, cfg.train.batch_size, cfg.train.seed)
    items = plan_items(plan.assign, args.views)
    shards = -(-len(items) // args.shard_size)
    groups = _groups(items, list(range(shards)), args.shard_size, args.batch_size)
    dataset = VideoDataset(meta, plan, cfg.data.frame_interval, seed=cfg.train.seed, max_pixels=cfg.data.max_pixels)

    def loader(workers):
        from torch.utils.data import DataLoader

        return DataLoader(_Decode(dataset, items), batch_sampler=[g for _, g in groups], collate_fn=list,
                          num_workers=workers)

    with using_decoder(choice):
        decoded = [samples for samples in loader(0)]   # the encode stage's input, held in memory

    def encode(samples):
        with torch.no_grad():
            video = to_model_input(torch.stack([s["video"] for s in samples]), device)
            latents = vae.encode(video).float()
            y, mask = text.encode([s["text"] for s in samples])
        return latents, y.float(), mask

    encoded = [encode(samples) for samples in decoded]   # the write stage's input

    def bare_decode():
        with using_decoder(choice):
            started = time.perf_counter()
            count = sum(len(samples) for samples in loader(args.workers))
        return count / (time.perf_counter() - started)

    def bare_encode():
        started = time.perf_counter()
        for samples in decoded:
            encode(samples)
        return len(items) / (time.perf_counter() - started)

    def bare_write():
        out = work / "bare-write"
        shutil.rmtree(out, ignore_errors=True)
        started, writer = time.perf_counter(), None
        for (shard, positions), (latents, y, mask) in zip(groups, encoded):
            if writer is not None and writer.shard != shard:
                writer.write()
            if writer is None or writer.shard != shard:
                writer = ShardWriter(out, shard, torch.bfloat16)
            for j, p in enumerate(positions):
                writer.add(int(items.clip[p]), int(items.view[p]), int(items.bucket[p]), 16.0, latents[j], y[j],
                           mask[j])
        writer.write()
        return len(items) / (time.perf_counter() - started)

    def build(overlap: bool):
        def run():
            out = work / "build"
            shutil.rmtree(out, ignore_errors=True)
            run_cfg = cfg if overlap else load_config("tiny", [*overrides, "data.num_workers=0"])
            with contextlib.ExitStack() as stack:
                stack.enter_context(_patched(cache_build, "build_encoders", lambda cfg, device: (vae, text)))
                if not overlap:
                    stack.enter_context(_patched(cache_build, "ShardWriterThread", InlineWriter))
                result = build_cache(run_cfg, out, views=args.views, shard_size=args.shard_size,
                                     batch_size=args.batch_size, log=lambda *a, **k: None)
            return result["clips_per_s"]
        return run

    print(f"build: {len(items)} samples ({args.clips} clips x {args.views} views) of {args.frames}x{height}x{width}, "
          f"{shards} shards, batch {args.batch_size}, {args.workers} worker(s), encoder {args.encoder}, decoder "
          f"{choice.decoder}", flush=True)
    results, cpu = round_robin({"decode": bare_decode, "encode": bare_encode, "write": bare_write,
                                "build": build(True), "build without overlap": build(False)}, args.repeats, len(items))
    median = {name: statistics.median(rates) for name, rates in results.items()}
    slowest = min(median[name] for name in ("decode", "encode", "write"))
    serial = 1 / sum(1 / median[name] for name in ("decode", "encode", "write"))
    cores = os.cpu_count()
    rows = []
    for name, rates in results.items():
        used = statistics.median(cpu[name])
        build_row = name.startswith("build")
        rows.append([name, f"{median[name]:.2f}", f"{max(rates):.2f}", f"{used:.3f}", f"{used * median[name]:.2f}",
                     f"{cores / used:.2f}" if build_row else "", f"{median[name] / slowest:.2f}" if build_row else ""])
    rows.append(["(the stages in sequence: 1 / sum of 1/stage)", f"{serial:.2f}", "", "", "", "",
                 f"{serial / slowest:.2f}"])
    encoder = args.encoder + (f" ({args.kl_channels})" if args.encoder == "kl" else "") + \
        (f" + {args.device_ms:g} ms/clip device stand-in" if args.device_ms else "")
    note = (f"{len(items)} samples ({args.clips} clips x {args.views} views), {args.frames} frames at "
            f"{height}x{width} from 832x480 x 81 h264, shards of {args.shard_size}, batch {args.batch_size}, "
            f"data.num_workers={args.workers}, encoder {encoder}, decoder {choice.decoder}; clips/s median "
            f"(best) of {args.repeats} rounds; cores busy = CPU s/clip x clips/s; CPU bound = {cores} cores / CPU s "
            "per clip; ratio = clips/s / the slowest stage's; load average at the end: "
            f"{', '.join(f'{v:.1f}' for v in os.getloadavg())}")
    return note + "\n\n" + table(["configuration", "clips/s", "best", "CPU s/clip", "cores busy",
                                   "CPU bound clips/s", "ratio to slowest stage"], rows)


class DeviceStandIn:
    """A VAE whose every encode also waits ``seconds`` per clip without the CPU: an encoder on a GPU."""

    def __init__(self, vae, seconds: float):
        self.vae, self.seconds = vae, seconds

    def __getattr__(self, name):
        return getattr(self.vae, name)

    def encode(self, video):
        time.sleep(self.seconds * len(video))
        return self.vae.encode(video)


@contextlib.contextmanager
def _patched(module, name, value):
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


# --------------------------------------------------------------------------- decoders


def decoder_section(args, csv: Path) -> str:
    meta = read_metadata(csv)
    rng = np.random.default_rng(0)
    reads = [(path, int(rng.integers(0, FRAMES - 33 + 1))) for _ in range(3) for path in meta.paths]
    problem = decoder_choice.torchcodec_problem()
    decoders = ["pyav"] + (["torchcodec"] if problem is None else [])

    def reader(decoder: str, threaded: bool):
        def run():
            with using_decoder(DecoderChoice(decoder)):
                started = time.perf_counter()
                for path, start in reads:
                    read_video(path, indices=list(range(start, start + 33)), threaded=threaded)
            return len(reads) / (time.perf_counter() - started)
        return run

    identical = "n/a"
    if problem is None:
        from videodit.data.decode_torchcodec import READS

        worst = 0
        READS.clear()
        for path, start in reads[: len(meta.paths)]:
            window = list(range(start, start + 33))
            with using_decoder(DecoderChoice("pyav")):
                want, _ = read_video(path, indices=window)
            with using_decoder(DecoderChoice("torchcodec")):
                got, _ = read_video(path, indices=window)
            worst = max(worst, int(np.abs(got.astype(int) - want).max()))
        identical = f"max |torchcodec - PyAV| = {worst} levels over {len(meta.paths)} windows " \
                    f"({dict(READS)})"
    configs = {f"{d}, {'FFmpeg threads' if threaded else '1 thread'}": reader(d, threaded)
               for threaded in (False, True) for d in decoders}
    print(f"decoders: {len(reads)} reads of a 33-frame window of 832x480 x 81 h264", flush=True)
    results, _ = round_robin(configs, args.repeats, len(reads))
    base = {threaded: statistics.median(results[f"pyav, {'FFmpeg threads' if threaded else '1 thread'}"])
            for threaded in (False, True)}
    rows = []
    for name, rates in results.items():
        rows.append([name, f"{statistics.median(rates):.2f}", f"{max(rates):.2f}",
                     f"{statistics.median(rates) / base['threads' in name]:.2f}"])
    if problem is not None:
        rows.append([f"torchcodec: not measured ({problem})", "", "", ""])
    versions = f"PyAV {av.__version__} (FFmpeg {av.library_versions['libavcodec']} libavcodec)"
    if problem is None:
        from torchcodec._core import ops

        ffmpeg = ops.get_ffmpeg_library_versions()["ffmpeg_version"]
        versions += f", torchcodec {_torchcodec_version()} (FFmpeg {ffmpeg})"
    note = (f"{len(reads)} reads (every clip 3 times) of a random 33-frame window, whole 832x480 frames as uint8 "
            f"numpy; {versions}; clips/s median (best) of {args.repeats} rounds; frames: {identical}")
    return note + "\n\n" + table(["decoder", "clips/s", "best", "x PyAV"], rows)


def _torchcodec_version() -> str:
    import torchcodec

    return getattr(torchcodec, "__version__", "?")


# --------------------------------------------------------------------------- main


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, help="folder for the clips (kept) and the builds")
    parser.add_argument("--sections", default="build,decoders")
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--views", type=int, default=4)
    parser.add_argument("--shard-size", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--bucket", default="240x416", help="HEIGHTxWIDTH the windows are resized to")
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--encoder", choices=("kl", "identity"), default="kl")
    parser.add_argument("--kl-channels", default="4,8,8,8", help="the kl encoder's block widths")
    parser.add_argument("--device-ms", type=float, default=0.0, help="device stand-in: ms per clip of each encode")
    parser.add_argument("--decoder", choices=("auto", "pyav", "torchcodec"), default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    work = Path(args.work)
    csv = make_clips(work / "clips", args.clips)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()}, "
          f"torch {torch.__version__}, Python {platform.python_version()}", flush=True)
    out = []
    if "build" in args.sections:
        out.append("### Cache build vs its stages\n\n" + build_section(args, csv, work))
    if "decoders" in args.sections:
        out.append("### PyAV vs torchcodec\n\n" + decoder_section(args, csv))
    print("\n\n" + "\n\n".join(out))


if __name__ == "__main__":
    main()
