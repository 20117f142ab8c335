"""Build and filter Open-Sora metadata CSVs from folders of videos and images.

``scan(paths, out_csv)``
    Walks files and folders (recursively) for videos (``VIDEO_SUFFIXES``) and still
    images (``IMAGE_SUFFIXES``), probes each one in worker processes and writes
    ``path,text,num_frames,height,width,aspect_ratio,fps,resolution`` with Open-Sora's
    conventions (``aspect_ratio = height / width``, ``resolution = height * width``,
    images are one frame at ``IMAGE_FPS``), then ``has_audio,audio_sample_rate,audio_channels``
    (``AUDIO_COLUMNS``: the first audio stream's header; ``False`` and empty cells for a file
    without one, an image included; all empty where the header could not be read).

    * Paths are written relative to the CSV's folder when the file lies under it, else
      absolute (``read_metadata`` resolves both the same way).
    * Folders: hidden files and folders (name starting with ``.``, e.g. the temporary
      files of an interrupted ``write_video``) are skipped, symlinked folders are not
      followed, other suffixes are ignored. A file named explicitly with a suffix that is
      neither a video nor an image is skipped and counted (``skipped``), so shell globs
      such as ``videos/*`` work.
    * Frame counts come from container metadata; only containers without a count (GIF)
      are decoded (``probe_video``). A container can lie: a cut-off mp4 whose index sits
      at the front still claims its full length. ``verify=True`` decodes every video,
      writes the decoded count and lists the changed files in ``corrected`` (about as
      slow as reading the whole dataset once); it also reports a video whose frame size
      changes mid-stream as unreadable (training would rescale those frames).
    * Captions (``captions=FILE``): a ``.csv`` file with ``path`` and ``text`` columns
      (others ignored), or any other suffix as UTF-8 lines ``path<TAB>caption``. Relative
      caption paths are looked up against the captions file's folder first, then the
      current directory. Later lines win over earlier ones; files without a caption get
      empty text; captions naming no scanned file are counted (``captions_unmatched``).
    * Files that cannot be read (empty, not a video, truncated, zero frames, or a
      decoder crash that kills the worker process) never stop the scan: they go into
      ``<out stem>.errors.csv`` next to the CSV (``meta.csv`` -> ``meta.errors.csv``)
      with columns ``path,error`` and paths written like the CSV's. The report is always
      written, header-only when nothing failed, so a stale one never survives.
    * Both files are written atomically (temporary file + ``os.replace``).

``filter_metadata(in_csv, out_csv, min_frames=..., ...)``
    Keeps the rows of a metadata CSV within inclusive bounds, with every column (extra
    ones too) in the original order and text (paths are not resolved). Rows that fail
    ``read_metadata`` validation are dropped and counted as ``invalid``.
"""

from __future__ import annotations

import csv
import io
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Callable

import av
import numpy as np
import pyarrow as pa
from tqdm import tqdm

from videodit.data.audio import AUDIO_COLUMNS, AudioReadError, probe_audio
from videodit.data.metadata import REQUIRED_COLUMNS, Source, table_writer, write_csv
from videodit.data.video import (IMAGE_SUFFIXES, VIDEO_SUFFIXES, VideoReadError, is_image_path, probe_video)
from videodit.errors import UserError
from videodit.user_files import NotRegularFile, check_regular_file, read_user_text

__all__ = ["SCAN_COLUMNS", "REPORT_COLUMNS", "FILTER_REASONS", "error_report_path", "scan",
           "filter_metadata"]

SCAN_COLUMNS = REQUIRED_COLUMNS + ("resolution",) + AUDIO_COLUMNS
REPORT_COLUMNS = ("path", "error")
MEDIA_SUFFIXES = VIDEO_SUFFIXES + IMAGE_SUFFIXES

# Files per task sent to a worker: large enough to amortise inter-process traffic, small
# enough that the progress bar moves and a worker crash re-probes few files serially.
_MAX_CHUNK = 64
_CHUNKS_PER_WORKER = 8


def error_report_path(out_csv: str | os.PathLike) -> Path:
    """Where ``scan`` writes its report of unreadable files: ``meta.csv`` -> ``meta.errors.csv``."""
    out_csv = Path(out_csv)
    return out_csv.with_name(f"{out_csv.stem}.errors.csv")


# --------------------------------------------------------------------------- scan


