"""``videodit cache build`` and ``videodit cache info``."""

from __future__ import annotations

import json
from pathlib import Path

from videodit.cli.args import positive_int, split_config_args
from videodit.errors import UserError


def cmd_cache_build(ns) -> int:
    from videodit.cache import build_cache
    from videodit.checkpoint.tools import managed_folder
    from videodit.config import load_config

    config, overrides = split_config_args(ns.args)
    cfg = load_config(config, overrides)
    if (managed := managed_folder(ns.out)) is not None:   # a run's checkpoints/, a checkpoint, another cache
        raise UserError(f"{ns.out} is inside {managed}: anything written there may be deleted; build the cache in a "
                        "folder outside it")
    done = build_cache(cfg, ns.out, views=ns.views, shard_size=ns.shard_size, dtype=ns.dtype,
                       batch_size=ns.batch_size)
    if "samples" in done:   # rank 0, which wrote the index: a cache of nothing is no success
        _refuse_empty(Path(ns.out), "data.csv")
        if cfg.validation.csv:
            from videodit.data.feature_cache.format import VALIDATION
            _refuse_empty(Path(ns.out) / VALIDATION, "validation.csv")
    return 0


def _refuse_empty(folder: Path, option: str) -> None:
    """One line when a finished cache holds no sample: every video of ``option`` failed to decode."""
    import pyarrow.parquet as pq

    from videodit.data.feature_cache.format import FAILED, INDEX

    if not (folder / INDEX).is_file() or pq.read_metadata(folder / INDEX).num_rows:
        return   # unfinished (no index), or samples to train on
    failed, first = 0, ""
    if (folder / FAILED).is_file():
        failed = pq.read_metadata(folder / FAILED).num_rows
        rows = pq.read_table(folder / FAILED).slice(0, 1).to_pylist()
        first = f", e.g. {rows[0]['path']}: {rows[0]['reason']}" if rows else ""
    first = first if len(first) <= 300 else first[:297] + "..."
    raise UserError(f"the cache {folder} holds 0 samples: all {failed} video(s) of {option} failed to decode"
                    f"{first}; fix those files (or {option}), then delete {folder} and build again "
                    f"(`videodit cache info {folder}` lists the reasons)")


def cmd_cache_info(ns) -> int:
    from videodit.data.feature_cache.info import cache_summary, format_summary

    summary = cache_summary(ns.dir)
    print(json.dumps(summary, indent=1) if ns.json else format_summary(summary))
    return 1 if summary.get("damaged") else 0   # a damaged cache is not healthy, for scripts too


def register(sub) -> None:
    p = sub.add_parser("cache", help="precompute VAE latents and caption embeddings (train with data.cache=DIR)")
    csub = p.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    q = csub.add_parser("build", help="encode every sample of a config's data once",
                        description="Decode every sample of CONFIG's data (data.csv, and validation.csv when set) at "
                        "its bucket's shape, encode it with the config's VAE and text encoder, and store the "
                        "latents and the valid caption tokens in sharded files. Runs under torchrun (samples "
                        "split across ranks) and resumes after a kill. See docs/feature_cache.md.")
    q.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]")
    q.add_argument("--out", required=True, help="cache folder (new, empty, or an unfinished build of this config); "
                   "one build at a time: a second refuses while DIR/.lock names a live build")
    q.add_argument("--views", type=positive_int, default=1,
                   help="views per clip: view v is epoch v's bucket and frame window (default 1)")
    q.add_argument("--shard-size", type=positive_int, default=256, help="samples per shard file (default 256)")
    q.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="stored precision (default bf16)")
    q.add_argument("--batch-size", type=positive_int, default=8, help="clips encoded at once (default 8)")
    q.set_defaults(func=cmd_cache_build)
    q = csub.add_parser("info", help="summarise a cache: samples per bucket, bytes, encoders",
                        description="Summarise a feature cache.")
    q.add_argument("dir", help="cache folder")
    q.add_argument("--json", action="store_true", help="print a JSON object")
    q.set_defaults(func=cmd_cache_info)
