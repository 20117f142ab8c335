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
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from videodit.cache import build_cache
from videodit.components import build_encoders
from videodit.config import load_config
from videodit.data.buckets.plan import BucketPlan
from videodit.data.buckets.tables import ASPECT_RATIOS
from videodit.data.dataset import VideoDataset
from videodit.data.feature_cache import FeatureCache
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="build and bare-loop rounds (best of each)")
    parser.add_argument("--clips", type=int, default=1, help="toy clips per seen combination (54 each)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
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
        bare, built = [], []
        for round in range(args.rounds):
            bare.append(bare_decode_encode(cfg, 8))
            folder = tmp / ("cache" if round == 0 else f"cache-{round}")
            start = time.perf_counter()
            build_cache(cfg, folder, batch_size=8, log=lambda *a, **k: None)
            built.append(time.perf_counter() - start)
        bare_clips, bare_seconds = bare[0][0], min(seconds for _, seconds in bare)
        build_seconds = min(built)
        cache = FeatureCache(tmp / "cache")
        shard_bytes = sum(p.stat().st_size for p in (tmp / "cache" / "shards").glob("*.safetensors"))

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
    result = {
        "setup": {"preset": "S", "clip": f"{args.size}x{args.size}x{args.frames}", "batch": args.batch_size,
                  "steps": args.steps, "threads": torch.get_num_threads(), "torch": torch.__version__},
        "step_seconds": median, "step_ratio_fly_over_cache": median["on the fly"] / median["cache"],
        "step_seconds_min": best, "step_min_ratio_fly_over_cache": best["on the fly"] / best["cache"],
        "fetch_and_encode_seconds": parts,
        "build_clips_per_s": len(cache) / build_seconds, "bare_clips_per_s": bare_clips / bare_seconds,
        "build_over_bare": (len(cache) / build_seconds) / (bare_clips / bare_seconds),
        "cache_bytes_per_sample": shard_bytes / len(cache),
        "cache_latent_bytes": int(cache.latent_bytes[0]), "cache_caption_bytes_mean": float(cache.text_bytes.mean()),
        "cache_caption_tokens_mean": float(cache.text_len.mean()), "cache_caption_padded_bytes": 32 * 256 * 2,
        "opensora_240p_51": opensora_bytes(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
