"""The run folder (``--out``): one writer at a time, and nothing written in it before every
check has passed.

A folder is a videodit run once it holds ``run_info.json``, ``checkpoints/`` or ``.lock``. A run goes
only into a new or empty folder or, with ``resume``, into its own run folder; a folder of
someone else's files is refused rather than written into. ``.lock`` (process id, host, start
time, launcher job) keeps a second run out while the first is alive; a lock left by a process
that died on this host is taken over, and so is one left by an earlier attempt of the same
launcher job on any host (a requeued Slurm job or a restarted torchrun rendezvous whose rank 0
now runs on another node).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from videodit.errors import UserError
from videodit.user_files import read_user_json

LOCK_NAME = ".lock"
RUN_MARKERS = ("run_info.json", "checkpoints", LOCK_NAME)


class RunFolder:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock_path = self.path / LOCK_NAME
        self._locked = False
        self._made = False   # lock() made the folder: unlock() removes it again while it is empty

    def is_run(self) -> bool:
        return any((self.path / name).exists() for name in RUN_MARKERS)

    def check(self, *, resuming: bool, has_checkpoints: bool) -> None:
        """Refuse a folder this run must not write into; writes nothing."""
        path = self.path
        if path.exists() and not path.is_dir():
            raise UserError(f"--out {path} is a file, not a folder; pass a new or empty folder")
        if not path.exists() or not any(path.iterdir()):
            return
        if not self.is_run():
            raise UserError(f"--out {path} holds files that are not a videodit run; pass a new or empty folder "
                            "(nothing was written)")
        if has_checkpoints and not resuming:
            raise UserError(f"{path} already holds checkpoints; pass resume=auto to continue that run or "
                            "--out NEW_DIR to start another")

    def lock(self) -> None:
        """Take the folder for this process, or refuse if a live run holds it."""
        self._made = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "job": launcher_job()}
        for _ in range(2):
            try:
                fd = os.open(self.lock_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None:
                    raise UserError(holder) from None
                self.lock_path.unlink(missing_ok=True)   # left by a process that is gone
                continue
            with os.fdopen(fd, "w") as handle:
                json.dump(record, handle)
            self._locked = True
            return
        raise UserError(f"cannot take {self.lock_path}; remove it if no run uses {self.path}")

    def _holder(self) -> str | None:
        """Why the existing lock still holds (None: its process is gone)."""
        try:
            record = read_user_json(self.lock_path, max_bytes=1 << 16)   # a FIFO there is refused, not read
            pid, host = int(record["pid"]), str(record["host"])
        except (OSError, ValueError, KeyError, TypeError):
            return None   # unreadable: a crash while writing it
        if host == socket.gethostname() and not _alive(pid):
            return None
        if launcher_job() is not None and record.get("job") == launcher_job():
            return None   # an earlier attempt of this very job: one job has one rank 0 alive at a time
        where = f"process {pid}" + ("" if host == socket.gethostname() else f" on {host}")
        return (f"{self.path} is in use by another run ({where}, started {record.get('started', '?')}); wait "
                f"for it to finish or pass --out NEW_DIR (remove {self.lock_path} if that run is gone)")

    def unlock(self) -> None:
        """Release the folder; one that lock() made and nothing was written into (a refused
        resume) is removed, so a refusal leaves no trace."""
        if self._locked:
            self.lock_path.unlink(missing_ok=True)
            self._locked = False
            if self._made:
                try:
                    self.path.rmdir()   # only while empty
                except OSError:
                    pass
                self._made = False

    def write_start(self, config_yaml: str, info: dict) -> None:
        """The run's config and run info, each replaced whole (never half-written)."""
        (self.path / "samples").mkdir(parents=True, exist_ok=True)
        replace_file(self.path / "config.yaml", config_yaml)
        replace_file(self.path / "run_info.json", json.dumps(info, indent=1))


def replace_file(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def launcher_job() -> str | None:
    """The id of the launcher's job this process belongs to (Slurm's job, else torchrun's
    rendezvous), the same on every attempt of it; None outside such a job."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
    return job if job and job != "none" else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
