"""Folders built once and shared by the processes of a node: the metadata cache
(``data/metadata.py``) and arrays derived from it (an epoch's bucket assignment).

``build_once(entry, build)`` makes the folder ``entry`` by calling ``build(tmp)`` on a
temporary folder and renaming it into place, so it is complete or absent. One process builds
at a time, under an exclusive ``flock`` on ``.<entry>.lock`` beside it; the others block on
that lock (asleep, no polling) and then find the folder made. Local rank 0 (``LOCAL_RANK``)
is the one that builds: the other local ranks first wait up to a minute for it to take the
lock. A builder that fails or dies releases the lock, and the next process in line builds
instead, so nothing waits forever on a crashed rank and no stale marker needs clearing. A
folder shared by several nodes (NFS home) works the same way, with one builder in all.

No torch.distributed: processes agree through the file system only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np

from videodit.user_files import open_user_file

WAIT_FOR_FIRST_RANK_S = 60.0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK") or 0)


def cache_folder(setting, size: int, auto_bytes: int) -> Path | None:
    """The folder ``data.metadata_cache`` names: None for ``off``; for ``auto``,
    ``$XDG_CACHE_HOME/videodit/metadata`` (default ``~/.cache``) when the file has at least
    ``auto_bytes`` bytes, else None."""
    if setting is None or str(setting) in ("off", ""):
        return None
    if str(setting) != "auto":
        return Path(setting).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "videodit" / "metadata" if size >= auto_bytes else None


def entry_key(path: Path, version: str, sample: int = 1 << 16, blocks: int = 64) -> str:
    """A folder name from a file's identity and a hash of its content, so every rank computes
    it without a full read: its inode and ctime (``st_ctime_ns``: set by the kernel on every
    write and every ``utime``, and no call sets it back, so an edit whose mtime was restored
    with ``touch -r``, ``cp -p`` or ``rsync -t`` still changes the key, and a copy or a file
    put in its place has a new inode), its size and mtime, and 64 evenly spread 64 KiB blocks
    (all of it when smaller). The device id is left out: an NFS mount's differs from node to
    node, which would make each node of a shared cache folder build its own entry."""
    stat = path.stat()
    _settle(stat.st_ctime_ns)
    digest = hashlib.sha256(f"{version}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ino}\0"
                            f"{stat.st_ctime_ns}\0".encode())
    with open_user_file(path) as handle:   # a FIFO put in its place is refused, never blocked on
        if stat.st_size <= sample * blocks:
            digest.update(handle.read())
        for offset in np.linspace(0, stat.st_size - sample, blocks if stat.st_size > sample * blocks else 0):
            handle.seek(int(offset))
            digest.update(handle.read(sample))
    return digest.hexdigest()[:32]


def _settle(ctime_ns: int, tick_ns: int = 25_000_000) -> None:
    """Wait until the kernel's clock has passed a just-changed file's ctime (at most 25 ms),
    so an edit made after this read cannot be stamped with the same ctime: some file
    systems stamp with a clock that only moves once per timer tick (1-10 ms)."""
    wait = ctime_ns + tick_ns - time.time_ns()
    if 0 < wait <= tick_ns:   # a ctime further ahead is another machine's clock (NFS): no wait helps
        time.sleep(wait / 1e9)


def build_once(entry: Path, build: Callable[[Path], None]) -> bool:
    """Make the folder ``entry`` with ``build(tmp)`` unless it exists; True if this process did."""
    if entry.is_dir():
        return False
    entry.parent.mkdir(parents=True, exist_ok=True)
    lock = entry.parent / f".{entry.name}.lock"
    deadline = time.monotonic() + (WAIT_FOR_FIRST_RANK_S if local_rank() > 0 else 0)
    while time.monotonic() < deadline and not entry.is_dir() and not locked(lock):
        time.sleep(0.05)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if entry.is_dir():
            return False
        tmp = entry.parent / f".{entry.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            build(tmp)
            os.rename(tmp, entry)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            if entry.is_dir():   # another node's builder won a race over a shared folder
                return False
            raise
        return True
    finally:
        os.close(fd)


def locked(lock: Path) -> bool:
    """Whether some process holds ``lock`` (is building) right now."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)   # the last use, for pruning


def prune(folder: Path, keep: int | None = None, max_age_s: float = 30 * 86400) -> None:
    """Remove the entries of ``folder`` unused for ``max_age_s`` (or all but the ``keep`` most
    recently used; use is ``touch``ed on ``manifest.json`` or the entry itself), and locks and
    half-built folders left more than a day ago."""
    with contextlib.suppress(OSError):
        now, entries = time.time(), []
        for child in folder.iterdir():
            if child.name.startswith("."):   # a lock, or what a build that died left behind
                stale = child.name.endswith(".tmp") or not (folder / child.name[1:-len(".lock")]).is_dir()
                if stale and now - child.stat().st_mtime > 86400:
                    shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink()
            elif child.is_dir():
                used = child / "manifest.json"
                entries.append(((used if used.exists() else child).stat().st_mtime, child))
        for i, (used, child) in enumerate(sorted(entries, reverse=True)):
            if now - used > max_age_s or (keep is not None and i >= keep):
                shutil.rmtree(child, ignore_errors=True)
