"""Writing a new folder whole or not at all: a staging folder beside it, filled, fsynced and
renamed into place; on any failure removed with the parent folders made for it, so a refused or
failed export or import leaves nothing and the same command can run again. A staging folder a
killed process left is removed by the next write beside it (its owner record says whose it was).

    with staged_folder(out_dir, verb) as staging: ...   fill ``staging``; it becomes ``out_dir``
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
from pathlib import Path

from videodit.checkpoint.io import STAGING_PREFIX, describe_os_error, warn
from videodit.checkpoint.manager import _pid_alive
from videodit.checkpoint.writer import fsync_path
from videodit.errors import UserError
from videodit.user_files import read_user_json


def check_empty(out_dir: str | Path) -> None:
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir} already exists and is not empty; pass a new output folder or delete it")


@contextlib.contextmanager
def staged_folder(out_dir: str | Path, verb: str = "export"):
    """A staging folder beside the new (or empty) folder ``out_dir`` to fill: fsynced and renamed
    into place when the block ends; when it raises, removed, with the parent folders this call made,
    so a refused or failed write leaves nothing and the same command can run again."""
    out_dir = Path(out_dir)
    check_empty(out_dir)
    parent = out_dir.parent
    made = [folder for folder in (parent, *parent.parents) if not folder.exists()]
    staging = parent / f"{STAGING_PREFIX}{out_dir.name}-{os.getpid()}"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(parent, out_dir.name)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        (staging / STAGING_OWNER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
        yield staging
        (staging / STAGING_OWNER).unlink()
        fsync_path(staging)
        os.replace(staging, out_dir)   # onto a missing or empty folder
        fsync_path(parent)
    except OSError as exc:
        _remove(staging, made)
        what, kind = describe_os_error(exc)
        fix = {"space": f"free space in {parent}",
               "permission": f"make {parent} writable or {verb} to a writable folder",
               "other": f"fix the problem with {parent} and {verb} again"}[kind]
        message = " ".join(f"{verb} failed: {what}; {fix}; nothing was written to {out_dir}".split())
        raise UserError(message) from exc
    except BaseException:
        _remove(staging, made)
        raise


def _remove(staging: Path, made: list[Path]) -> None:
    """Remove a staging folder and the (empty) parent folders made for it, deepest first."""
    shutil.rmtree(staging, ignore_errors=True)
    for folder in made:
        with contextlib.suppress(OSError):
            folder.rmdir()


# Inside a staging folder while it is written: who writes it ({"pid", "host"}), so the next
# export or import beside it removes it once that process is gone (a killed export).
STAGING_OWNER = ".videodit-staging.json"


def remove_stale_staging(parent: Path, name: str) -> list[Path]:
    """Remove the staging folders that exports and imports killed before their rename left in
    ``parent`` (``.staging-NAME-PID``): those of ``name`` (the same output again) whose process
    is gone, and those of any name whose owner record says a process of this host that is gone.
    A folder of a process still running, or of another host (a shared folder), stays."""
    removed = []
    with contextlib.suppress(OSError):
        for path in sorted(parent.iterdir()):
            match = re.fullmatch(re.escape(STAGING_PREFIX) + r"(.+)-(\d+)", path.name)
            if match is None or not path.is_dir() or path.is_symlink() or int(match.group(2)) == os.getpid():
                continue
            owner = _staging_owner(path)
            if owner is not None:
                stale = owner["host"] == socket.gethostname() and not _pid_alive(owner["pid"])
            else:   # killed before it wrote its record (or written by an older videodit): only our own output's
                stale = match.group(1) == name and not _pid_alive(int(match.group(2)))
            if stale:
                shutil.rmtree(path, ignore_errors=True)
                if not path.exists():
                    removed.append(path)
                    warn(f"removed {path}, left by an export or import that was stopped before it finished")
    return removed


def _staging_owner(path: Path) -> dict | None:
    try:
        owner = read_user_json(path / STAGING_OWNER, max_bytes=1 << 16)
        return {"pid": int(owner["pid"]), "host": str(owner["host"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None