def scan(paths: list[str], out_csv: str, captions: str | None = None, workers: int = 0,
         progress: bool = True, verify: bool = False) -> dict:
    """Probe every video and image under ``paths`` and write an Open-Sora metadata CSV.

    ``workers``: probing processes (0 = ``os.cpu_count()``; 1 = in this process, without
    the protection against decoder crashes that worker processes give).
    ``verify``: decode every video and record the decoded frame count (see the module doc).
    Returns ``{"found", "ok", "failed", "skipped", "captioned", "captions_unmatched",
    "corrected", "seconds", "csv", "report", "workers"}``: ``found`` media files,
    ``ok`` rows written, ``failed`` report lines (unreadable files plus folders that could
    not be listed), ``skipped`` explicitly named non-media files; ``corrected`` lists the
    CSV paths whose container frame count was wrong (only with ``verify``).
    Bad arguments (no paths, a missing path, no media found, an unreadable captions file)
    raise ``UserError`` before anything is probed or written.
    """
    start = time.perf_counter()
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise UserError("no paths to scan; pass one or more video/image files or folders")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
        raise UserError(f"workers={workers!r} must be a whole number >= 0 (0 = one per CPU core)")
    out_csv = Path(out_csv)
    if out_csv.is_dir():
        raise UserError(f"output {str(out_csv)!r} is a folder; give a CSV file name such as "
                        f"{str(out_csv / 'meta.csv')!r}")
    report = error_report_path(out_csv)

    files, skipped, walk_errors = _collect_files(paths)
    if not files and not walk_errors:
        shown = ", ".join(repr(str(p)) for p in paths[:3]) + (" ..." if len(paths) > 3 else "")
        raise UserError(f"no videos or images found in {shown}; supported suffixes: "
                        f"{', '.join(MEDIA_SUFFIXES)}")
    caption_of = _read_captions(captions) if captions is not None else {}

    workers = workers or os.cpu_count() or 1
    with tqdm(total=len(files), desc="probing", unit="file", disable=not progress,
              file=sys.stderr, dynamic_ncols=True) as bar:
        results = _probe_files(files, workers, verify, bar)

    out_dir = os.path.abspath(out_csv.parent)
    caption_dir = os.path.dirname(os.path.abspath(captions)) if captions is not None else ""
    caption_by_file, captions_unmatched = _match_captions(caption_of, caption_dir, files)
    errors = [{"path": _csv_path(e["path"], out_dir), "error": e["error"]} for e in walk_errors]
    rows, corrected, captioned = [], [], 0
    for path, (info, error) in zip(files, results):
        shown = _csv_path(path, out_dir)
        if error is not None:
            errors.append({"path": shown, "error": error})
            continue
        text = caption_by_file.get(path, "")
        captioned += bool(text)
        if info.get("container_frames") is not None:
            corrected.append(shown)
        height, width = info["height"], info["width"]
        rows.append({"path": shown, "text": text, "num_frames": info["num_frames"], "height": height,
                     "width": width, "aspect_ratio": height / width, "fps": info["fps"],
                     "resolution": height * width, **{name: info.get(name) for name in AUDIO_COLUMNS}})

    write_csv(report, REPORT_COLUMNS, errors)
    write_csv(out_csv, SCAN_COLUMNS, rows)
    return {
        "found": len(files),
        "ok": len(rows),
        "failed": len(errors),
        "skipped": skipped,
        "captioned": captioned,
        "captions_unmatched": captions_unmatched,
        "corrected": corrected,
        "seconds": time.perf_counter() - start,
        "csv": str(out_csv),
        "report": str(report),
        "workers": min(workers, max(1, len(files))),
    }


