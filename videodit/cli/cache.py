"""``videodit cache build`` and ``videodit cache info``."""

from __future__ import annotations

import json

from videodit.cli.args import positive_int, split_config_args


def cmd_cache_build(ns) -> int:
    from videodit.cache import build_cache
    from videodit.config import load_config

    config, overrides = split_config_args(ns.args)
    cfg = load_config(config, overrides)
    build_cache(cfg, ns.out, views=ns.views, shard_size=ns.shard_size, dtype=ns.dtype, batch_size=ns.batch_size)
    return 0


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
