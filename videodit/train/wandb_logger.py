"""Weights & Biases (``train.loggers: [..., wandb]``): the scalars TensorBoard gets, the resolved
config with the git commit, and the sample videos with their prompts as captions.

W&B's own settings come from its environment: ``WANDB_MODE=offline`` writes the run to disk
only (``wandb sync`` uploads it later), ``WANDB_DIR`` moves its files (default: the run
folder's ``wandb/``), ``WANDB_PROJECT`` (default ``videodit``) and ``WANDB_ENTITY`` place it.
The W&B run id is kept in ``wandb/run_id`` of the run folder, so a ``resume=auto`` that
continues from a checkpoint logs into the same W&B run."""

from __future__ import annotations

import os
from pathlib import Path

from videodit.errors import UserError
from videodit.train.loggers import LoggerFailed, SampleVideo, scalars
from videodit.train.run_folder import replace_file
from videodit.train.runtime import git_commit
from videodit.user_files import read_user_text

RUN_ID_FILE = Path("wandb") / "run_id"


class WandbLogger:
    def __init__(self, run_dir: Path, *, config: dict, resuming: bool):
        import wandb

        self._wandb = wandb
        id_path = run_dir / RUN_ID_FILE
        # A run that starts over (no checkpoint to continue from) is a new W&B run.
        run_id = (read_user_text(id_path, max_bytes=256).strip() or None) if resuming and id_path.exists() else None
        try:
            self._run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "videodit",
                                   name=run_dir.resolve().name, id=run_id, resume="allow" if run_id else None,
                                   dir=None if os.environ.get("WANDB_DIR") else str(run_dir),
                                   config={**config, "git_commit": git_commit()})
        except wandb.Error as exc:
            raise UserError(f"W&B could not start a run: {_one_line(exc).rstrip('.')}; log in with `wandb login`, "
                            "or run with WANDB_MODE=offline and upload later with `wandb sync`") from None
        if self._run.id != run_id:
            id_path.parent.mkdir(parents=True, exist_ok=True)
            replace_file(id_path, self._run.id + "\n")

    def log(self, step: int, values: dict) -> None:
        self._guarded(self._run.log, scalars(values), step=step)

    def log_videos(self, step: int, videos: list[SampleVideo]) -> None:
        Video = self._wandb.Video   # the mp4 as written; from raw frames W&B would need moviepy
        self._guarded(self._run.log, {v.tag: Video(str(v.path), caption=v.prompt) for v in videos}, step=step)

    def close(self) -> None:
        self._guarded(self._run.finish)

    def _guarded(self, fn, *args, **kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except self._wandb.Error as exc:
            raise LoggerFailed(f"W&B: {_one_line(exc)}") from None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__
