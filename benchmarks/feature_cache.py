"""The feature cache: training step from the cache vs on-the-fly encoding, build throughput vs
bare decode + encode, and bytes per sample.

    python benchmarks/feature_cache.py [--steps 10] [--size 64] [--frames 8] [--batch-size 4]

Encoders of real architecture with random weights: a diffusers AutoencoderKL (SD-VAE layout,
4 latent channels, 8x spatial compression, narrow: blocks of 32/64/64/64 channels) and a T5
encoder (2 layers, d_model 256, 32 caption tokens) with a word tokenizer over the toy
vocabulary; the S preset (12 block pairs, hidden 384) on toy clips of SIZE x SIZE x FRAMES.

1. Training step, same run, A/B interleaved: one trainer reads the cache (``data.cache``), the
   other decodes and encodes every batch; each step includes fetching its batch. Median s/step,
   and apart: the median fetch (read or decode) and encode (``Trainer.features``, timed on the
   same batch after the step) seconds, the work the cache removes.
2. Build: ``build_cache`` (the whole call: encoders loaded, metadata read, decode, encode,
   shards and index written with fsync) against a loop that only decodes and encodes the same
   clips in batches of the same size. clips/s, rounds alternating, best of each.
3. Bytes: the cache's measured bytes per sample, and Open-Sora 1.2's geometry at 240p x 51
   (computed: 4 latent channels, 8x spatial, 17 frames -> 5 latent frames; T5-XXL 4096 wide,
   300 tokens padded).
4. The shard checksum's cost (``--sections checksum``), each against its baseline in the same
   run, rounds alternating: reading batches with and without the first-read verification
   (SHA-256 and header of each shard, once per process), and writing shards with and without
   hashing them. On synthetic shards of Open-Sora 1.2's geometry (a 4x15x30x53 bf16 latent and
   a 50-token T5-XXL caption, 600,400 B a sample; ``--synthetic-shards`` of
   ``--synthetic-shard-size`` samples), and, when section 2 runs, on the toy cache and as
   ``build_cache`` with and without hashing. Reads are from the page cache (the files were
   just written); a training epoch reads samples in shuffled order, and so does this.

    python benchmarks/feature_cache.py --sections checksum [--synthetic-shards 2 --synthetic-shard-size 256]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from videodit.cache import build_cache
from videodit.components import build_encoders
from videodit.config import load_config
from videodit.data.buckets.plan import BucketPlan
from videodit.data.buckets.tables import ASPECT_RATIOS
from videodit.data.dataset import VideoDataset
from videodit.data.feature_cache import FeatureCache
from videodit.data.feature_cache import writer as cache_writer
from videodit.data.feature_cache.format import FORMAT, VERSION, write_manifest
from videodit.data.feature_cache.reader import CachedDataset, Collate
from videodit.data.feature_cache.writer import ShardWriter, finish_index
from videodit.data.metadata import read_metadata
from videodit.models.stdit.temporal_vae import latent_frames
from videodit.toy.make import make_toy_dataset
from videodit.toy.stand_ins import save_kl_vae, save_t5
from videodit.train.trainer import Trainer


def make_encoders(root: Path) -> tuple[Path, Path]:
    """A random diffusers VAE (8x spatial) and T5 of moderate size, so that encoding costs what a step does."""
    vae = save_kl_vae(root / "vae", block_out_channels=(32, 64, 64, 64), layers_per_block=2, norm_num_groups=32,
                      scaling_factor=0.18215)
    t5 = save_t5(root / "t5", d_model=256, d_ff=1024, d_kv=32, num_layers=2, num_heads=8)
    return vae, t5


def bare_decode_encode(cfg, batch_size: int) -> tuple[int, float]:
    """Decode and encode every clip of ``cfg``'s data once, in batches, writing nothing."""
    vae, text = build_encoders(cfg, torch.device("cpu"))
    meta = read_metadata(cfg.data.csv)
    plan = BucketPlan(meta, cfg.data, cfg.train.batch_size, cfg.train.seed)
    dataset = VideoDataset(meta, plan, cfg.data.frame_interval, seed=cfg.train.seed)
    bucket = plan.assign(0)
    clips = [i for i in range(len(meta)) if bucket[i] >= 0]
    start = time.perf_counter()
    for i in range(0, len(clips), batch_size):
        samples = [dataset.load(c, 0, int(bucket[c])) for c in clips[i : i + batch_size]]
        with torch.no_grad():
            vae.encode(torch.stack([s["video"] for s in samples]))
            text.encode([s["text"] for s in samples])
    return len(clips), time.perf_counter() - start


