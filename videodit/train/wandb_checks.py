"""The checks of W&B's settings that run before anything is built (``check_loggers``, rank 0):
what W&B would do quietly or slowly, refused in one line each. A W&B folder that cannot be written
(W&B would move the run to the system's temporary folder) or whose disk is full (W&B's own log
handlers would then print a traceback for every line they fail to write: tens of thousands), and an
online mode whose server cannot be reached (``wandb.init`` would retry for about 100 s)."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import tempfile
import threading
import urllib.parse
from pathlib import Path

from videodit.errors import UserError

MIN_FREE_BYTES = 100 << 20           # W&B's run files (history, media copies, logs) need room
CONNECT_SECONDS = 5.0                # an online W&B server that does not answer a TCP connect in this is unreachable
_OFFLINE_MODES = ("offline", "dryrun", "disabled")


def check_wandb() -> None:
    """Up front, on the rank that logs (rank 0): a ``WANDB_DIR`` that W&B could not use, and an
    online server that cannot be reached, each refused in one line."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    # The environment wins, as in W&B; else its settings files (`wandb offline`, `wandb login --host`).
    settings = None if os.environ.get("WANDB_MODE") else _settings()
    mode = str(os.environ.get("WANDB_MODE") or getattr(settings, "mode", None) or "online").lower()
    if mode == "disabled" or os.environ.get("WANDB_DISABLED", "").lower() in ("true", "1"):
        return
    if os.environ.get("WANDB_DIR"):
        check_folder(Path(os.environ["WANDB_DIR"]), "WANDB_DIR")
    if mode not in _OFFLINE_MODES:
        check_server(os.environ.get("WANDB_BASE_URL") or getattr(settings or _settings(), "base_url", None)
                     or "https://api.wandb.ai")


def check_folder(root: Path, name: str | None) -> None:
    """Refuse a W&B folder (``name``: the variable that set it; None: the run folder) that cannot
    be made, is not writable, or is on a disk with less than MIN_FREE_BYTES free."""
    root = Path(root).expanduser()
    shown = f"{name}={root}" if name else f"the run folder {root} (W&B writes into its wandb/)"
    fix = (f"set {name} to a folder you can write to, or unset it (W&B then writes into the run folder)" if name
           else "choose another --out, or set WANDB_DIR to a folder you can write to")
    base = root
    while not base.exists() and base != base.parent:   # what exists of it: nothing is created here
        base = base.parent
    if not base.is_dir():
        raise UserError(f"{shown} cannot be made: {base} is a file, not a folder; {fix} "
                        f"(W&B would quietly write to {tempfile.gettempdir()}/wandb instead)")
    try:
        with tempfile.TemporaryFile(dir=base) as probe:   # what W&B will do: write a file there
            probe.write(b"\0" * 4096)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
            raise UserError(f"{shown} is on a full disk ({_disk(base)}: {exc.strerror}); free space on that disk, or "
                            "set WANDB_DIR to a folder on another disk") from None
        raise UserError(f"{shown} is not writable ({exc.strerror}); {fix} (W&B would quietly write to "
                        f"{tempfile.gettempdir()}/wandb instead)") from None
    free = shutil.disk_usage(base).free
    if free < MIN_FREE_BYTES:
        raise UserError(f"{shown} is on a disk with {free >> 20} MiB free ({_disk(base)}), less than the "
                        f"{MIN_FREE_BYTES >> 20} MiB W&B needs for its run files; free space on that disk, or set "
                        "WANDB_DIR to a folder on another disk")


def check_server(base_url: str) -> None:
    """Refuse an online W&B whose server (or the proxy to it) does not take a TCP connection
    within CONNECT_SECONDS (name lookup included): ``wandb.init`` would retry for ~100 s."""
    url = urllib.parse.urlsplit(base_url)
    proxy = os.environ.get(f"{url.scheme}_proxy") or os.environ.get(f"{url.scheme.upper()}_PROXY")
    target = urllib.parse.urlsplit(proxy if proxy and "://" in proxy else f"http://{proxy}") if proxy else url
    host, port = target.hostname, target.port or (443 if target.scheme == "https" else 80)
    outcome: list = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=CONNECT_SECONDS).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(" ".join((exc.strerror or str(exc) or type(exc).__name__).split()))

    thread = threading.Thread(target=connect, daemon=True)   # a name lookup has no timeout of its own
    thread.start()
    thread.join(CONNECT_SECONDS + 1)
    reason = outcome[0] if outcome else f"no answer in {CONNECT_SECONDS:g} s"
    if host is None or reason is not None:
        via = f" through the proxy {proxy}" if proxy else ""
        raise UserError(f"W&B is online (WANDB_MODE={os.environ.get('WANDB_MODE') or 'unset'}) but its server "
                        f"{base_url} cannot be reached{via} ({reason or 'no host'}); check the network, or run with "
                        "WANDB_MODE=offline and upload later with `wandb sync`")


def _settings():
    """W&B's settings as ``wandb.init`` will resolve them (environment, settings files), without
    starting its service where this wandb release allows; None if they cannot be read."""
    try:
        from wandb.sdk import wandb_setup
        try:
            return wandb_setup._setup(start_service=False).settings
        except TypeError:   # an older release: its public setup
            import wandb
            return wandb.setup().settings
    except Exception:   # noqa: BLE001 - a check must not fail on W&B's internals; the environment decides then
        return None


def _disk(path: Path) -> str:
    """``the disk mounted at /data``: where ``path`` lives."""
    mount = path.resolve()
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return f"the disk mounted at {mount}"
