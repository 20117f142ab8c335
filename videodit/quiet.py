"""Imports that should not talk: torchao logs a warning for every optional kernel library it
cannot load (mxfp8, CUTLASS sm90a), none of which videodit's float8 training or 8-bit AdamW use."""

from __future__ import annotations

import contextlib
import logging

TORCHAO_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_torchao():
    """Within it, torchao's loggers say errors only."""
    loggers = [logging.getLogger(name) for name in TORCHAO_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
