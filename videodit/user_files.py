"""The one rule for opening a file a user names: regular files only, never a blocking open.

A FIFO opened for reading blocks until a writer appears (forever, and a stop signal cannot
end it); a device streams without end; a socket is not a file at all. Every path that comes
from a user (a config, a CSV or Parquet file, a video, an image, a weights file, a cache
shard) goes through :func:`open_user_file`, or through :func:`check_regular_file` right
before a library that takes a path (safetensors, PyAV, pyarrow, PIL) opens it.

The errors are ``OSError`` subclasses carrying the file name, so every caller's existing
handling of unreadable files (a one-line error, or a skipped and reported clip) applies, and
:func:`videodit.errors.os_error_message` words them.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from videodit.errors import FileTooLarge, NotRegularFile

__all__ = ["FileTooLarge", "NotRegularFile", "check_regular_file", "open_user_fd", "open_user_file",
           "read_user_bytes", "read_user_json", "read_user_text"]

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refuse(path, mode: int) -> NotRegularFile:
    return NotRegularFile(errno.EINVAL, f"not a regular file but {_kind(mode)}; give a regular file", str(path))


def check_regular_file(path: str | os.PathLike) -> Path:
    """``path`` (a symlink to a regular file is fine), refused unless it is a regular file.
    For libraries that open by path: they would block on a FIFO or read a device forever."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise _refuse(path, info.st_mode)
    return Path(path)


def open_user_fd(path: str | os.PathLike, *, max_bytes: int | None = None) -> int:
    """A read-only descriptor of ``path``, refused unless it is a regular file of at most
    ``max_bytes``. The open itself never blocks: it is non-blocking until the file is known to
    be regular, then blocking as usual."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ENXIO:   # a socket (or a FIFO without a reader, never for O_RDONLY)
            raise NotRegularFile(errno.EINVAL, "not a regular file but a socket; give a regular file",
                                 str(path)) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refuse(path, info.st_mode)
        if max_bytes is not None and info.st_size > max_bytes:
            raise FileTooLarge(errno.EFBIG, f"{info.st_size} bytes, more than the {max_bytes} allowed for it",
                               str(path))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_user_file(path: str | os.PathLike, mode: str = "rb", *, max_bytes: int | None = None,
                   encoding: str | None = None):
    """``path`` opened for reading (``mode`` "rb" or "r") under :func:`open_user_fd`'s rule."""
    if mode not in ("rb", "r"):
        raise ValueError(f"open_user_file reads only, not mode {mode!r}")
    return os.fdopen(open_user_fd(path, max_bytes=max_bytes), mode, encoding=encoding if mode == "r" else None)


def read_user_bytes(path: str | os.PathLike, *, max_bytes: int | None = None) -> bytes:
    """The whole of a regular file of at most ``max_bytes`` (see :func:`open_user_file`)."""
    with open_user_file(path, "rb", max_bytes=max_bytes) as handle:
        data = handle.read() if max_bytes is None else handle.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:   # it grew after the check
        raise FileTooLarge(errno.EFBIG, f"more than the {max_bytes} bytes allowed for it", str(path))
    return data


def read_user_text(path: str | os.PathLike, *, max_bytes: int | None = None, encoding: str = "utf-8") -> str:
    """The text of a regular file of at most ``max_bytes``."""
    return read_user_bytes(path, max_bytes=max_bytes).decode(encoding)


JSON_MAX_BYTES = 64 << 20   # configs and weight indexes are kilobytes; this bounds a crafted one


def read_user_json(path: str | os.PathLike, *, max_bytes: int = JSON_MAX_BYTES):
    """The JSON value of a regular file of at most ``max_bytes``; ``ValueError`` for bad JSON,
    including nesting too deep to parse (which ``json`` reports as ``RecursionError``)."""
    import json

    text = read_user_text(path, max_bytes=max_bytes)
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to be a config") from None