def opensora_bytes() -> dict:
    height, width = ASPECT_RATIOS["240p"]["0.56"]
    latent = 4 * latent_frames(51) * (height // 8) * (width // 8)
    per_token = 4096 * 2
    return {"shape": f"4x{latent_frames(51)}x{height // 8}x{width // 8}", "latent_bytes": latent * 2,
            "caption_bytes_per_token": per_token, "padded_caption_bytes": 300 * per_token,
            "per_sample": {n: latent * 2 + n * per_token for n in (20, 50, 100, 200, 300)}}


# --------------------------------------------------------------------------- 4. the checksum's cost


@contextlib.contextmanager
def shard_hashing(on: bool, spent: list | None = None):
    """Shards written with their SHA-256 (``on``, the build as it is) or with a record of their
    size only (the baseline); ``spent`` collects the seconds the hashing took."""
    real = cache_writer.shard_record

    def timed(data: bytes) -> dict:
        start = time.perf_counter()
        record = real(data)
        if spent is not None:
            spent.append(time.perf_counter() - start)
        return record

    cache_writer.shard_record = timed if on else (lambda data: {"sha256": "", "bytes": len(data)})
    try:
        yield
    finally:
        cache_writer.shard_record = real


OPENSORA_LATENT, T5_DIM, T5_TOKENS, CAPTION_TOKENS = (4, 15, 30, 53), 4096, 300, 50


def synthetic_cache(folder: Path, shards: int, shard_size: int, rounds: int) -> dict:
    """A cache of Open-Sora 1.2 240p x 51 samples (random values), its shards written ``rounds``
    times each with and without hashing, alternating (the last write hashes, so the index
    records every checksum). Returns the write timings."""
    items = shards * shard_size
    manifest = {
        "format": FORMAT, "version": VERSION, "source": {"csv": "synthetic", "digest": "-", "rows": items},
        "encoders": {"vae": {"kind": "synthetic"}, "text": {"kind": "synthetic"}},
        "layout": {"buckets": [["240p", 51, "0.56", 240, 426]], "keep": None, "frame_interval": 1},
        "seed": 0, "views": 1, "dtype": "bf16", "latents": "mode", "encode_precision": "fp32", "encode_batch": 1,
        "latent": {"channels": 4, "spatial_compression": 8, "temporal_compression": 4, "frames": [],
                   "shapes": {"0": list(OPENSORA_LATENT)}},
        "text_geometry": {"dim": T5_DIM, "max_length": T5_TOKENS},
        "items": items, "items_digest": "-", "shard_size": shard_size, "shards": shards,
    }
    folder.mkdir(parents=True)
    write_manifest(folder, manifest)
    generator = torch.Generator().manual_seed(0)
    mask = torch.arange(T5_TOKENS) < CAPTION_TOKENS
    times = {"write, no hash": [], "write, hashed": [], "hash alone": []}
    shard_bytes = 0
    for shard in range(shards):
        writer = ShardWriter(folder, shard, torch.bfloat16)
        for clip in range(shard * shard_size, (shard + 1) * shard_size):
            writer.add(clip, 0, 0, 24.0, torch.randn(OPENSORA_LATENT, generator=generator),
                       torch.randn(T5_TOKENS, T5_DIM, generator=generator) * mask[:, None], mask)
        for _ in range(rounds):
            for on in (False, True):   # the hashed write last: the index records its checksum
                with shard_hashing(on, times["hash alone"] if on else None):
                    start = time.perf_counter()
                    writer.write()
                    times["write, hashed" if on else "write, no hash"].append(time.perf_counter() - start)
        shard_bytes += (folder / "shards" / f"shard-{shard:05d}.safetensors").stat().st_size
    finish_index(folder, shards)
    return {"samples": items, "shards": shards, "shard_bytes": shard_bytes // shards, "times": times}


def read_epoch(folder: Path, batch: int, verify: bool, seed: int = 0) -> tuple[list[float], list[float], float]:
    """Per-batch seconds of two epochs over a fresh ``FeatureCache`` (a new training process),
    samples in shuffled order, batches collated as training does: the first epoch verifies each
    shard at its first read (``verify``; else every shard counts as checked), the second finds
    them checked. Also the seconds spent verifying, timed inside the reads."""
    cache = FeatureCache(folder)
    if not verify:
        cache._check.ok[:] = 1
    spent, check = [], cache._check.verify

    def timed_verify(*a):
        start = time.perf_counter()
        try:
            return check(*a)
        finally:
            spent.append(time.perf_counter() - start)

    cache._check.verify = timed_verify
    dataset, collate = CachedDataset(cache), Collate(int(cache.manifest["text_geometry"]["max_length"]),
                                                     int(cache.manifest["text_geometry"]["dim"]))
    order = np.random.default_rng(seed).permutation(cache.clip)
    epochs = []
    for epoch in range(2):
        seconds = []
        for i in range(0, len(order) - batch + 1, batch):
            start = time.perf_counter()
            collate(dataset.__getitems__([(int(c), 0, 0) for c in order[i : i + batch]]))
            seconds.append(time.perf_counter() - start)
        epochs.append(seconds)
    return epochs[0], epochs[1], sum(spent)


def read_costs(folder: Path, batch: int, rounds: int) -> dict:
    """Reading with verification against reading without, rounds alternating; the round with the
    least mean time of each kind."""
    for path in sorted(folder.rglob("*")):   # into the page cache for both
        if path.is_file():
            path.read_bytes()
    runs = {False: [], True: []}
    for _ in range(rounds):
        for verify in (False, True):
            runs[verify].append(read_epoch(folder, batch, verify))
    best = {v: min(r, key=lambda epochs: statistics.fmean(epochs[0])) for v, r in runs.items()}

    def stats(seconds: list[float]) -> dict:
        return {"mean": statistics.fmean(seconds), "median": statistics.median(seconds), "max": max(seconds),
                "batches": len(seconds)}

    verifying = min(epochs[2] for epochs in runs[True])   # inside the reads: not disturbed by the A/B's noise
    return {"batch": batch, "no verification": stats(best[False][0]), "no verification, second epoch":
            stats(best[False][1]), "verified, first epoch": stats(best[True][0]),
            "verified, second epoch": stats(best[True][1]), "verify_seconds_epoch1": verifying,
            "verify_seconds_per_batch": verifying / len(best[True][0])}


def recheck_seconds(folder: Path) -> float:
    """What ``cache build`` into a finished folder (and ``cache info``) spends checking every shard."""
    from videodit.data.feature_cache.format import read_manifest
    from videodit.data.feature_cache.writer import part_problem

    manifest = read_manifest(folder)
    start = time.perf_counter()
    assert not [s for s in range(manifest["shards"]) if part_problem(folder, s, manifest)]
    return time.perf_counter() - start


def checksum_section(tmp: Path, args, toy_cache: Path | None) -> dict:
    synthetic = synthetic_cache(tmp / "synthetic", args.synthetic_shards, args.synthetic_shard_size,
                                args.write_rounds)
    out = {"synthetic": {k: v for k, v in synthetic.items() if k != "times"},
           "write_seconds_per_shard": {k: statistics.median(v) for k, v in synthetic["times"].items()},
           "read_synthetic": read_costs(tmp / "synthetic", args.batch_size, args.read_rounds),
           "recheck_synthetic_seconds": recheck_seconds(tmp / "synthetic")}
    if toy_cache is not None:
        out["read_toy"] = read_costs(toy_cache, args.batch_size, args.read_rounds)
        out["recheck_toy_seconds"] = recheck_seconds(toy_cache)
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def checksum_table(result: dict) -> str:
    """The checksum's costs as a Markdown table: baseline, with the checksum, ratio."""
    c = result["checksum"]
    syn = c["synthetic"]
    mb = syn["shard_bytes"] / 1e6
    rows = []
    synthetic = f"240p x 51 synthetic ({syn['shards']} shards of {syn['samples'] // syn['shards']}, {mb:.0f} MB each)"
    for key, name in (("read_synthetic", synthetic), ("read_toy", "toy cache of section 2")):
        if key not in c:
            continue
        r = c[key]
        first, second = r["no verification"], r["no verification, second epoch"]
        for label, base, run, what in (
                (f"read a batch of {r['batch']}, mean over epoch 1", first, r["verified, first epoch"], "mean"),
                ("read a batch, median over epoch 1", first, r["verified, first epoch"], "median"),
                ("read a batch, slowest of epoch 1", first, r["verified, first epoch"], "max"),
                ("read a batch, mean over epoch 2 (shards checked)", second, r["verified, second epoch"], "mean")):
            rows.append((f"{name}: {label}", _ms(base[what]), _ms(run[what]), run[what] / base[what]))
        rows.append((f"{name}: of which verifying, timed inside the reads of epoch 1 "
                     f"({_ms(r['verify_seconds_epoch1'])} in all), per batch", "-", _ms(r["verify_seconds_per_batch"]),
                     (first["mean"] + r["verify_seconds_per_batch"]) / first["mean"]))
    w = c["write_seconds_per_shard"]
    rows.append((f"write one {mb:.0f} MB shard (serialise, hash, write, fsync, rename)", _ms(w["write, no hash"]),
                 _ms(w["write, hashed"]), w["write, hashed"] / w["write, no hash"]))
    rows.append((f"  of which SHA-256 of the shard's bytes ({mb / w['hash alone'] / 1e3:.2f} GB/s)", "-",
                 _ms(w["hash alone"]), None))
    if "build_checksum" in result:
        b = result["build_checksum"]
        rows.append((f"`build_cache` of the toy (whole call, encoders included), clips/s, best of {b['rounds']}",
                     f"{b['clips_per_s_no_hash']:.2f}",
                     f"{b['clips_per_s_hashed']:.2f}", b["clips_per_s_no_hash"] / b["clips_per_s_hashed"]))
        rows.append((f"  of which hashing its shards, measured inside it ({b['hash_seconds'] * 1e3:.2f} ms of "
                     f"{b['build_seconds']:.2f} s)", "-",
                     f"{100 * b['hash_seconds'] / b['build_seconds']:.3f} %", None))
    rows.append(("check every shard of the synthetic cache (`cache build` into it, `cache info`)", "-",
                 f"{c['recheck_synthetic_seconds']:.3f} s "
                 f"({syn['shards'] * syn['shard_bytes'] / c['recheck_synthetic_seconds'] / 1e9:.2f} GB/s)", None))
    lines = ["| | no checksum (baseline) | with checksum | ratio (time, with / without) |", "|---|---:|---:|---:|"]
    lines += [f"| {a} | {b} | {c_} | {'-' if r is None else f'{r:.3f}'} |" for a, b, c_, r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="build and bare-loop rounds (best of each)")
    parser.add_argument("--clips", type=int, default=1, help="toy clips per seen combination (54 each)")
    parser.add_argument("--sections", default="build,steps,checksum",
                        help="comma-separated: build (2, 3), steps (1, needs build), checksum (4)")
    parser.add_argument("--synthetic-shards", type=int, default=2, help="section 4: synthetic 240p shards")
    parser.add_argument("--synthetic-shard-size", type=int, default=256, help="section 4: samples a shard")
    parser.add_argument("--read-rounds", type=int, default=3, help="section 4: read rounds (best of each)")
    parser.add_argument("--write-rounds", type=int, default=5,
                        help="section 4: writes of each synthetic shard with and without hashing (median)")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if "steps" in sections:
        sections.add("build")
    result = {"setup": {"preset": "S", "clip": f"{args.size}x{args.size}x{args.frames}", "batch": args.batch_size,
                        "steps": args.steps, "threads": torch.get_num_threads(), "torch": torch.__version__,
                        "sections": sorted(sections)}}

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "build" in sections:
            build_and_steps(tmp, args, "steps" in sections, "checksum" in sections, result)
        if "checksum" in sections:
            result["checksum"] = checksum_section(tmp, args, tmp / "cache" if "build" in sections else None)
    result["opensora_240p_51"] = opensora_bytes()
    print(json.dumps(result, indent=1))
    if "checksum" in result:
        print()
        print(checksum_table(result))


def build_and_steps(tmp: Path, args, steps: bool, checksum: bool, result: dict) -> None:
    """Sections 1-3 (and, with ``checksum``, builds without hashing alternating with the others)."""
    vae_path, t5_path = make_encoders(tmp)
    make_toy_dataset(tmp / "toy", clips_per_combination=args.clips, num_frames=args.frames, height=args.size,
                     width=args.size)
    overrides = [f"data.csv={tmp / 'toy' / 'train.csv'}", f"data.num_frames={args.frames}", "data.frame_interval=1",
                 f"data.height={args.size}", f"data.width={args.size}", "model.preset=S",
                 "model.temporal_pos_embed=false", "model.pooled_caption=false",
                 f"train.batch_size={args.batch_size}", "validation.csv=null", "train.ema_decay=0",
                 "vae.kind=diffusers", f"vae.path={vae_path}", "text.kind=transformers", f"text.path={t5_path}",
                 "text.max_length=32", "checkpoint.every_steps=0"]
    cfg = load_config("tiny", overrides)

    # 2. Build throughput (first: the cache is needed for 1), rounds alternating, best of each.
    bare, built, unhashed, hashing = [], [], [], []
    for round in range(args.rounds):
        bare.append(bare_decode_encode(cfg, 8))
        folder = tmp / ("cache" if round == 0 else f"cache-{round}")
        spent: list[float] = []
        with shard_hashing(True, spent):
            start = time.perf_counter()
            build_cache(cfg, folder, batch_size=8, log=lambda *a, **k: None)
            built.append(time.perf_counter() - start)
        hashing.append(sum(spent))
        if checksum:   # the same build, shards recorded by size only
            with shard_hashing(False):
                start = time.perf_counter()
                build_cache(cfg, tmp / f"unhashed-{round}", batch_size=8, log=lambda *a, **k: None)
                unhashed.append(time.perf_counter() - start)
    bare_clips, bare_seconds = bare[0][0], min(seconds for _, seconds in bare)
    build_seconds = min(built)
    cache = FeatureCache(tmp / "cache")
    shard_bytes = sum(p.stat().st_size for p in (tmp / "cache" / "shards").glob("*.safetensors"))
    result.update({
        "build_clips_per_s": len(cache) / build_seconds, "bare_clips_per_s": bare_clips / bare_seconds,
        "build_over_bare": (len(cache) / build_seconds) / (bare_clips / bare_seconds),
        "cache_bytes_per_sample": shard_bytes / len(cache),
        "cache_latent_bytes": int(cache.latent_bytes[0]), "cache_caption_bytes_mean": float(cache.text_bytes.mean()),
        "cache_caption_tokens_mean": float(cache.text_len.mean()), "cache_caption_padded_bytes": 32 * 256 * 2,
    })
    if checksum:
        result["build_checksum"] = {"clips_per_s_hashed": len(cache) / build_seconds,
                                    "clips_per_s_no_hash": len(cache) / min(unhashed),
                                    "hash_seconds": hashing[built.index(build_seconds)], "build_seconds": build_seconds,
                                    "rounds": args.rounds, "seconds_hashed": built, "seconds_no_hash": unhashed}
    if not steps:
        return

    # 1. Training step, A/B interleaved.
    trainers = {"cache": Trainer(load_config("tiny", overrides + [f"data.cache={tmp / 'cache'}"]), tmp / "a"),
                "on the fly": Trainer(cfg, tmp / "b")}
    batches = {name: t.batches() for name, t in trainers.items()}
    timings = {name: {"step": [], "fetch": [], "encode": []} for name in trainers}
    for step in range(args.warmup + args.steps):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            batch = next(batches[name])
            fetched = time.perf_counter()
            trainer.train_step([batch])
            done = time.perf_counter()
            trainer.features(batch)   # timed apart: what the step spent on encoding (nothing from the cache)
            if step >= args.warmup:
                timings[name]["step"].append(done - start)
                timings[name]["fetch"].append(fetched - start)
                timings[name]["encode"].append(time.perf_counter() - done)

    median = {k: statistics.median(v["step"]) for k, v in timings.items()}
    best = {k: min(v["step"]) for k, v in timings.items()}   # the least disturbed step, on a shared machine
    parts = {k: {part: statistics.median(v[part]) for part in ("fetch", "encode")} for k, v in timings.items()}
    result.update({
        "step_seconds": median, "step_ratio_fly_over_cache": median["on the fly"] / median["cache"],
        "step_seconds_min": best, "step_min_ratio_fly_over_cache": best["on the fly"] / best["cache"],
        "fetch_and_encode_seconds": parts,
    })


if __name__ == "__main__":
    main()
