"""One ``cache build`` at a time per cache folder: ``DIR/.lock``, as run folders have.

Without it a second build into the same ``--out`` removes the first's unfinished files as
leftovers of a kill, and the first dies on a file that vanished. The lock is a file created
exclusively, holding the builder's process id, host, start time and (on Linux) the process's
start tick, so that a lock left by a build that died on this host is recognised as stale, also
when its process id has been reused since, and taken over. A lock from another host cannot be
checked from here: the message names it and says to remove it if that build is gone.

The check-and-take runs under ``flock`` on the folder where the file system supports it, so
two builds finding one stale lock cannot both take it over.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

from videodit.data.feature_cache.format import LOCK
from videodit.errors import UserError
from videodit.user_files import read_user_text

_YOUNG = 10.0   # seconds: an unreadable lock younger than this is being written by its builder


def process_start_tick(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, tick: int | None) -> bool:
    if pid <= 0:   # os.kill(0, 0) would signal our own process group and succeed
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = process_start_tick(pid)
    return tick is None or now is None or now == tick   # another start tick: the id was reused


@contextlib.contextmanager
def _serialized(folder: Path):
    """``flock`` on ``folder`` for a moment, where the file system has it (else nothing)."""
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (ImportError, OSError):
        yield
        return
    try:
        for _ in range(500):   # held by another builder for microseconds; 5 s at most
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.01)
            except OSError:   # no flock here (some network file systems)
                break
        yield
    finally:
        os.close(fd)   # releases the flock


class BuildLock:
    """``folder/.lock`` for this process: ``acquire`` or a one-line refusal naming the holder."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK
        self.record: dict | None = None

    def acquire(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "tick": process_start_tick(os.getpid()),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with _serialized(self.folder):
            for _ in range(2):
                try:
                    fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
                except FileExistsError:
                    holder = self.holder()
                    if holder is not None:
                        raise UserError(holder) from None
                    self.path.unlink(missing_ok=True)   # left by a build that is gone
                    continue
                try:
                    with os.fdopen(fd, "w") as handle:
                        json.dump(record, handle)
                except BaseException:   # a full disk: no half-written lock left behind
                    self.path.unlink(missing_ok=True)
                    raise
                self.record = record
                return
        raise UserError(f"cannot take {self.path}; remove it if no `videodit cache build` writes {self.folder}")

    def holder(self) -> str | None:
        """Why the existing lock holds (None: it is stale, its build is gone)."""
        try:
            record = json.loads(read_user_text(self.path, max_bytes=4096))
            pid, host = int(record["pid"]), str(record["host"])
            tick = None if record.get("tick") is None else int(record["tick"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            try:   # being written this instant, or the remains of a crash while it was
                young = time.time() - os.lstat(self.path).st_mtime < _YOUNG
            except OSError:
                return None
            if not young:
                return None
            pid, host, tick, record = "?", "?", None, {}
        else:
            if host == socket.gethostname() and not _alive(pid, tick):
                return None
        where = f"process {pid}" + ("" if host == socket.gethostname() else f" on {host}")
        return (f"--out {self.folder} is being built by another `videodit cache build` ({where}, started "
                f"{str(record.get('started', '?'))[:40]}); wait for it to finish, or pass another --out "
                f"(remove {self.path} if that build is gone)")

    def release(self) -> None:
        """Remove the lock if it is still this process's."""
        if self.record is None:
            return
        try:
            if json.loads(read_user_text(self.path, max_bytes=4096)) == self.record:
                self.path.unlink()
        except (OSError, ValueError):
            pass
        self.record = None
