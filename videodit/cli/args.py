"""Argument helpers shared by the command modules."""

from __future__ import annotations

import argparse
import math

from videodit.errors import UserError


def split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG] [key=value ...]``: the first argument without '=' names the config."""
    config = None
    overrides = []
    for arg in args:
        if "=" in arg:
            overrides.append(arg)
        elif config is None:
            config = arg
        else:
            raise UserError(f"unexpected argument {arg!r}: give one CONFIG, then key=value overrides")
    return config, overrides


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be 1 or more")
    return value


def guidance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0 (1 = no guidance)")
    return value


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is running out of memory: Python's MemoryError, CUDA's OutOfMemoryError,
    or the RuntimeError of torch's CPU allocator."""
    text = str(exc)
    return isinstance(exc, MemoryError) or "out of memory" in text.lower() or "can't allocate memory" in text


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:160] if text else type(exc).__name__
