"""When to save, what to keep, and a log of both: :class:`CheckpointManager`.

It adds the policy on top of ``io.py``'s folders: when to save (every N steps / T minutes),
retention (last K, best N by a metric, never the checkpoint the run resumed from), an event
log ``checkpoints.jsonl`` (:func:`read_events`), cleanup of interrupted saves, verified
``latest()``, and optional background (async) saves.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import threading
import time
from pathlib import Path

import torch

from videodit.checkpoint.io import (DELETING_PREFIX, STAGING_PREFIX, checkpoint_name, clean_metrics, list_checkpoints,
                                    read_manifest, remove_dir, save_error, verify_checkpoint, warn, write_checkpoint)
from videodit.checkpoint.writer import tensor_bytes
from videodit.errors import UserError

LOG_NAME = "checkpoints.jsonl"
SET_ASIDE_PREFIX = "set-aside-"   # checkpoints kept out of the way of a resumed run's saves


def _metric_value(metrics: dict, metric: str) -> float | None:
    value = metrics.get(metric) if isinstance(metrics, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def best_checkpoints(entries: list[tuple[Path, dict]], metric: str, mode: str, n: int) -> list[Path]:
    """The ``n`` best of ``(path, metrics)`` by ``metric`` (``mode`` min|max); ties go to the older."""
    scored = [(value, i, path) for i, (path, metrics) in enumerate(entries)
              if (value := _metric_value(metrics, metric)) is not None]
    scored.sort(key=lambda item: (item[0] if mode == "min" else -item[0], item[1]))
    return [path for _, _, path in scored[:max(n, 0)]]


def _pid_of(name: str) -> int | None:
    match = re.search(r"-(\d+)$", name)
    return int(match.group(1)) if match else None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:   # EPERM: it exists, it is someone else's
        return True
    return True


class _Snapshotter:
    """CPU copies of nested states, in buffers kept from one async save to the next.

    Re-using the buffers makes the copy a memcpy into memory that is already mapped (fresh
    allocations of a model-sized state pay page faults on every save); CUDA tensors are
    copied into pinned buffers. Other values are deep-copied. The buffers hold one copy of
    the last async checkpoint's tensors until :meth:`release`.
    """

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self._used: set[tuple] = set()
        self._cuda = False

    def __call__(self, value):
        self._used, self._cuda = set(), False
        out = self._copy(value, ())
        for key in self.buffers.keys() - self._used:
            del self.buffers[key]
        if self._cuda:
            torch.cuda.synchronize()
        return out

    def _copy(self, value, key: tuple):
        if isinstance(value, torch.Tensor):
            source = value.detach()
            buffer = self.buffers.get(key)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=source.is_cuda)
                self.buffers[key] = buffer
            self._cuda |= source.is_cuda
            if source.device.type == "cpu" and source.is_contiguous() and source.numel():
                # One plain memcpy: copy_ splits large copies over OpenMP threads, which is
                # 30x slower (1.8 s vs 0.06 s per GB measured) when other work holds the cores.
                tensor_bytes(buffer)[:] = tensor_bytes(source)
            elif source.numel():
                buffer.copy_(source, non_blocking=source.is_cuda)
            self._used.add(key)
            return buffer
        if isinstance(value, dict):
            return {k: self._copy(v, key + (k,)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._copy(v, key + (i,)) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return copy.deepcopy(value)

    def release(self) -> None:
        self.buffers.clear()


class CheckpointManager:
    """When to save, what to keep, and a log of both, for the checkpoints of one run folder.

    Checkpoints go to ``run_dir/checkpoints/step-NNNNNNN``; events to
    ``run_dir/checkpoints.jsonl``. Retention after each save: the newest
    ``save_total_limit`` checkpoints by step (0 = keep all) plus the ``keep_best`` best by
    ``metric`` (``mode`` min|max, among checkpoints whose manifest has it) plus the one this
    run resumed from plus the one just saved; nothing else survives once a limit is set.
    ``keep_best`` alone only protects (it deletes nothing while ``save_total_limit`` is 0).

    ``writer`` writes one checkpoint folder: :func:`~videodit.checkpoint.io.write_checkpoint`
    (the default) or a function with its signature and contract that calls it, e.g. a test
    that slows saves down.
    """

    def __init__(self, run_dir: Path, *, every_steps: int = 0, every_minutes: float = 0.0,
                 save_total_limit: int = 0, keep_best: int = 0, metric: str = "val_loss",
                 mode: str = "min", resumed_from: Path | None = None, writer=write_checkpoint):
        for key, value in (("every_steps", every_steps), ("every_minutes", every_minutes),
                           ("save_total_limit", save_total_limit), ("keep_best", keep_best)):
            if value < 0:
                raise UserError(f"checkpoint.{key}={value} is negative; use 0 (off) or a positive number")
        if mode not in ("min", "max"):
            raise UserError(f"checkpoint.mode={mode!r} is not min or max; use checkpoint.mode=min "
                            f"(lower {metric} is better) or checkpoint.mode=max")
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "checkpoints"
        self.log_path = self.run_dir / LOG_NAME
        self.every_steps = int(every_steps)
        self.every_minutes = float(every_minutes)
        self.save_total_limit = int(save_total_limit)
        self.keep_best = int(keep_best)
        self.metric = metric
        self.mode = mode
        self.resumed_from = Path(resumed_from) if resumed_from is not None else None
        self._last_time = time.monotonic()
        self._last_step: int | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._writing: Path | None = None   # the staging folder of our own save in flight
        self._snapshot = _Snapshotter()
        self._writer = writer
        self.skipped: list[tuple[Path, str]] = []   # damaged checkpoints the last latest() passed over

    # ------------------------------------------------------------------ when

    def should_save(self, step: int) -> bool:
        """True every ``every_steps`` steps and/or once ``every_minutes`` have passed since the
        last save (or since the manager was made); never twice for the same step. With several
        processes, decide on one and broadcast: clocks differ."""
        if step == self._last_step:
            return False
        if self.every_steps and step % self.every_steps == 0:
            return True
        return bool(self.every_minutes) and time.monotonic() - self._last_time >= self.every_minutes * 60

    # ------------------------------------------------------------------ save

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(self, step: int, *, tensors: dict[str, dict[str, torch.Tensor]], torch_states: dict[str, dict],
             json_state: dict, config_yaml: str, metrics: dict | None = None, blocking: bool = True,
             write_shards=None) -> Path:
        """Save a checkpoint and apply retention; return its final path.

        ``blocking=False`` copies every tensor to CPU memory now (into buffers kept for the
        next async save: one checkpoint's worth of host memory, see :meth:`release_buffers`),
        then writes (and applies retention) in a background thread; the returned path exists
        once :meth:`wait` returns.
        At most one save is in flight: a save first waits for the previous one, and raises
        its error (UserError) if it failed. ``write_shards`` (see :func:`write_checkpoint`) is a
        collective with the other ranks, so a save that has it always blocks.
        """
        self.wait()
        self._last_step, self._last_time = step, time.monotonic()
        metrics = clean_metrics(metrics)
        final = self.root / checkpoint_name(step)
        if blocking or write_shards is not None:
            self._save_now(step, tensors, torch_states, json_state, config_yaml, metrics, started=time.time(),
                           write_shards=write_shards)
            return final
        started = time.time()
        job = (step, *self._snapshot((tensors, torch_states)), json.loads(json.dumps(json_state)),
               config_yaml, metrics)
        self._error = None
        self._thread = threading.Thread(target=self._background, args=job, kwargs={"started": started},
                                        name=f"videodit-checkpoint-{step}", daemon=False)
        self._thread.start()
        return final

    @property
    def snapshot_buffers(self) -> dict[tuple, torch.Tensor]:
        """The CPU buffers async saves keep for re-use, by position in the saved state (a copy
        of the mapping; the tensors are the buffers themselves). Empty after :meth:`release_buffers`."""
        return dict(self._snapshot.buffers)

    def release_buffers(self) -> None:
        """Free the CPU copy that async saves keep for re-use (after waiting for the save in flight)."""
        self.wait()
        self._snapshot.release()

    def wait(self) -> None:
        """Wait for a background save; raise its error as UserError if it failed."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is None:
            return
        if isinstance(error, UserError):
            raise UserError(str(error)) from error
        raise UserError(" ".join(f"checkpoint save failed in the background: {type(error).__name__}: {error}; "
                                 "earlier checkpoints are intact, see the traceback above".split())) from error

    def _background(self, *job, started: float) -> None:
        try:
            self._save_now(*job, started=started, blocking=False)
        except BaseException as exc:   # surfaces on the next save()/wait()
            self._error = exc
            warn(str(exc) if isinstance(exc, UserError) else f"background checkpoint save failed: {exc!r}")

    def _save_now(self, step, tensors, torch_states, json_state, config_yaml, metrics, *, started: float,
                  blocking: bool = True, write_shards=None) -> Path:
        def hook(staging: Path) -> None:
            self._writing = staging
        try:
            final, size = self._writer(self.root, step, tensors=tensors, torch_states=torch_states,
                                       json_state=json_state, config_yaml=config_yaml, metrics=metrics,
                                       staging_hook=hook, write_shards=write_shards)
        except OSError as exc:
            error = save_error(step, self.root, exc)
            self._log({"event": "save_failed", "step": step, "error": str(error)}, quiet=True)
            raise error from exc
        finally:
            self._writing = None
        self._log({"event": "save", "step": step, "path": self._rel(final), "metrics": metrics, "bytes": size,
                   "seconds": round(time.time() - started, 3), "async": not blocking,
                   "retention": {"save_total_limit": self.save_total_limit, "keep_best": self.keep_best,
                                 "metric": self.metric, "mode": self.mode}})
        try:
            self.apply_retention(just_saved=final)
        except OSError as exc:   # the save itself is complete: keep going
            warn(f"checkpoint retention failed after step {step}: {exc}; old checkpoints were kept")
        return final

    # ------------------------------------------------------------------ what to keep

    def retention_plan(self, just_saved: Path | None = None) -> dict[Path, str]:
        """Checkpoints retention would delete now, each with its reason."""
        if not self.save_total_limit:
            return {}
        found = list_checkpoints(self.root)
        keep = {p.resolve() for p in found[-self.save_total_limit:]}
        keep |= {p.resolve() for p in self.best()}
        if self.resumed_from is not None:
            keep.add(self.resumed_from.resolve())
        if just_saved is not None:
            keep.add(just_saved.resolve())
        reason = f"save_total_limit={self.save_total_limit}"
        if self.keep_best:
            reason += f", not among the {self.keep_best} best by {self.metric} ({self.mode})"
        return {p: reason for p in found if p.resolve() not in keep}

    def best(self) -> list[Path]:
        """The ``keep_best`` best checkpoints by ``metric``, best first."""
        if not self.keep_best:
            return []
        entries = [(p, (read_manifest(p) or {}).get("metrics") or {}) for p in list_checkpoints(self.root)]
        return best_checkpoints(entries, self.metric, self.mode, self.keep_best)

    def apply_retention(self, just_saved: Path | None = None) -> list[Path]:
        """Delete what :meth:`retention_plan` names (rename to ``.deleting-*``, then remove); log each."""
        deleted = []
        for path, reason in self.retention_plan(just_saved).items():
            manifest = read_manifest(path) or {}
            remove_dir(path, self.root)
            deleted.append(path)
            self._log({"event": "delete", "step": manifest.get("step"), "path": self._rel(path), "reason": reason,
                       "metrics": manifest.get("metrics") or {}})
        return deleted

    # ------------------------------------------------------------------ housekeeping

    def cleanup_staging(self) -> list[Path]:
        """Remove what interrupted saves and deletes left (``.staging-*``, ``.deleting-*``),
        except folders of another process that is still running; log and return them."""
        removed = []
        if not self.root.is_dir():
            return removed
        for path in sorted(self.root.iterdir()):
            is_staging = path.name.startswith(STAGING_PREFIX)
            if not (is_staging or path.name.startswith(DELETING_PREFIX)) or path == self._writing:
                continue
            pid = _pid_of(path.name)
            if pid is not None and pid != os.getpid() and _pid_alive(pid):
                print(f"checkpoints: leaving {path.name}: process {pid} is still running", flush=True)
                continue
            shutil.rmtree(path, ignore_errors=True)
            if path.exists():
                warn(f"could not remove {path}; delete it by hand")
                continue
            removed.append(path)
            kind = "interrupted save" if is_staging else "interrupted delete"
            print(f"checkpoints: removed {path.name} ({kind})", flush=True)
            self._log({"event": "cleanup", "path": self._rel(path),
                       "reason": f"{kind} left by process {pid}" if pid is not None else kind})
        return removed

    def latest(self) -> Path | None:
        """The newest checkpoint whose files all match their manifest checksums; damaged ones
        are skipped with a warning and listed in ``skipped`` as (path, problem)."""
        self.skipped = []
        for path in reversed(list_checkpoints(self.root)):
            problem = verify_checkpoint(path)
            if problem is None:
                return path
            self.skipped.append((path, problem))
            warn(f"skipping damaged checkpoint {path}: {problem}; using the next older one")
        return None

    def set_aside_after(self, step: int) -> list[Path]:
        """Rename the checkpoints newer than ``step`` (damaged ones ``resume=auto`` skipped, or
        newer ones of a run resumed from an earlier point) to ``set-aside-step-N``, so that
        this run's saves never replace them: they may still hold good weights. Logged."""
        moved = []
        for path in list_checkpoints(self.root):
            saved_step = int(path.name.split("-")[1])
            if saved_step <= step:
                continue
            target = path.with_name(f"{SET_ASIDE_PREFIX}{path.name}")
            suffix = 1
            while target.exists():
                target = path.with_name(f"{SET_ASIDE_PREFIX}{path.name}.{suffix}")
                suffix += 1
            path.rename(target)
            moved.append(target)
            print(f"checkpoints: set {path.name} aside as {target.name} (newer than the resumed step {step}; "
                  "nothing was deleted)", flush=True)
            self._log({"event": "set_aside", "path": self._rel(target), "step": saved_step,
                       "reason": f"newer than the resumed step {step}"})
        return moved

    def record_resume(self, path: Path) -> None:
        """Note that this run resumed from ``path``: it is never deleted, and ``ckpt list`` marks it."""
        self.resumed_from = Path(path)
        manifest = read_manifest(self.resumed_from) or {}
        self._log({"event": "resume", "step": manifest.get("step"), "path": self._rel(self.resumed_from)})

    # ------------------------------------------------------------------ the event log

    def _rel(self, path: Path) -> str:
        try:
            return str(Path(path).resolve().relative_to(self.run_dir.resolve()))
        except ValueError:
            return str(Path(path).resolve())

    def _log(self, event: dict, quiet: bool = False) -> None:
        record = {"event": event.pop("event"), **event, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        line = json.dumps(record) + "\n"
        with self._lock:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    os.write(fd, line.encode())
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as exc:
                if not quiet:
                    warn(f"could not append to {self.log_path}: {exc.strerror or exc}")


def read_events(run_dir: Path) -> list[dict]:
    """The events of ``run_dir/checkpoints.jsonl`` (unreadable lines skipped)."""
    path = Path(run_dir) / LOG_NAME
    events = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return events
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events
