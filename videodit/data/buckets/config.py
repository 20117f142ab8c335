"""Open-Sora 1.2 ``bucket_config``: reading it and validating it.

A bucket config maps a resolution name to frame counts, each with a keep probability and a
per-GPU batch size::

    {"240p": {1: (0.3, 297), 51: (0.4, 20), 102: ((0.4, 0.33), 10), 408: (0.0, None)}}

``parse_bucket_config`` turns that into a :class:`BucketConfig` or raises a one-line
:class:`UserError` naming the bad entry. ``data.bucket_config`` is checked here, where the
data is built (``BucketPlan``), not by ``load_config``: the config package does not import
``data/``.
"""

from __future__ import annotations

import ast
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping


from videodit.config.load import parse_yaml
from videodit.config import DataConfig
from videodit.config.schema import MAX_BATCH_SIZE
from videodit.data.buckets.tables import RESOLUTION_NAMES, RESOLUTION_PIXELS
from videodit.errors import UserError, os_error_message
from videodit.user_files import FileTooLarge, NotRegularFile, read_user_text

# A bucket config file is a few KB (Open-Sora's stage configs: ~3 KB, a few dozen entries). The
# work is bounded, not only the bytes: YAML is parsed at about 100 KB/s in pure Python and every
# (resolution, num_frames) entry becomes one bucket per aspect ratio (up to ~60), so a file may hold
# at most MAX_CONFIG_BYTES (read in well under a second) and a config MAX_ENTRIES entries (at most
# ~100,000 buckets), each refused in one line before the work starts.
MAX_CONFIG_BYTES = 256 << 10
MAX_ENTRIES = 2048

_ENTRY_HINT = "write (keep_prob, batch_size), ((p_keep, p_frames), batch_size) or (0.0, None)"


@dataclass(frozen=True)
class BucketEntry:
    """One (resolution, num_frames) line of a bucket config."""

    resolution: str
    num_frames: int
    keep_prob: float
    frame_prob: float = 1.0  # p_frames of a (p_keep, p_frames) pair; 1.0 = never skipped
    batch_size: int | None = None  # None only where keep_prob is 0


@dataclass(frozen=True)
class BucketConfig:
    """A validated bucket config, entries in Open-Sora's visiting order.

    Resolutions by pixel count, largest first (equal counts keep the config's order, as
    Open-Sora's stable sort does); within a resolution, num_frames largest first.
    """

    entries: tuple[BucketEntry, ...]

    def resolutions(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e.resolution for e in self.entries))

    def entries_for(self, resolution: str) -> tuple[BucketEntry, ...]:
        return tuple(e for e in self.entries if e.resolution == resolution)

    def to_dict(self) -> dict[str, dict[int, tuple]]:
        """The config in Open-Sora's written form."""
        out: dict[str, dict[int, tuple]] = {}
        for e in self.entries:
            keep = e.keep_prob if e.frame_prob == 1.0 else (e.keep_prob, e.frame_prob)
            out.setdefault(e.resolution, {})[e.num_frames] = (keep, e.batch_size)
        return out


def short_repr(value: Any, limit: int = 60) -> str:
    """repr for error messages, cut so a large config cannot flood the one-line error."""
    if is_int(value) and abs(value).bit_length() > 200:   # repr of a huge int is slow, or refused (4300 digits)
        return f"<an integer of about {int(abs(value).bit_length() * 0.30103) + 1} digits>"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _parse_resolution(key: Any) -> str:
    # YAML reads `256:` as an int, so numeric names arrive as ints.
    name = str(key) if is_int(key) else key
    if name not in RESOLUTION_PIXELS:
        raise UserError(f"unknown resolution {short_repr(key)} in bucket_config; use one of: "
                        f"{', '.join(RESOLUTION_NAMES)}")
    return name


