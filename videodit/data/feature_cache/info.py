"""``videodit cache info DIR``: what a cache holds, per bucket, in bytes, and from which encoders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from videodit.data.feature_cache.conditions import FIRST_FRAME, IMAGE, describe, held, image_bytes
from videodit.data.feature_cache.format import (INDEX, SHARDS, VALIDATION, describe_encoder, read_manifest,
                                                shard_name)
from videodit.data.feature_cache.reader import read_failed, read_index
from videodit.data.feature_cache.verify import record_of_part
from videodit.data.feature_cache.writer import part_problem, shard_done


def cache_summary(folder: str | Path) -> dict:
    """A JSON-able summary of a cache folder (complete or not) and of its validation part."""
    folder = Path(folder)
    manifest = read_manifest(folder, option="cache folder")
    done = len(list((folder / SHARDS).glob("shard-*.parquet"))) if (folder / SHARDS).is_dir() else 0
    shard_bytes = sum(p.stat().st_size for p in (folder / SHARDS).glob("shard-*.safetensors")) \
        if (folder / SHARDS).is_dir() else 0
    summary = {
        "folder": str(folder), "complete": (folder / INDEX).exists(), "shards": manifest["shards"],
        "shards_written": done, "source": manifest["source"], "views": manifest["views"], "dtype": manifest["dtype"],
        "latents": manifest["latents"], "encoders": manifest["encoders"], "latent": {
            k: v for k, v in manifest["latent"].items() if k != "frames"}, "text": manifest["text_geometry"],
        "frame_interval": manifest["layout"]["frame_interval"], "seed": manifest["seed"], "bytes": shard_bytes,
        "conditions": list(held(manifest)), "image_geometry": manifest.get("image_geometry"),
        **check_shards(folder, manifest),
    }
    if summary["complete"]:
        index, _ = read_index(folder, manifest, option="cache folder")   # damaged: one line naming it
        bucket, latent_bytes, text_bytes, tokens = (index[k] for k in ("bucket", "latent_bytes", "text_bytes",
                                                                        "text_len"))
        # Conditions have no index column: the first frame's latents are a latent's size, image
        # features the same size for every sample.
        first_frame_bytes = latent_bytes if FIRST_FRAME in summary["conditions"] else \
            np.zeros_like(latent_bytes)
        condition_bytes = first_frame_bytes + image_bytes(manifest)
        rows = []
        for b, shape in enumerate(manifest["layout"]["buckets"]):
            members = bucket == b
            if members.any():
                rows.append({"resolution": shape[0], "num_frames": shape[1], "ratio": shape[2], "height": shape[3],
                             "width": shape[4], "samples": int(members.sum()),
                             "latent_shape": manifest["latent"]["shapes"].get(str(b)),
                             "bytes": int(latent_bytes[members].sum() + text_bytes[members].sum()
                                          + condition_bytes[members].sum())})
        failed = read_failed(folder, manifest)
        summary.update(samples=len(bucket), clips=int(len(np.unique(index["clip"]))), buckets=rows,
                       latent_bytes=int(latent_bytes.sum()), text_bytes=int(text_bytes.sum()),
                       condition_bytes=int(condition_bytes.sum()),
                       mean_caption_tokens=float(tokens.mean()) if len(tokens) else 0.0,
                       mean_caption_bytes=float(text_bytes.mean()) if len(text_bytes) else 0.0,
                       padded_caption_bytes=manifest["text_geometry"]["max_length"] * manifest["text_geometry"]["dim"]
                       * (2 if manifest["dtype"] == "bf16" else 4),
                       unreadable=0 if failed is None else failed.num_rows,
                       unreadable_examples=[] if failed is None else [
                           f"{p}: {r}" for p, r in zip(failed.column("path").to_pylist()[:3],
                                                       failed.column("reason").to_pylist()[:3])])
    if (folder / VALIDATION).is_dir():
        summary["validation"] = cache_summary(folder / VALIDATION)
    return summary


def check_shards(folder: Path, manifest: dict) -> dict:
    """Every finished shard checked: its SHA-256 (where the build recorded one) and its header
    against its index part. ``checksums``: whether every finished shard has a recorded SHA-256
    (False: a cache built before checksums, "not verified")."""
    finished = [s for s in range(manifest["shards"]) if shard_done(folder, s)]
    recorded, damaged = 0, []
    for s in finished:
        problem = part_problem(folder, s, manifest)
        if problem:
            damaged.append({"shard": s, "path": str(folder / SHARDS / f"{shard_name(s)}.safetensors"),
                            "problem": problem})
        try:
            recorded += record_of_part(pq.read_schema(folder / SHARDS / f"{shard_name(s)}.parquet").metadata) \
                is not False
        except Exception:   # an index part that cannot be read: listed as damaged above, not "before checksums"
            recorded += 1
    return {"checksums": recorded == len(finished), "shards_checksummed": recorded, "shards_checked": len(finished),
            "damaged": damaged}


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _integrity(s: dict) -> str:
    checked, summed, damaged = s["shards_checked"], s["shards_checksummed"], s["damaged"]
    how = "SHA-256 and header" if summed == checked else \
        f"header only, not verified by checksum ({checked - summed} shard(s) built before checksums)" \
        if summed == 0 else f"header; SHA-256 of {summed} (the other {checked - summed} built before checksums, " \
        "not verified)"
    if not damaged:
        return f"shards: {checked} checked ({how}), none damaged"
    top = Path(s["folder"]).parent if Path(s["folder"]).name == VALIDATION else Path(s["folder"])
    names = "; ".join(f"{Path(d['path']).name}: {d['problem']}" for d in damaged[:5])
    return (f"DAMAGED: {len(damaged)} of {checked} shard(s) checked ({how}): {names}"
            f"{' ...' if len(damaged) > 5 else ''}; run `videodit cache build CONFIG --out {top}` again to "
            "re-encode them")


def format_summary(s: dict, indent: str = "") -> str:
    lines = [f"{s['folder']}: {'complete' if s['complete'] else 'INCOMPLETE'}, {s['shards_written']} of "
             f"{s['shards']} shards, {_size(s['bytes'])} of tensors ({s['dtype']}, latents: {s['latents']})",
             f"source: {s['source']['csv']} ({s['source']['rows']} rows), {s['views']} view(s), seed {s['seed']}, "
             f"frame_interval {s['frame_interval']}",
             f"VAE: {describe_encoder(s['encoders']['vae'])}; latents {s['latent']['channels']} channels, "
             f"{s['latent']['spatial_compression']}x spatial, {s['latent']['temporal_compression']}x temporal",
             f"text: {describe_encoder(s['encoders']['text'])}; {s['text']['dim']} wide, {s['text']['max_length']} "
             "tokens padded"]
    if s["conditions"]:
        which = describe(s["conditions"])
        if IMAGE in s["conditions"]:
            g = s["image_geometry"]
            which += f" ({g['tokens']} x {g['dim']} from {describe_encoder(s['encoders']['image'])})"
        lines.append(f"first-frame conditions (for a model that takes a given first frame): {which}")
    lines.append(_integrity(s))
    if s["complete"]:
        samples = max(s["samples"], 1)
        lines.append(f"{s['samples']} samples of {s['clips']} clips; per sample: latent "
                     f"{_size(s['latent_bytes'] / samples)}, "
                     f"caption {_size(s['mean_caption_bytes'])} ({s['mean_caption_tokens']:.1f} valid tokens; "
                     f"{_size(s['padded_caption_bytes'])} padded)"
                     + (f"; first-frame conditions {_size(s['condition_bytes'] / samples)}" if s["conditions"] else ""))
        if s["unreadable"]:
            lines.append(f"skipped {s['unreadable']} unreadable video(s), e.g. {'; '.join(s['unreadable_examples'])}")
        lines.append(f"{'resolution':<11}{'frames':>7}{'ratio':>7}{'HxW':>11}{'latent':>16}{'samples':>9}{'bytes':>11}")
        for r in s["buckets"]:
            latent = "x".join(map(str, r["latent_shape"])) if r["latent_shape"] else "-"
            size = f"{r['height']}x{r['width']}"
            lines.append(f"{r['resolution']:<11}{r['num_frames']:>7}{r['ratio']:>7}{size:>11}{latent:>16}"
                         f"{r['samples']:>9}{_size(r['bytes']):>11}")
    out = "\n".join(indent + line for line in lines)
    if "validation" in s:
        out += "\n" + indent + "validation set:\n" + format_summary(s["validation"], indent + "  ")
    return out