def _is_media(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in MEDIA_SUFFIXES


def _collect_files(paths: list) -> tuple[list[str], int, list[dict]]:
    """Absolute media paths (sorted, unique), explicit non-media files skipped, folder errors."""
    found: dict[str, None] = {}
    skipped = 0
    walk_errors: list[dict] = []
    missing = [str(p) for p in paths if not os.path.exists(p)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"{missing[0]!r} does not exist{more}; pass existing video/image files or folders")

    def on_error(exc: OSError) -> None:
        walk_errors.append({"path": os.path.abspath(exc.filename or "?"),
                            "error": f"cannot list folder: {exc.strerror or exc}"})

    for given in paths:
        given = os.path.abspath(given)
        if not os.path.isdir(given):
            if _is_media(given):
                found[os.path.normpath(given)] = None
            else:
                skipped += 1
            continue
        for folder, dirnames, filenames in os.walk(given, onerror=on_error):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in filenames:
                if not name.startswith(".") and _is_media(name):
                    found[os.path.normpath(os.path.join(folder, name))] = None
    return sorted(found), skipped, walk_errors


def _csv_path(path: str, out_dir: str) -> str:
    """``path`` relative to ``out_dir`` when it lies under it, else absolute."""
    try:
        under = os.path.commonpath([path, out_dir]) == out_dir
    except ValueError:   # different drives on Windows
        under = False
    return os.path.relpath(path, out_dir) if under else path


# --------------------------------------------------------------------------- captions


def _read_captions(captions: str | os.PathLike) -> dict[str, str]:
    """``{key: caption}`` from a ``path,text`` CSV or ``path<TAB>caption`` lines."""
    source = Path(captions)
    if not source.exists():
        raise UserError(f"captions file {str(source)!r} does not exist; pass a .csv with path,text "
                        "columns or a text file of path<TAB>caption lines")
    try:
        content = read_user_text(source, encoding="utf-8-sig")   # a FIFO is refused, never waited on
    except NotRegularFile as exc:
        raise UserError(f"captions file {str(source)!r} is {exc.strerror}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read captions file {str(source)!r} ({exc}); save it as UTF-8 text") from None
    result: dict[str, str] = {}
    if source.suffix.lower() == ".csv":
        reader = csv.DictReader(io.StringIO(content, newline=""))
        missing = [c for c in ("path", "text") if c not in (reader.fieldnames or [])]
        if missing:
            raise UserError(f"captions CSV {str(source)!r} is missing column(s) {', '.join(missing)}; "
                            "it needs a header with path and text")
        for row in reader:
            key = (row.get("path") or "").strip()
            if key:
                result[key] = (row.get("text") or "").strip()
        return result
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        if "\t" not in line:
            raise UserError(f"{source}:{number} has no tab; write one 'path<TAB>caption' per line "
                            "(or use a .csv with path,text columns)")
        key, text = line.split("\t", 1)
        if key.strip():
            result[key.strip()] = text.strip()
    return result


def _match_captions(caption_of: dict[str, str], caption_dir: str,
                    files: list[str]) -> tuple[dict[str, str], int]:
    """``({absolute file: caption}, number of caption keys that matched no scanned file)``.

    A relative key is tried against ``caption_dir`` first, then the current directory.
    """
    scanned = set(files)
    by_file: dict[str, str] = {}
    unmatched = 0
    for key, text in caption_of.items():
        if os.path.isabs(key):
            candidates = [os.path.normpath(key)]
        else:
            candidates = [os.path.normpath(os.path.join(caption_dir, key)),
                          os.path.normpath(os.path.abspath(key))]
        hit = next((c for c in candidates if c in scanned), None)
        if hit is None:
            unmatched += 1
        else:
            by_file[hit] = text
    return by_file, unmatched


# --------------------------------------------------------------------------- probing


def _probe_one(path: str, verify: bool) -> tuple[dict | None, str | None]:
    """``(info, None)`` or ``(None, one-line reason)``; never raises."""
    try:
        info = probe_video(path)
        if verify and not is_image_path(path):
            decoded = _decoded_frame_count(path)
            if decoded != info["num_frames"]:
                info["container_frames"] = info["num_frames"]
                info["num_frames"] = decoded
        for key in ("num_frames", "height", "width"):
            if not info[key] > 0:
                return None, f"{key}={info[key]}: the video stream has no decodable frames"
        if not (math.isfinite(info["fps"]) and info["fps"] > 0):
            return None, "the container records no frame rate"
        try:   # the header only: a second open of a file just opened, no decoding
            info.update(probe_audio(path))
        except AudioReadError:
            pass   # unknown: empty cells
        return info, None
    except VideoReadError as exc:
        return None, " ".join(exc.reason.split())
    except Exception as exc:   # noqa: BLE001 - one odd file must never stop a scan
        return None, " ".join(f"{type(exc).__name__}: {exc}".split())


def _decoded_frame_count(path: str) -> int:
    """Frames that actually decode (what ``read_video`` returns), without colour conversion.

    A frame size that changes mid-stream is an error: training would rescale those frames
    to the first size (distorting them), so the file is reported for re-encoding.
    """
    try:
        check_regular_file(path)   # checked by probe_video too; a FIFO swapped in since would block av.open
    except OSError as exc:
        raise VideoReadError(path, exc.strerror or str(exc)) from None
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            count, first = 0, None
            for frame in container.decode(stream):
                first = first or (frame.width, frame.height)
                if (frame.width, frame.height) != first:
                    raise VideoReadError(path, _size_change(first, (frame.width, frame.height), count))
                count += 1
            return count
    except (av.FFmpegError, IndexError) as exc:
        raise VideoReadError(path, f"decoding failed: {exc}") from exc


def _size_change(first: tuple[int, int], now: tuple[int, int], frame: int) -> str:
    return (f"the frame size changes mid-stream from {first[0]}x{first[1]} to {now[0]}x{now[1]} "
            f"(width x height) at frame {frame}; re-encode it at one size, e.g. "
            f"ffmpeg -i IN -vf scale={first[0]}:{first[1]} OUT")


def _probe_chunk(paths: list[str], verify: bool, probe: Callable) -> list:
    return [probe(path, verify) for path in paths]


def _pool(workers: int) -> ProcessPoolExecutor:
    # fork starts workers in milliseconds and shares the imported modules; elsewhere
    # (macOS, Windows) use the platform default.
    context = multiprocessing.get_context("fork") if sys.platform.startswith("linux") else None
    return ProcessPoolExecutor(max_workers=workers, mp_context=context)


def _probe_files(files: list[str], workers: int, verify: bool, bar: tqdm,
                 probe: Callable = _probe_one) -> list[tuple[dict | None, str | None]]:
    """Probe ``files`` with ``workers`` processes, in chunks; results in input order.

    A worker that dies (a decoder segfault, the OOM killer) breaks the whole pool, and
    the chunk responsible is one of those in flight. Those files are then probed one per
    task in a single-worker pool, so a crash names exactly one file (recorded as an error)
    and a fresh pool carries on; the files not yet started go back to the parallel pool.
    """
    results: list = [None] * len(files)
    if workers <= 1 or len(files) <= 1:
        for i, path in enumerate(files):
            results[i] = probe(path, verify)
            bar.update(1)
        return results
    chunk = max(1, min(_MAX_CHUNK, math.ceil(len(files) / (workers * _CHUNKS_PER_WORKER))))
    todo = list(range(len(files)))
    while todo:
        chunks = [todo[i : i + chunk] for i in range(0, len(todo), chunk)]
        unfinished = _run_chunks(files, chunks, min(workers, len(chunks)), verify, probe, results, bar)
        # In-flight chunks were dispatched in order: the crash is among the first
        # workers + 1 (one extra is queued per pool) unfinished ones.
        suspects = [i for c in unfinished[: workers + 1] for i in c]
        _probe_isolated(files, suspects, verify, probe, results, bar)
        todo = [i for c in unfinished[workers + 1 :] for i in c]
    return results


def _run_chunks(files, chunks, workers, verify, probe, results, bar) -> list[list[int]]:
    """Run chunks in a pool; return the chunks left unfinished by a crash (in order)."""
    pool = _pool(workers)
    try:
        futures = {pool.submit(_probe_chunk, [files[i] for i in c], verify, probe): n
                   for n, c in enumerate(chunks)}
        done_chunks: set[int] = set()
        for future in as_completed(futures):
            try:
                chunk_results = future.result()
            except BrokenProcessPool:
                continue
            n = futures[future]
            for i, result in zip(chunks[n], chunk_results):
                results[i] = result
            done_chunks.add(n)
            bar.update(len(chunks[n]))
        return [c for n, c in enumerate(chunks) if n not in done_chunks]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _probe_isolated(files, indices, verify, probe, results, bar) -> None:
    remaining = list(indices)
    while remaining:
        pool = _pool(1)
        try:
            futures = [pool.submit(_probe_chunk, [files[i]], verify, probe) for i in remaining]
            for k, future in enumerate(futures):
                try:
                    results[remaining[k]] = future.result()[0]
                except BrokenProcessPool:
                    results[remaining[k]] = (None, "probing crashed the worker process (decoder "
                                                   "crash or out of memory)")
                    bar.update(1)
                    remaining = remaining[k + 1 :]
                    break
                bar.update(1)
            else:
                remaining = []
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------- filter

# Reasons a row is dropped, in the order they are checked (a row counts once, first hit).
FILTER_REASONS = ("invalid", "images", "videos", "min_frames", "max_frames", "min_height",
                  "max_height", "min_width", "max_width", "min_resolution", "max_resolution",
                  "min_fps", "max_fps", "min_aspect_ratio", "max_aspect_ratio")


def filter_metadata(in_csv: str, out_csv: str, min_frames: int | None = None,
                    max_frames: int | None = None, min_height: int | None = None,
                    max_height: int | None = None, min_width: int | None = None,
                    max_width: int | None = None, min_resolution: int | None = None,
                    max_resolution: int | None = None, min_fps: float | None = None,
                    max_fps: float | None = None, min_aspect_ratio: float | None = None,
                    max_aspect_ratio: float | None = None, images: bool = True,
                    videos: bool = True, progress: bool = False) -> dict:
    """Write the rows of ``in_csv`` that pass every bound to ``out_csv`` (atomically).

    Bounds are inclusive; ``None`` means unbounded. ``resolution`` is ``height * width``
    in pixels and ``aspect_ratio`` is ``height / width``, both computed from the
    ``height``/``width`` columns (as bucketing does), not read from their columns.
    Images are rows with ``num_frames == 1`` (what training treats as images);
    ``images=False`` / ``videos=False`` drop them / the rest. Rows failing
    ``read_metadata`` validation are dropped as ``invalid``. Every column is kept, in
    order, with its original text. ``in_csv`` may be Parquet; ``out_csv`` is written as
    Parquet when it ends in ``.parquet``, else as CSV. ``progress`` shows a bar on long reads.

    Returns ``{"rows", "kept", "dropped", "dropped_by": {reason: count}, "invalid_rows":
    [(CSV line, reason), ...], "csv"}``; ``dropped_by`` holds every reason in
    ``FILTER_REASONS`` and each dropped row is counted under the first one it fails.
    ``out_csv`` must not be ``in_csv``: the filtered rows would replace the user's data.
    """
    if Path(out_csv).resolve() == Path(in_csv).resolve():
        raise UserError(f"-o {out_csv} is the input CSV; write the filtered rows to another file (the input "
                        "stays as it is)")
    bounds = {
        "frames": (min_frames, max_frames), "height": (min_height, max_height),
        "width": (min_width, max_width), "resolution": (min_resolution, max_resolution),
        "fps": (min_fps, max_fps), "aspect_ratio": (min_aspect_ratio, max_aspect_ratio),
    }
    for name, (low, high) in bounds.items():
        for prefix, value in (("min", low), ("max", high)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or math.isnan(value)):
                raise UserError(f"{prefix}_{name}={value!r} is not a number; give a number or leave it unset")
        if low is not None and high is not None and low > high:
            raise UserError(f"min_{name}={low} is greater than max_{name}={high}; swap or widen them")
    if not images and not videos:
        raise UserError("images=False and videos=False would drop every row; keep at least one of them")
    out_csv = Path(out_csv)
    if out_csv.is_dir():
        raise UserError(f"output {str(out_csv)!r} is a folder; give a CSV file name")

    source = Source(Path(in_csv))
    dropped_by = dict.fromkeys(FILTER_REASONS, 0)
    invalid, rows, kept = [], 0, 0
    with table_writer(out_csv, source.schema) as writer:
        for chunk in source.chunks(progress):   # block by block: memory stays flat on any file size
            invalid += chunk.bad
            rows += chunk.rows.num_rows + len(chunk.bad)
            frames, height, width = (chunk.numbers[k] for k in ("num_frames", "height", "width"))
            values = {"frames": frames, "height": height, "width": width, "resolution": height * width,
                      "fps": chunk.numbers["fps"], "aspect_ratio": height / width}
            reason = np.full(len(frames), -1, np.int16)   # the first reason a row fails, -1: kept

            def drop(mask, name):
                reason[mask & (reason < 0)] = FILTER_REASONS.index(name)

            drop((frames == 1) & (not images), "images")
            drop((frames > 1) & (not videos), "videos")
            for name, (low, high) in bounds.items():
                if low is not None:
                    drop(values[name] < low, f"min_{name}")
                if high is not None:
                    drop(values[name] > high, f"max_{name}")
            for name, count in zip(FILTER_REASONS, np.bincount(reason[reason >= 0], minlength=len(FILTER_REASONS))):
                dropped_by[name] += int(count)
            writer.write(chunk.rows.filter(pa.array(reason < 0)))
            kept += int((reason < 0).sum())
        if rows == len(invalid):
            raise UserError(f"{source.path} has no usable rows")
    dropped_by["invalid"] = len(invalid)
    return {"rows": rows, "kept": kept, "dropped": rows - kept, "dropped_by": dropped_by,
            "invalid_rows": invalid, "csv": str(out_csv)}


# --------------------------------------------------------------------------- output