def _parse_num_frames(resolution: str, key: Any) -> int:
    if isinstance(key, str) and key.strip().isdigit():
        key = int(key)
    if not is_int(key) or key < 1:
        raise UserError(f"bucket_config[{resolution!r}] key {short_repr(key)} is not a frame count; "
                        "use a positive integer such as 1 (images), 51 or 102")
    return int(key)


def _parse_prob(where: str, value: Any) -> float:
    if not is_real(value) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise UserError(f"{where} has probability {short_repr(value)}, which is not a number in [0, 1]; "
                        "use a value between 0 and 1")
    return float(value)


def _parse_keep(where: str, value: Any) -> tuple[float, float]:
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise UserError(f"{where} keep probability {short_repr(value)} is not (p_keep, p_frames); "
                            f"{_ENTRY_HINT}")
        return _parse_prob(where, value[0]), _parse_prob(where, value[1])
    return _parse_prob(where, value), 1.0


def _parse_batch_size(where: str, value: Any, keep: float, raw_keep: Any) -> int | None:
    if is_int(value) and value > MAX_BATCH_SIZE:
        raise UserError(f"{where} batch size {short_repr(value)} is more than the {MAX_BATCH_SIZE:,} samples a bucket "
                        f"batch may hold (per GPU); give at most {MAX_BATCH_SIZE:,} (videodit plan shows the largest "
                        "batch that fits a GPU)")
    if keep == 0.0 and (value is None or (is_int(value) and value >= 0)):
        return None if not value else int(value)
    if is_int(value) and value >= 1:
        return int(value)
    hint = ""
    if is_real(value) and 0 < value < 1 and not isinstance(raw_keep, (list, tuple)):
        hint = f"; for (p_keep, p_frames) write (({raw_keep!r}, {value!r}), batch_size)"
    raise UserError(f"{where} batch size {short_repr(value)} is not a positive integer; "
                    f"{_ENTRY_HINT}{hint}")


def _parse_entry(resolution: str, num_frames: int, value: Any) -> BucketEntry:
    where = f"bucket_config[{resolution!r}][{num_frames}]"
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise UserError(f"{where} = {short_repr(value)} is not (keep_prob, batch_size); {_ENTRY_HINT}")
    raw_keep, raw_bs = value
    keep, frame = _parse_keep(where, raw_keep)
    if num_frames == 1 and isinstance(raw_keep, (list, tuple)):
        # Open-Sora compares a float with this tuple and crashes on the first image.
        raise UserError(f"{where} gives (p_keep, p_frames) for images; "
                        "num_frames=1 takes one keep probability, e.g. (0.5, 64)")
    batch_size = _parse_batch_size(where, raw_bs, keep, raw_keep)
    return BucketEntry(resolution, num_frames, keep, frame, batch_size)


def _parse_frames(resolution: str, frames: Any) -> list[BucketEntry]:
    if not isinstance(frames, Mapping) or not frames:
        raise UserError(f"bucket_config[{resolution!r}] must be a non-empty dict "
                        f"{{num_frames: (keep_prob, batch_size)}}, got {short_repr(frames)}")
    seen: dict[int, Any] = {}
    entries = []
    for key, value in frames.items():
        num_frames = _parse_num_frames(resolution, key)
        if num_frames in seen:
            raise UserError(f"bucket_config[{resolution!r}] lists num_frames {num_frames} twice "
                            f"(as {seen[num_frames]!r} and {key!r}); keep one")
        seen[num_frames] = key
        entries.append(_parse_entry(resolution, num_frames, value))
    return sorted(entries, key=lambda e: -e.num_frames)


