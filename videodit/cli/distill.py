"""``videodit distill trajectories``: the teacher's trajectories of a trajectory run, computed once."""

from __future__ import annotations

from videodit.cli.args import positive_int, split_config_args
from videodit.errors import UserError


def cmd_distill_trajectories(ns) -> int:
    from videodit.checkpoint.tools import managed_folder
    from videodit.config import load_config
    from videodit.train.trajectory_build import build_trajectories

    config, overrides = split_config_args(ns.args)
    cfg = load_config(config, overrides)
    if (managed := managed_folder(ns.out)) is not None:   # a run's checkpoints/, a checkpoint, a feature cache
        raise UserError(f"{ns.out} is inside {managed}: anything written there may be deleted; compute the "
                        "trajectories in a folder outside it")
    build_trajectories(cfg, ns.out, shard_size=ns.shard_size, batch_size=ns.batch_size, dtype=ns.dtype)
    return 0


def register(sub) -> None:
    p = sub.add_parser("distill", help="precompute what a distillation run reads (train with distill.trajectories=DIR)")
    dsub = p.add_subparsers(dest="distill_command", required=True, metavar="ACTION")
    q = dsub.add_parser("trajectories", help="the guided teacher's ODE trajectories of a trajectory run, computed once",
                        description="Run the guided teacher of CONFIG (distill.method=trajectory) from seeded noise "
                        "for every clip of its data (epoch 0's bucket) and store the noise, the teacher's state at "
                        "every student sigma, the endpoint and the caption features in sharded, checksummed files. "
                        "Runs under torchrun (shards split across ranks) and resumes after a kill. Train with "
                        "distill.trajectories=DIR. See docs/distillation.md.")
    q.add_argument("args", nargs="*", metavar="[CONFIG] [key=value ...]")
    q.add_argument("--out", required=True, help="trajectory folder (new, empty, or an unfinished build of this "
                   "config); one build at a time")
    q.add_argument("--shard-size", type=positive_int, default=32, help="items per shard file (default 32)")
    q.add_argument("--batch-size", type=positive_int, default=1,
                   help="items the teacher runs at once (default 1: an item's bits do not depend on its neighbours)")
    q.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="stored precision (default fp32)")
    q.set_defaults(func=cmd_distill_trajectories)
