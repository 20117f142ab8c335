"""The ``videodit`` command line: one module per group of commands, each with ``register``.

Every subcommand turns a :class:`UserError` into one ``error: ...`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from videodit.cli import cache, ckpt, data, distill, plan, run
from videodit.errors import UserError, os_error_message


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="videodit", description="Train and sample Open-Sora-style video "
                                     "diffusion transformers.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for commands in (run, plan, data, cache, distill, ckpt):   # the order of `videodit --help`
        commands.register(sub)
    return parser


def _peer_gone(exc: RuntimeError) -> bool:
    """A collective that failed because another rank's process ended (gloo or NCCL)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return False
    text = str(exc).lower()
    return any(s in text for s in ("connection closed", "connection reset", "broken pipe", "socket closed",
                                   "nccl communicator was aborted", "remote process exited"))


def _rank_tag() -> str:
    """`` (rank N)`` under torchrun, so an error names the process that hit it."""
    return f" (rank {os.environ['RANK']})" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before or after options (train --out DIR key=value, or the reverse).
    ns, extra = parser.parse_known_args(argv)
    if extra:
        rest = "args" if hasattr(ns, "args") else "overrides" if hasattr(ns, "overrides") else None
        if rest is None or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        setattr(ns, rest, getattr(ns, rest) + extra)
    try:
        return ns.func(ns)
    except UserError as exc:
        print(f"error{_rank_tag()}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:   # a full disk, a read-only folder, a path that is a file
        if os.environ.get("VIDEODIT_TRACEBACK"):
            raise
        print(f"error{_rank_tag()}: {os_error_message(exc)} (VIDEODIT_TRACEBACK=1 shows where)", file=sys.stderr)
        return 2
    except RuntimeError as exc:   # under torchrun: another rank stopped, so a collective failed
        if not _peer_gone(exc) or os.environ.get("VIDEODIT_TRACEBACK"):
            raise
        print(f"error{_rank_tag()}: another rank stopped (see its message, if it left one), so this one stops too",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:   # a stop that broke off a data wait carries its signal's status
        print("interrupted", file=sys.stderr)
        return getattr(exc, "exit_status", 130)
