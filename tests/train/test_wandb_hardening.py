"""W&B where it used to go wrong quietly or slowly (#35 item 8), each one line and fast: a full
WANDB_DIR (once ~27,700 lines of tracebacks, then an error naming the run folder's disk), an
unwritable one (W&B moved the run to /tmp/wandb), an online mode without a reachable server
(~100 s of retries), a write that fails mid-run (named its source, not W&B's file), and a
deleted RUN/wandb on resume (a new W&B run id, silently).

W&B runs offline here, or online against a closed port on 127.0.0.1; this process may reach no
other address (W&B's local service socket is allowed), and W&B's machine probes are off."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import tiny_overrides
from videodit.cli import main

pytest.importorskip("wandb")

WANDB_SAFE_ENV = {"WANDB_SILENT": "true", "WANDB__DISABLE_STATS": "true", "WANDB__DISABLE_META": "true",
                  "WANDB__DISABLE_MACHINE_INFO": "true",
                  "WANDB__STATS_COREWEAVE_METADATA_BASE_URL": "http://127.0.0.1:9"}


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """W&B offline, its own folders under tmp_path, the system temp folder too (where W&B would
    quietly fall back to), and no network but loopback."""
    home = tmp_path / "wandb-home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name, value in WANDB_SAFE_ENV.items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))
    for name in ("WANDB_DIR", "WANDB_RUN_ID", "WANDB_PROJECT", "WANDB_RESUME", "WANDB_BASE_URL", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(system_tmp))
    connect = socket.socket.connect

    def loopback_only(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise RuntimeError(f"network access attempted during an offline test: {address}")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)
    yield system_tmp
    import wandb
    wandb.teardown()


def refused_before_anything_is_built(toy_dir, tmp_path, monkeypatch, capsys) -> str:
    """Train with W&B as the environment says; assert one error line, exit 2, no model built and no
    run folder; return the line."""
    def never(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr("videodit.train.trainer.build_model", never)
    run = tmp_path / "run"
    code = main(["train", "--out", str(run), *tiny_overrides(toy_dir, **{"train.loggers": "[jsonl,wandb]"})])
    err = capsys.readouterr().err
    errors = [line for line in err.strip().splitlines() if line.startswith("error")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert len(err.strip().splitlines()) <= 3, err[-3000:]   # not a flood of W&B's tracebacks
    assert not run.exists()
    return errors[0]


@contextmanager
def tmpfs(where: Path, options: str):
    """A small tmpfs at ``where`` (root only; skips where mounting is not allowed)."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


# ------------------------------------------------------------------ WANDB_DIR


def test_a_full_wandb_dir_is_one_line_naming_its_disk(wandb_env, toy_dir, tmp_path, monkeypatch, capsys):
    """A real full disk: W&B's log handlers once printed a traceback per record (~27,700 lines)."""
    with tmpfs(tmp_path / "full", "size=64k") as full:
        with open(full / "filler", "wb", buffering=0) as filler:   # fill it to the last byte
            try:
                while True:
                    filler.write(b"\0" * 4096)
            except OSError:
                pass
        monkeypatch.setenv("WANDB_DIR", str(full))
        line = refused_before_anything_is_built(toy_dir, tmp_path, monkeypatch, capsys)
    assert f"WANDB_DIR={full}" in line and "full disk" in line and f"mounted at {full}" in line


def test_a_wandb_dir_with_too_little_room_is_refused(wandb_env, toy_dir, tmp_path, monkeypatch, capsys):
    import shutil

    from videodit.train import wandb_checks

    room = tmp_path / "room"
    room.mkdir()
    usage = shutil.disk_usage(room)
    monkeypatch.setattr(wandb_checks.shutil, "disk_usage", lambda path: usage._replace(free=5 << 20))
    monkeypatch.setenv("WANDB_DIR", str(room))
    line = refused_before_anything_is_built(toy_dir, tmp_path, monkeypatch, capsys)
    assert f"WANDB_DIR={room}" in line and "5 MiB free" in line and "another disk" in line


@pytest.mark.parametrize("how", ["under-a-file", "read-only"])
def test_an_unwritable_wandb_dir_is_refused_not_moved_to_tmp(wandb_env, toy_dir, tmp_path, monkeypatch, capsys, how):
    """W&B moved such a run to the system temp folder's wandb/ with a warning among its output."""
    if how == "under-a-file":
        (tmp_path / "a-file").write_text("x")
        target = tmp_path / "a-file" / "wandb-logs"
        monkeypatch.setenv("WANDB_DIR", str(target))
        line = refused_before_anything_is_built(toy_dir, tmp_path, monkeypatch, capsys)
        assert "is a file, not a folder" in line
    else:
        with tmpfs(tmp_path / "ro", "size=1m,ro") as target:
            monkeypatch.setenv("WANDB_DIR", str(target))
            line = refused_before_anything_is_built(toy_dir, tmp_path, monkeypatch, capsys)
        assert "not writable" in line
    assert f"WANDB_DIR={target}" in line and "set WANDB_DIR" in line
    assert not (wandb_env / "wandb").exists()   # nothing went to the temp folder


