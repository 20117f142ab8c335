"""Weights & Biases (``train.loggers: [..., wandb]``): the scalars TensorBoard gets, the resolved
config with the git commit, and the sample videos (the mp4s, with their soundtracks in an
audio-trained run) with their prompts as captions.

W&B's own settings come from its environment: ``WANDB_MODE=offline`` writes the run to disk
only (``wandb sync`` uploads it later), ``WANDB_DIR`` moves its files (default: the run
folder's ``wandb/``), ``WANDB_PROJECT`` (default ``videodit``) and ``WANDB_ENTITY`` place it.
The W&B run id is kept in ``wandb/run_id`` of the run folder (and in ``wandb_run_id`` beside it,
which survives a deleted ``wandb/``), so a ``resume=auto`` that continues from a checkpoint logs
into the same W&B run; ``WANDB_RUN_ID`` names another one to continue.

What W&B would do quietly or slowly is refused up front, in one line each (``train/wandb_checks.py``,
before anything is built); its folder is checked again here, where the run folder is known."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from videodit.errors import UserError, os_error_message
from videodit.train.loggers import LoggerFailed, SampleVideo, scalars
from videodit.train.run_folder import replace_file
from videodit.train.runtime import git_commit
from videodit.train.wandb_checks import check_folder
from videodit.user_files import read_user_text

RUN_ID_FILE = Path("wandb") / "run_id"
RUN_ID_COPY = Path("wandb_run_id")   # the same id outside wandb/, which users delete to free space


class WandbLogger:
    def __init__(self, run_dir: Path, *, config: dict, resuming: bool):
        import wandb

        self._wandb = wandb
        root = Path(os.environ["WANDB_DIR"]) if os.environ.get("WANDB_DIR") else run_dir
        check_folder(root, "WANDB_DIR" if os.environ.get("WANDB_DIR") else None)   # the run folder's disk too
        run_id, notice = _run_id(run_dir, resuming)
        self._quiet = _HandlerErrorsSilenced()   # W&B's log handlers on a disk that fills: no flood
        try:
            self._run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "videodit",
                                   name=run_dir.resolve().name, id=run_id, resume="allow" if run_id else None,
                                   dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
                                   config={**config, "git_commit": git_commit()})
        except wandb.Error as exc:
            self._quiet.restore()
            raise UserError(f"W&B could not start a run: {_one_line(exc).rstrip('.')}; log in with `wandb login`, "
                            "or run with WANDB_MODE=offline and upload later with `wandb sync`") from None
        except OSError as exc:
            self._quiet.restore()
            raise UserError(f"W&B could not write its run files: {_w_and_b_error(exc)}") from None
        if notice == "new":
            print(f"note: {run_dir / RUN_ID_FILE} is gone, so this resume logs to a new W&B run {self._run.id}, not "
                  "the one its earlier steps went to (if any); to continue that one instead, run again with "
                  "WANDB_RUN_ID=<its id>", file=sys.stderr, flush=True)
        elif notice:
            print(notice, file=sys.stderr, flush=True)
        for path in (run_dir / RUN_ID_FILE, run_dir / RUN_ID_COPY):
            if not path.is_file() or read_user_text(path, max_bytes=256).strip() != self._run.id:
                path.parent.mkdir(parents=True, exist_ok=True)
                replace_file(path, self._run.id + "\n")

    def log(self, step: int, values: dict) -> None:
        self._guarded(self._run.log, scalars(values), step=step)

    def log_videos(self, step: int, videos: list[SampleVideo]) -> None:
        # the mp4 as written, its soundtrack included; from raw frames W&B would need moviepy and
        # the clip would be silent
        Video = self._wandb.Video
        self._guarded(self._run.log, {v.tag: Video(str(v.path), caption=v.prompt) for v in videos}, step=step)

    def close(self) -> None:
        try:
            self._guarded(self._run.finish)
        finally:
            self._quiet.restore()

    def _guarded(self, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except self._wandb.Error as exc:
            raise LoggerFailed(f"W&B: {_one_line(exc)}") from None
        except OSError as exc:   # a media file copied into a full W&B folder: name that folder, not the source
            raise LoggerFailed(f"W&B: {_w_and_b_error(exc)}") from None


def _run_id(run_dir: Path, resuming: bool) -> tuple[str | None, str | None]:
    """(the W&B run id to continue or None for a new run, a note to print: None, "new" or a line).
    ``WANDB_RUN_ID`` wins; a run that starts over (no checkpoint to continue from) is a new W&B run."""
    if os.environ.get("WANDB_RUN_ID"):
        return os.environ["WANDB_RUN_ID"].strip(), None
    if not resuming:
        return None, None
    kept, copy = run_dir / RUN_ID_FILE, run_dir / RUN_ID_COPY
    for path in (kept, copy):
        if path.is_file():
            run_id = read_user_text(path, max_bytes=256).strip() or None
            if run_id and path == copy:
                return run_id, (f"note: {kept} is gone ({run_dir / 'wandb'} deleted?); W&B run {run_id} goes on, its "
                                f"id read from {copy} (unsynced offline files deleted with that folder are lost)")
            if run_id:
                return run_id, None
    return None, "new"


def _w_and_b_error(exc: OSError) -> str:
    """One line for a failed write of W&B's, naming its own file (a copy's target, not its source)."""
    target = exc.filename2 or exc.filename
    return os_error_message(OSError(exc.errno, exc.strerror or str(exc), target)) if target else _one_line(exc)


class _HandlerErrorsSilenced:
    """``logging.raiseExceptions`` off while W&B runs: a log handler of W&B's that cannot write
    (a full disk) would print a traceback per record (tens of thousands); the failure itself
    reaches the trainer through the calls that fail."""

    def __init__(self):
        self._before = logging.raiseExceptions
        logging.raiseExceptions = False

    def restore(self) -> None:
        if self._before is not None:
            logging.raiseExceptions, self._before = self._before, None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__