def parse_bucket_config(obj: Any) -> BucketConfig:
    """Validate an Open-Sora ``bucket_config`` (Python dict, or YAML's lists/str keys)."""
    if isinstance(obj, BucketConfig):
        return obj
    if not isinstance(obj, Mapping) or not obj:
        raise UserError("bucket_config must be a non-empty dict {resolution: {num_frames: "
                        f"(keep_prob, batch_size)}}}}, got {short_repr(obj)}; "
                        "e.g. {'144p': {1: (1.0, 64)}}")
    entries_given = sum(len(f) for f in obj.values() if isinstance(f, Mapping))
    if entries_given > MAX_ENTRIES:
        raise UserError(f"bucket_config has {entries_given:,} entries, more than the {MAX_ENTRIES:,} (resolution, "
                        "num_frames) pairs a bucket config may have (Open-Sora's: a few dozen); give fewer frame "
                        "counts per resolution")
    by_name: dict[str, list[BucketEntry]] = {}
    for key, frames in obj.items():
        name = _parse_resolution(key)
        if name in by_name:
            raise UserError(f"bucket_config lists resolution {name!r} twice; keep one")
        by_name[name] = _parse_frames(name, frames)
    # Stable sort: equal pixel counts ("2880", "4k") keep the config's order.
    order = sorted(by_name, key=lambda n: -RESOLUTION_PIXELS[n])
    entries = tuple(e for name in order for e in by_name[name])
    if all(e.keep_prob == 0.0 for e in entries):
        raise UserError("every bucket_config entry has keep probability 0, so every sample "
                        "would be dropped; give at least one entry a probability above 0")
    return BucketConfig(entries)


def _last_bucket_config_node(tree: ast.Module) -> ast.expr | None:
    node = None
    for stmt in tree.body:  # top level only; the last assignment wins, as when executed
        if isinstance(stmt, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "bucket_config" for t in stmt.targets):
            node = stmt.value
        elif (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
              and stmt.target.id == "bucket_config" and stmt.value is not None):
            node = stmt.value
    return node


def load_opensora_bucket_config(path: str | Path) -> dict:
    """Read ``bucket_config = {...}`` from an Open-Sora Python config without running it."""
    path = Path(path)
    try:
        source = read_user_text(path, max_bytes=MAX_CONFIG_BYTES)
    except (NotRegularFile, FileTooLarge) as exc:
        raise UserError(f"Open-Sora config {os_error_message(exc)}") from None
    except OSError as exc:
        raise UserError(f"cannot read Open-Sora config {path}: {exc.strerror or exc}; "
                        "check the path") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"Open-Sora config {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        raise UserError(f"{path} is not valid Python (line {exc.lineno}: {exc.msg}); "
                        "fix the file or pass the bucket_config as YAML") from None
    node = _last_bucket_config_node(tree)
    if node is None:
        raise UserError(f"{path} has no top-level `bucket_config = {{...}}` assignment; "
                        "add one or pass the bucket_config as YAML")
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise UserError(f"bucket_config in {path} (line {node.lineno}) is not a plain literal; "
                        "write it with numbers, strings, tuples and dicts only") from None
    if not isinstance(value, dict):
        raise UserError(f"bucket_config in {path} (line {node.lineno}) is a "
                        f"{type(value).__name__}, not a dict; write {{resolution: {{...}}}}")
    return value



def resolve_bucket_config(data: DataConfig) -> dict | None:
    """The bucket_config dict from ``data.bucket_config`` or ``data.bucket_config_file``."""
    if data.bucket_config is not None:
        return data.bucket_config
    if data.bucket_config_file is None:
        return None
    path = Path(data.bucket_config_file)
    if not path.exists():
        raise UserError(f"data.bucket_config_file {str(path)!r} does not exist")
    if path.suffix == ".py":
        return load_opensora_bucket_config(path)
    try:
        text = read_user_text(path, max_bytes=MAX_CONFIG_BYTES)
    except OSError as exc:
        raise UserError(f"data.bucket_config_file: {os_error_message(exc)}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"data.bucket_config_file {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    loaded = parse_yaml(text, str(path))   # aliases bounded: a shared file may be crafted
    if isinstance(loaded, dict) and "bucket_config" in loaded:
        loaded = loaded["bucket_config"]
    if not isinstance(loaded, dict):
        raise UserError(f"{path} holds no bucket_config mapping")
    return loaded