# ------------------------------------------------------------------ online without a server


def test_online_without_a_reachable_server_fails_in_seconds(tmp_path, toy_dir):
    """``wandb.init`` retried an unreachable server for ~100 s; the check refuses it up front. A
    fresh process (W&B's service is its own), against a closed loopback port: nothing leaves the
    machine."""
    port = closed_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}, **WANDB_SAFE_ENV,
           "WANDB_BASE_URL": f"http://127.0.0.1:{port}", "WANDB_API_KEY": "0" * 40,
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    run = tmp_path / "run"
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "videodit", "train", "--out", str(run),
                               *tiny_overrides(toy_dir, **{"train.loggers": "[jsonl,wandb]"})],
                              capture_output=True, text=True, timeout=90, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("an online run without a reachable W&B server did not stop within 90 s")
    seconds = time.monotonic() - started
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"127.0.0.1:{port} cannot be reached" in errors[0] and "WANDB_MODE=offline" in errors[0]
    assert not run.exists() and seconds < 60


def test_the_server_check_gives_up_on_a_silent_host_in_seconds(monkeypatch):
    """A host that never answers (a name lookup or connect that hangs) is given up after
    CONNECT_SECONDS."""
    import threading

    from videodit.errors import UserError
    from videodit.train import wandb_checks

    release = threading.Event()
    monkeypatch.setattr(wandb_checks, "CONNECT_SECONDS", 0.5)
    monkeypatch.setattr(wandb_checks.socket, "create_connection", lambda *a, **k: release.wait(30) and socket.socket())
    started = time.monotonic()
    with pytest.raises(UserError, match="no answer in 0.5 s"):
        wandb_checks.check_server("https://api.wandb.example")
    release.set()
    assert time.monotonic() - started < 5


# ------------------------------------------------------------------ mid-run and resume


def test_a_failed_media_copy_names_the_wandb_file_not_the_source(tmp_path):
    """A disk that fills mid-run: the mp4's copy into W&B's folder fails; the message named the
    mp4 in the run folder (another disk) and was not turned into the logger's failure."""
    from videodit.train.loggers import LoggerFailed
    from videodit.train.wandb_logger import WandbLogger

    import wandb

    logger = WandbLogger.__new__(WandbLogger)   # no run: only its guard is tried
    logger._wandb = wandb

    def copy_fails(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run/samples/00-a.mp4"), None,
                      "/mnt/wandb-disk/wandb/offline-run-x/files/media/videos/00-a.mp4")   # as shutil.copy raises

    with pytest.raises(LoggerFailed) as failed:
        logger._guarded(copy_fails)
    message = str(failed.value)
    assert "/mnt/wandb-disk/wandb/offline-run-x" in message and "run/samples" not in message
    assert "No space left" in message and "free space" in message


def wandb_run_ids(run: Path) -> list[str]:
    """The run id of every offline-run-* segment W&B wrote for ``run``, oldest first."""
    return [folder.name.rsplit("-", 1)[1] for folder in sorted(run.glob("wandb/offline-run-*"))]


@pytest.mark.parametrize("lost", ["wandb-folder", "every-id"])
def test_a_deleted_wandb_folder_on_resume_says_what_happens_to_the_run_id(wandb_env, toy_dir, tmp_path, capsys,
                                                                         lost):
    """Deleting RUN/wandb (W&B's files, e.g. to free space) used to start a new W&B run on resume
    without a word. The id is kept beside it too, so the same W&B run goes on, and the resume
    says so; with every copy of the id gone, it says that a new W&B run starts and how to go on
    in the old one."""
    import shutil

    run = tmp_path / "run"
    common = tiny_overrides(toy_dir, **{"train.loggers": "[jsonl,wandb]", "checkpoint.every_steps": 2,
                                        "train.max_steps": 2})
    assert main(["train", "--out", str(run), *common]) == 0
    first = (run / "wandb" / "run_id").read_text().strip()
    shutil.rmtree(run / "wandb")
    if lost == "every-id":
        (run / "wandb_run_id").unlink()
    capsys.readouterr()
    assert main(["train", "--out", str(run), *common, "train.max_steps=4", "resume=auto"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:") and "W&B" in line]
    assert len(notes) == 1, notes
    now = (run / "wandb" / "run_id").read_text().strip()
    if lost == "wandb-folder":
        assert now == first and wandb_run_ids(run) == [first]
        assert f"W&B run {first} goes on" in notes[0]
    else:
        assert now != first and wandb_run_ids(run) == [now]
        assert f"new W&B run {now}" in notes[0] and "WANDB_RUN_ID=" in notes[0]
    assert (run / "wandb_run_id").read_text().strip() == now
