"""Open-Sora 1.2 ``bucket_config``: resolution tables, parsing, and bucket assignment.

A bucket config maps a resolution name to frame counts, each with a keep probability and a
per-GPU batch size::

    {"240p": {1: (0.3, 297), 51: (0.4, 20), 102: ((0.4, 0.33), 10), 408: (0.0, None)}}

``assign_buckets`` puts every clip (num_frames, height, width) into one bucket, or drops it,
following Open-Sora 1.2's ``Bucket.get_bucket_id`` rule for rule; it is vectorized over
numpy arrays. ``assign_buckets_reference`` is the same rules written row by row, kept for
tests and the benchmark. The rules, worked examples and every deliberate difference from
Open-Sora are in ``docs/buckets.md``.

Random draws come from a counter-based hash of (seed, epoch, sample id, resolution,
num_frames, draw slot), so every rank computes the same assignment without communicating.
"""

from __future__ import annotations

import ast
import enum
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import numpy as np

from videodit.errors import UserError

# --------------------------------------------------------------------------------------
# Resolution tables
# --------------------------------------------------------------------------------------

# Open-Sora's own tables: ratio key (H/W, 2 decimals) -> the exact ratio they were built
# from. "0.54" is 1/1.85 (cinema 1.85:1), not 27/50, and "2.08" is 25/12: only these
# reproduce the shipped sizes.
_OPENSORA_RATIOS: dict[str, float] = {
    "0.38": 3 / 8, "0.43": 9 / 21, "0.48": 12 / 25, "0.50": 1 / 2, "0.53": 9 / 17,
    "0.54": 20 / 37, "0.56": 9 / 16, "0.62": 5 / 8, "0.67": 2 / 3, "0.75": 3 / 4,
    "1.00": 1.0, "1.33": 4 / 3, "1.50": 3 / 2, "1.78": 16 / 9, "1.89": 17 / 9,
    "2.00": 2.0, "2.08": 25 / 12,
}

# name -> pixel count, for the tables Open-Sora generated from a formula.
_OPENSORA_PIXELS: dict[str, int] = {
    "144p": 144 * 256, "240p": 102240, "360p": 360 * 640, "480p": 409920,
    "720p": 720 * 1280, "1080p": 1080 * 1920, "2k": 1440 * 2560, "4k": 2160 * 3840,
}

# Entries Open-Sora ships that differ from its own formula (hand edits); kept as shipped
# so assignments and target sizes match theirs.
_OPENSORA_OVERRIDES: dict[tuple[str, str], tuple[int, int]] = {
    ("240p", "0.67"): (262, 393),
    ("480p", "0.48"): (444, 925),
    ("480p", "1.33"): (740, 555),
}

# PixArt's 1024-pixel table (H, W), which Open-Sora reuses as "1024" and scales by 1/4,
# 1/2 and 2 for "256", "512" and "2048". Keys are f"{H/W:.2f}".
_PIXART_1024: tuple[tuple[int, int], ...] = (
    (512, 2048), (512, 1984), (512, 1920), (512, 1856), (576, 1792), (576, 1728),
    (576, 1664), (640, 1600), (640, 1536), (704, 1472), (704, 1408), (704, 1344),
    (768, 1344), (768, 1280), (832, 1216), (832, 1152), (896, 1152), (896, 1088),
    (960, 1088), (960, 1024), (1024, 1024), (1024, 960), (1088, 960), (1088, 896),
    (1152, 896), (1152, 832), (1216, 832), (1280, 768), (1344, 768), (1408, 704),
    (1472, 704), (1536, 640), (1600, 640), (1664, 576), (1728, 576), (1792, 576),
    (1856, 512), (1920, 512), (1984, 512), (2048, 512),
)
_PIXART_SCALES: dict[str, float] = {"256": 0.25, "512": 0.5, "1024": 1.0, "2048": 2.0}

# PixArt's 2880 table: its keys are not H/W rounded (e.g. "0.25" is 1408x5760 = 0.244),
# so it is data, not a formula.
_PIXART_2880: tuple[tuple[str, int, int], ...] = (
    ("0.25", 1408, 5760), ("0.26", 1408, 5568), ("0.27", 1408, 5376), ("0.28", 1408, 5184),
    ("0.32", 1600, 4992), ("0.33", 1600, 4800), ("0.34", 1600, 4672), ("0.40", 1792, 4480),
    ("0.42", 1792, 4288), ("0.47", 1920, 4096), ("0.49", 1920, 3904), ("0.51", 1920, 3776),
    ("0.55", 2112, 3840), ("0.59", 2112, 3584), ("0.68", 2304, 3392), ("0.72", 2304, 3200),
    ("0.78", 2496, 3200), ("0.83", 2496, 3008), ("0.89", 2688, 3008), ("0.93", 2688, 2880),
    ("1.00", 2880, 2880), ("1.07", 2880, 2688), ("1.12", 3008, 2688), ("1.21", 3008, 2496),
    ("1.28", 3200, 2496), ("1.39", 3200, 2304), ("1.47", 3392, 2304), ("1.70", 3584, 2112),
    ("1.82", 3840, 2112), ("2.03", 3904, 1920), ("2.13", 4096, 1920), ("2.39", 4288, 1792),
    ("2.50", 4480, 1792), ("2.92", 4672, 1600), ("3.00", 4800, 1600), ("3.12", 4992, 1600),
    ("3.68", 5184, 1408), ("3.82", 5376, 1408), ("3.95", 5568, 1408), ("4.00", 5760, 1408),
)

# Open-Sora 1.2's ASPECT_RATIOS order. The position of a name is also its code in the
# random stream, so new names must be appended, never inserted.
RESOLUTION_NAMES: tuple[str, ...] = (
    "144p", "256", "240p", "360p", "512", "480p", "720p", "1024", "1080p", "2k", "2048",
    "2880", "4k",
    # videodit's own small resolutions for CPU and toy runs (not in Open-Sora): "Npx" has
    # N*N pixels and sides that are multiples of 4.
    "16px", "24px", "32px", "48px", "64px", "96px", "128px",
)

# Aspect ratios of the small "Npx" tables: the common video and photo shapes.
_SMALL_RATIOS: tuple[str, ...] = ("0.56", "0.75", "1.00", "1.33", "1.78")


def _even_side(x: float) -> int:
    """Round to the nearer even neighbour of x (Open-Sora's rule: ceil if even, else floor)."""
    x += 1e-4
    up = math.ceil(x)
    return up if up % 2 == 0 else math.floor(x)


def _even_size(pixels: int, ratio: float) -> tuple[int, int]:
    h = _even_side(math.sqrt(pixels * ratio))
    return h, _even_side(h / ratio)


def _floor_size(pixels: int, ratio: float) -> tuple[int, int]:
    # 144p alone was built by truncation (odd sides such as 117x312 appear).
    h = int(math.sqrt(pixels * ratio))
    return h, int(h / ratio)


def _opensora_table(name: str) -> dict[str, tuple[int, int]]:
    size = _floor_size if name == "144p" else _even_size
    table = {key: size(_OPENSORA_PIXELS[name], ratio) for key, ratio in _OPENSORA_RATIOS.items()}
    for (table_name, key), hw in _OPENSORA_OVERRIDES.items():
        if table_name == name:
            table[key] = hw
    return table


def _pixart_table(name: str) -> dict[str, tuple[int, int]]:
    if name == "2880":
        return {key: (h, w) for key, h, w in _PIXART_2880}
    scale = _PIXART_SCALES[name]
    return {f"{h / w:.2f}": (int(h * scale), int(w * scale)) for h, w in _PIXART_1024}


def _small_table(side: int) -> dict[str, tuple[int, int]]:
    """An "Npx" table: sides rounded to multiples of 4 (patchable in pixel space)."""
    def round4(x: float) -> int:
        return max(4, int(round(x / 4)) * 4)
    table = {}
    for key in _SMALL_RATIOS:
        ratio = _OPENSORA_RATIOS[key]
        h = round4(math.sqrt(side * side * ratio))
        table[key] = (h, round4(h / ratio))
    return table


def _build_tables() -> tuple[dict[str, int], dict[str, dict[str, tuple[int, int]]]]:
    pixels: dict[str, int] = {}
    tables: dict[str, dict[str, tuple[int, int]]] = {}
    for name in RESOLUTION_NAMES:
        if name.endswith("px"):
            side = int(name[:-2])
            pixels[name], tables[name] = side * side, _small_table(side)
        elif name in _OPENSORA_PIXELS:
            pixels[name], tables[name] = _OPENSORA_PIXELS[name], _opensora_table(name)
        else:
            side = int(name)
            pixels[name], tables[name] = side * side, _pixart_table(name)
    return pixels, tables


#: name -> pixel count the 0.8 criterion compares against (e.g. "240p" -> 102240).
#: name -> {ratio key "H/W" with 2 decimals: (height, width)}, keys ascending.
RESOLUTION_PIXELS, ASPECT_RATIOS = _build_tables()

# Open-Sora 1.2's stage-1 bucket_config (configs/opensora-v1-2/train/stage1.py), as written
# there: the reference workload for benchmarks and the memory planner.
OPENSORA_V12_STAGE1: dict = {
    "144p": {1: (1.0, 475), 51: (1.0, 51), 102: ((1.0, 0.33), 27), 204: ((1.0, 0.1), 13), 408: ((1.0, 0.1), 6)},
    "256": {1: (0.4, 297), 51: (0.5, 20), 102: ((0.5, 0.33), 10), 204: ((0.5, 0.1), 5), 408: ((0.5, 0.1), 2)},
    "240p": {1: (0.3, 297), 51: (0.4, 20), 102: ((0.4, 0.33), 10), 204: ((0.4, 0.1), 5), 408: ((0.4, 0.1), 2)},
    "360p": {1: (0.2, 141), 51: (0.15, 8), 102: ((0.15, 0.33), 4), 204: ((0.15, 0.1), 2), 408: ((0.15, 0.1), 1)},
    "512": {1: (0.1, 141)},
    "480p": {1: (0.1, 89)},
    "720p": {1: (0.05, 36)},
    "1024": {1: (0.05, 36)},
    "1080p": {1: (0.1, 5)},
    "2048": {1: (0.1, 5)},
}

# --------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------

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


def _short(value: Any, limit: int = 60) -> str:
    """repr for error messages, cut so a large config cannot flood the one-line error."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _parse_resolution(key: Any) -> str:
    # YAML reads `256:` as an int, so numeric names arrive as ints.
    name = str(key) if _is_int(key) else key
    if name not in RESOLUTION_PIXELS:
        raise UserError(f"unknown resolution {_short(key)} in bucket_config; use one of: "
                        f"{', '.join(RESOLUTION_NAMES)}")
    return name


def _parse_num_frames(resolution: str, key: Any) -> int:
    if isinstance(key, str) and key.strip().isdigit():
        key = int(key)
    if not _is_int(key) or key < 1:
        raise UserError(f"bucket_config[{resolution!r}] key {_short(key)} is not a frame count; "
                        "use a positive integer such as 1 (images), 51 or 102")
    return int(key)


def _parse_prob(where: str, value: Any) -> float:
    if not _is_real(value) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise UserError(f"{where} has probability {_short(value)}, which is not a number in [0, 1]; "
                        "use a value between 0 and 1")
    return float(value)


def _parse_keep(where: str, value: Any) -> tuple[float, float]:
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise UserError(f"{where} keep probability {_short(value)} is not (p_keep, p_frames); "
                            f"{_ENTRY_HINT}")
        return _parse_prob(where, value[0]), _parse_prob(where, value[1])
    return _parse_prob(where, value), 1.0


def _parse_batch_size(where: str, value: Any, keep: float, raw_keep: Any) -> int | None:
    if keep == 0.0 and (value is None or (_is_int(value) and value >= 0)):
        return None if not value else int(value)
    if _is_int(value) and value >= 1:
        return int(value)
    hint = ""
    if _is_real(value) and 0 < value < 1 and not isinstance(raw_keep, (list, tuple)):
        hint = f"; for (p_keep, p_frames) write (({raw_keep!r}, {value!r}), batch_size)"
    raise UserError(f"{where} batch size {_short(value)} is not a positive integer; "
                    f"{_ENTRY_HINT}{hint}")


def _parse_entry(resolution: str, num_frames: int, value: Any) -> BucketEntry:
    where = f"bucket_config[{resolution!r}][{num_frames}]"
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise UserError(f"{where} = {_short(value)} is not (keep_prob, batch_size); {_ENTRY_HINT}")
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
                        f"{{num_frames: (keep_prob, batch_size)}}, got {_short(frames)}")
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
                        f"(keep_prob, batch_size)}}}}, got {_short(obj)}; "
                        "e.g. {'144p': {1: (1.0, 64)}}")
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
        source = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read Open-Sora config {path}: {exc.strerror or exc}; "
                        "check the path") from None
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


# --------------------------------------------------------------------------------------
# Random stream: counter-based, identical on every rank
# --------------------------------------------------------------------------------------

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_ROW_TAG, _DRAW_TAG = 0x6275636B65747321, 0x64726177736C6F74  # arbitrary distinct starts
_GATE, _KEEP = 0, 1  # draw slots: the p_frames gate and the keep coin of one entry


def _mix64(z: int) -> int:
    """splitmix64's finalizer on a Python int (a bijection of 64-bit words)."""
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK
    return z ^ (z >> 31)


def _chain(h: int, word: int) -> int:
    return _mix64(((h ^ (word & _MASK)) + _GOLDEN) & _MASK)


def _mix64_np(z: np.ndarray) -> np.ndarray:
    z = z ^ (z >> np.uint64(30))
    z *= np.uint64(_MIX1)  # uint64 arrays wrap modulo 2**64, as the masks above do
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    return z


def _chain_np(h: np.ndarray | int, word: np.ndarray | int) -> np.ndarray:
    """_chain where either side is a uint64 array (the xor is symmetric)."""
    z = np.bitwise_xor(np.uint64(h & _MASK) if isinstance(h, int) else h,
                       np.uint64(word & _MASK) if isinstance(word, int) else word)
    z += np.uint64(_GOLDEN)
    return _mix64_np(z)


def _row_prefix(seed: int, epoch: int) -> int:
    return _chain(_chain(_ROW_TAG, seed), epoch)


def _draw_key(resolution: str, num_frames: int, slot: int) -> int:
    code = RESOLUTION_NAMES.index(resolution)
    return _chain(_chain(_chain(_DRAW_TAG, code), num_frames), slot)


def _to_unit(h: int) -> float:
    """Top 53 bits as a float in [0, 1)."""
    return (h >> 11) * (1.0 / (1 << 53))


def uniform(seed: int, epoch: int, sample_id: int, resolution: str, num_frames: int,
            slot: int) -> float:
    """One draw of the stream; slot 0 is the p_frames gate, slot 1 the keep coin."""
    row = _chain(_row_prefix(seed, epoch), sample_id)
    return _to_unit(_chain(row, _draw_key(resolution, num_frames, slot)))


def _row_hashes(seed: int, epoch: int, sample_ids: np.ndarray) -> np.ndarray:
    ids = sample_ids.astype(np.int64, copy=False).view(np.uint64)
    return _chain_np(_row_prefix(seed, epoch), ids)


def _uniform_np(row_hash: np.ndarray, resolution: str, num_frames: int, slot: int) -> np.ndarray:
    h = _chain_np(row_hash, _draw_key(resolution, num_frames, slot))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


# --------------------------------------------------------------------------------------
# Assignment
# --------------------------------------------------------------------------------------

class DropReason(enum.IntEnum):
    """Why a row has no bucket; a row keeps the furthest stage it reached anywhere."""

    KEPT = 0
    BELOW_EVERY_RESOLUTION = 1
    NO_IMAGE_BUCKET = 2
    NO_VIDEO_BUCKET = 3
    TOO_SHORT = 4
    FRAME_DRAW = 5
    ZERO_KEEP_PROB = 6
    KEEP_DRAW = 7


DROP_REASON_TEXT: dict[DropReason, str] = {
    DropReason.KEPT: "assigned to a bucket",
    DropReason.BELOW_EVERY_RESOLUTION:
        "below every resolution (height x width < 0.8 x the smallest configured resolution)",
    DropReason.NO_IMAGE_BUCKET:
        "image, but no resolution it reaches has a num_frames=1 entry",
    DropReason.NO_VIDEO_BUCKET:
        "video, but no resolution it reaches has a num_frames > 1 entry",
    DropReason.TOO_SHORT:
        "too short for every frame count (needs num_frames > bucket frames x frame_interval)",
    DropReason.FRAME_DRAW:
        "skipped by the p_frames draw of every frame count it fits",
    DropReason.ZERO_KEEP_PROB:
        "only reached entries with keep probability 0, e.g. (0.0, None)",
    DropReason.KEEP_DRAW:
        "lost the keep-probability draw at every resolution it reached",
}


class Bucket(NamedTuple):
    """One cell of the flat bucket table: clips in it are resized to (num_frames, height, width)."""

    resolution: str
    num_frames: int
    ratio: str
    height: int
    width: int
    batch_size: int


@dataclass(frozen=True)
class Assignment:
    """Per-row result of ``assign_buckets``.

    bucket: (N,) int32 index into ``buckets``, -1 where the row is dropped.
    reason: (N,) int8 ``DropReason`` code, 0 (KEPT) where the row has a bucket.
    buckets: the flat table, in Open-Sora's order (resolution, num_frames, ratio).
    """

    bucket: np.ndarray
    reason: np.ndarray
    buckets: tuple[Bucket, ...]

    @property
    def kept(self) -> np.ndarray:
        return self.bucket >= 0

    def bucket_counts(self) -> np.ndarray:
        """Rows per bucket, aligned with ``buckets``."""
        return np.bincount(self.bucket[self.kept], minlength=len(self.buckets))

    def reason_counts(self) -> dict[DropReason, int]:
        counts = np.bincount(self.reason, minlength=len(DropReason))
        return {r: int(counts[r]) for r in DropReason if counts[r]}

    def target_sizes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(num_frames, height, width) each row is resized to; -1 where dropped."""
        table = np.array([(b.num_frames, b.height, b.width) for b in self.buckets] + [(-1, -1, -1)],
                         dtype=np.int64)
        sizes = table[self.bucket]  # -1 picks the sentinel row appended last
        return sizes[:, 0], sizes[:, 1], sizes[:, 2]

    def summary(self) -> str:
        """A few lines for users: kept count and each drop reason."""
        n = len(self.bucket)
        used = int((self.bucket_counts() > 0).sum())
        lines = [f"kept {int(self.kept.sum()):,} of {n:,} rows in {used} of {len(self.buckets)} buckets"]
        for r, count in self.reason_counts().items():
            if r != DropReason.KEPT:
                lines.append(f"  dropped {count:,} ({100 * count / n:.1f}%): {DROP_REASON_TEXT[r]}")
        return "\n".join(lines)


def build_buckets(config: Any) -> tuple[Bucket, ...]:
    """The flat bucket table: every entry with keep probability > 0, times its ratios."""
    return _bucket_table(parse_bucket_config(config))[0]


def _bucket_table(cfg: BucketConfig) -> tuple[tuple[Bucket, ...], dict[tuple[str, int], int]]:
    """Buckets, and the index of each (resolution, num_frames) entry's first bucket."""
    buckets: list[Bucket] = []
    first: dict[tuple[str, int], int] = {}
    for e in cfg.entries:
        if e.keep_prob == 0.0:  # unreachable: nothing can land there
            continue
        first[(e.resolution, e.num_frames)] = len(buckets)
        for key, (h, w) in ASPECT_RATIOS[e.resolution].items():
            buckets.append(Bucket(e.resolution, e.num_frames, key, h, w, e.batch_size))
    return tuple(buckets), first


def _int_column(name: str, values: Any) -> np.ndarray:
    a = np.asarray(values)
    if a.ndim != 1:
        raise UserError(f"{name} must be a 1-D array of integers, got shape {a.shape}; "
                        "pass one value per row")
    if a.dtype.kind in "iu":
        return a.astype(np.int64, copy=False)
    if a.dtype.kind == "O":  # e.g. pandas nullable ints: missing values become NaN below
        try:
            a = np.array([np.nan if v is None or v != v else v for v in a], dtype=np.float64)
        except (TypeError, ValueError):
            raise UserError(f"{name} must be integers, got values such as {_short(a[:3].tolist())}; "
                            "convert the metadata column") from None
    if a.dtype.kind == "f":
        bad = ~np.isfinite(a) | (a != np.round(a))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise UserError(f"{name} has {int(bad.sum())} missing or non-integer values "
                            f"(first at row {i}: {a[i].item()!r}); fix or drop those metadata rows")
        return a.astype(np.int64)
    raise UserError(f"{name} must be integers, got dtype {a.dtype}; convert the metadata column")


_MAX_SIDE = 2**31 - 1


def _validated_rows(num_frames: Any, heights: Any, widths: Any,
                    sample_ids: Any) -> tuple[np.ndarray, ...]:
    cols = {"num_frames": num_frames, "heights": heights, "widths": widths}
    arrays = {name: _int_column(name, v) for name, v in cols.items()}
    n = len(arrays["num_frames"])
    ids = np.arange(n, dtype=np.int64) if sample_ids is None else _int_column("sample_ids", sample_ids)
    arrays["sample_ids"] = ids
    for name, a in arrays.items():
        if len(a) != n:
            raise UserError(f"{name} has {len(a)} rows but num_frames has {n}; "
                            "pass equal-length columns")
    for name in cols:
        # The cap keeps height x width inside int64 and ratios far from float ties.
        bad = (arrays[name] < 1) | (arrays[name] > _MAX_SIDE)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise UserError(f"{name} has {int(bad.sum())} values outside [1, {_MAX_SIDE}] "
                            f"(first at row {i}: {int(arrays[name][i])}); "
                            "fix or drop those metadata rows")
    return arrays["num_frames"], arrays["heights"], arrays["widths"], ids


def _check_stream_args(seed: Any, epoch: Any, frame_interval: Any) -> None:
    if not _is_int(seed):
        raise UserError(f"seed must be an integer, got {seed!r}; pass e.g. seed=42")
    if not _is_int(epoch) or epoch < 0:
        raise UserError(f"epoch must be an integer >= 0, got {epoch!r}; pass the epoch number")
    if not _is_int(frame_interval) or frame_interval < 1:
        raise UserError(f"frame_interval must be an integer >= 1, got {frame_interval!r}; "
                        "use 1 to take consecutive frames")


def _nearest_ratio(ratios: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Index of the closest of the ascending ``keys`` for each ratio; ties take the lower
    (first) key, as Python's min over the table does. Only the two neighbouring keys can
    be closest: distances to the keys on one side are monotone, and with sides below 2**31
    rounding cannot make two of those distances equal (keys are 0.01 apart)."""
    hi = np.searchsorted(keys, ratios).clip(0, len(keys) - 1)
    lo = (hi - 1).clip(0, None)
    closer_hi = np.abs(keys[hi] - ratios) < np.abs(keys[lo] - ratios)
    return np.where(closer_hi, hi, lo)


class _Progress:
    """How far each row got, as one "reached" mask per DropReason; the final reason of a
    dropped row is the furthest stage it reached at any resolution. OR-ing masks is far
    cheaper than a running elementwise max."""

    def __init__(self, n: int):
        self.reached = {r: np.zeros(n, dtype=bool) for r in DropReason if r > DropReason.KEPT}

    def mark(self, where: np.ndarray, reason: DropReason) -> None:
        """Record ``reason`` for rows in ``where`` (a boolean mask or positions)."""
        if where.dtype == bool:
            self.reached[reason] |= where
        else:
            self.reached[reason][where] = True

    def reasons(self, unassigned: np.ndarray) -> np.ndarray:
        out = np.where(unassigned, np.int8(DropReason.BELOW_EVERY_RESOLUTION), np.int8(0))
        for reason, mask in self.reached.items():  # ascending, so later stages overwrite
            out[mask & unassigned] = reason
        return out.astype(np.int8)


def _length_levels(frames: np.ndarray, cfg: BucketConfig,
                   frame_interval: int) -> tuple[np.ndarray, list[int]]:
    """Each row's length as a small integer: how many of the config's bucket lengths
    (num_frames x frame_interval) it strictly exceeds; plus those lengths, ascending."""
    lengths = sorted({e.num_frames * frame_interval for e in cfg.entries})
    return np.searchsorted(np.array(lengths), frames, side="left").astype(np.int16), lengths


def _first_fit_table(videos: list[BucketEntry], lengths: list[int],
                     frame_interval: int) -> np.ndarray:
    """level -> index (into ``videos``, longest first) of the longest entry a row fits.

    A row fits entry e when T > e.num_frames x frame_interval (strict, as in Open-Sora),
    i.e. when its level exceeds that length's rank; len(videos) means none fits.
    """
    ranks = [lengths.index(e.num_frames * frame_interval) for e in videos]
    return np.array([sum(rank >= level for rank in ranks) for level in range(len(lengths) + 1)],
                    dtype=np.int8)


def _choose_videos(res: str, videos: list[BucketEntry], pos: np.ndarray, levels: np.ndarray,
                   lengths: list[int], frame_interval: int, hashes: np.ndarray,
                   progress: _Progress) -> tuple[np.ndarray, np.ndarray]:
    """(positions, index into ``videos``) of the videos that pick a length here."""
    first = _first_fit_table(videos, lengths, frame_interval)[levels[pos]]
    pick = first.copy()
    for k, e in enumerate(videos):  # longest first; a failed p_frames draw moves one shorter
        if e.frame_prob < 1.0:
            at = np.flatnonzero(pick == k)
            gate = _uniform_np(hashes[pos[at]], res, e.num_frames, _GATE)
            pick[at[gate > e.frame_prob]] += 1
    missed = pick == len(videos)
    progress.mark(pos[missed & (first == len(videos))], DropReason.TOO_SHORT)
    progress.mark(pos[missed & (first < len(videos))], DropReason.FRAME_DRAW)
    return pos[~missed], pick[~missed]


def _keep_coin(res: str, entries: list[BucketEntry], pos: np.ndarray, pick: np.ndarray,
               hashes: np.ndarray, progress: _Progress) -> tuple[np.ndarray, np.ndarray]:
    """(positions, entry index) of rows that keep their pick; losers fall through to the
    next resolution."""
    won_pos, won_pick = [], []
    for k, e in enumerate(entries):
        at = pos[pick == k]
        if e.keep_prob == 0.0:
            progress.mark(at, DropReason.ZERO_KEEP_PROB)
            continue
        if e.keep_prob < 1.0:
            won = _uniform_np(hashes[at], res, e.num_frames, _KEEP) < e.keep_prob
            progress.mark(at[~won], DropReason.KEEP_DRAW)
            at = at[won]
        won_pos.append(at)
        won_pick.append(np.full(len(at), k, dtype=np.int64))
    if not won_pos:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(won_pos), np.concatenate(won_pick)


def assign_buckets(num_frames: Any, heights: Any, widths: Any, config: Any, *, seed: int,
                   epoch: int, frame_interval: int = 1, sample_ids: Any = None) -> Assignment:
    """Open-Sora 1.2 bucket assignment for every row at once (see docs/buckets.md).

    ``sample_ids`` (default: row positions) key the random draws; pass stable ids when
    the rows are a filtered or reordered view of the dataset.
    """
    cfg = parse_bucket_config(config)
    _check_stream_args(seed, epoch, frame_interval)
    frames, h, w, ids = _validated_rows(num_frames, heights, widths, sample_ids)
    buckets, first = _bucket_table(cfg)
    n = len(frames)
    hashes, pixels, ratios, is_image = _row_hashes(seed, epoch, ids), h * w, h / w, frames == 1
    levels, lengths = _length_levels(frames, cfg, frame_interval)
    bucket = np.full(n, -1, dtype=np.int32)
    progress = _Progress(n)
    unassigned = np.ones(n, dtype=bool)
    for res in cfg.resolutions():  # largest first; the first resolution a row wins is final
        pos = np.flatnonzero(unassigned & (pixels >= RESOLUTION_PIXELS[res] * 0.8))
        if pos.size == 0:
            continue
        entries = _image_entry(cfg, res) + _video_entries(cfg, res)
        pos, pick = _pick_entries(res, entries, pos, is_image, levels, lengths, frame_interval,
                                  hashes, progress)
        won, pick = _keep_coin(res, entries, pos, pick, hashes, progress)
        offsets = np.array([first.get((res, e.num_frames), -1) for e in entries], dtype=np.int64)
        keys = np.array([float(k) for k in ASPECT_RATIOS[res]])
        bucket[won] = offsets[pick] + _nearest_ratio(ratios[won], keys)
        unassigned[won] = False
    return Assignment(bucket, progress.reasons(unassigned), buckets)


def _image_entry(cfg: BucketConfig, res: str) -> list[BucketEntry]:
    return [e for e in cfg.entries_for(res) if e.num_frames == 1]


def _video_entries(cfg: BucketConfig, res: str) -> list[BucketEntry]:
    return [e for e in cfg.entries_for(res) if e.num_frames > 1]  # longest first


def _pick_entries(res: str, entries: list[BucketEntry], pos: np.ndarray, is_image: np.ndarray,
                  levels: np.ndarray, lengths: list[int], frame_interval: int,
                  hashes: np.ndarray, progress: _Progress) -> tuple[np.ndarray, np.ndarray]:
    """(positions, index into ``entries``) of the rows at ``pos`` that pick an entry here,
    before the keep coin. ``entries`` is [image entry, if any] + video entries."""
    has_image = bool(entries) and entries[0].num_frames == 1
    videos = entries[1:] if has_image else entries
    image_pos, video_pos = pos[is_image[pos]], pos[~is_image[pos]]
    out_pos, out_pick = [], []
    if has_image:
        out_pos.append(image_pos)
        out_pick.append(np.zeros(len(image_pos), dtype=np.int64))
    else:
        progress.mark(image_pos, DropReason.NO_IMAGE_BUCKET)
    if videos:
        vpos, vpick = _choose_videos(res, videos, video_pos, levels, lengths, frame_interval,
                                     hashes, progress)
        out_pos.append(vpos)
        out_pick.append(vpick.astype(np.int64) + has_image)
    else:
        progress.mark(video_pos, DropReason.NO_VIDEO_BUCKET)
    if not out_pos:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(out_pos), np.concatenate(out_pick)


# --------------------------------------------------------------------------------------
# Row-by-row reference (tests, benchmark)
# --------------------------------------------------------------------------------------

def _video_miss(entries: tuple[BucketEntry, ...], fits_any: bool) -> DropReason:
    if all(e.num_frames == 1 for e in entries):
        return DropReason.NO_VIDEO_BUCKET
    return DropReason.FRAME_DRAW if fits_any else DropReason.TOO_SHORT


def _reference_row(cfg: BucketConfig, t: int, h: int, w: int, frame_interval: int,
                   draw, first: dict[tuple[str, int], int]) -> tuple[int, DropReason]:
    """One clip through Open-Sora's get_bucket_id loop; returns (bucket, reason)."""
    progress = DropReason.BELOW_EVERY_RESOLUTION
    for res in cfg.resolutions():
        if h * w < RESOLUTION_PIXELS[res] * 0.8:
            continue
        entries = cfg.entries_for(res)
        chosen = None
        if t == 1:
            chosen = next((e for e in entries if e.num_frames == 1), None)
            if chosen is None:
                progress = max(progress, DropReason.NO_IMAGE_BUCKET)
                continue
        else:
            fits_any = False
            for e in entries:
                if e.num_frames == 1:
                    continue
                fits = t > e.num_frames * frame_interval
                fits_any = fits_any or fits
                # Open-Sora draws the p_frames gate before it checks the length.
                if e.frame_prob < 1.0 and draw(res, e.num_frames, _GATE) > e.frame_prob:
                    continue
                if fits:
                    chosen = e
                    break
            if chosen is None:
                progress = max(progress, _video_miss(entries, fits_any))
                continue
        if chosen.keep_prob >= 1.0 or draw(res, chosen.num_frames, _KEEP) < chosen.keep_prob:
            ratio = h / w
            table = ASPECT_RATIOS[res]
            key = min(table, key=lambda k: abs(float(k) - ratio))
            return first[(res, chosen.num_frames)] + list(table).index(key), DropReason.KEPT
        zero = chosen.keep_prob == 0.0
        progress = max(progress, DropReason.ZERO_KEEP_PROB if zero else DropReason.KEEP_DRAW)
    return -1, progress


def assign_buckets_reference(num_frames: Any, heights: Any, widths: Any, config: Any, *,
                             seed: int, epoch: int, frame_interval: int = 1,
                             sample_ids: Any = None) -> Assignment:
    """``assign_buckets`` written one row at a time in plain Python (same draws, same result)."""
    cfg = parse_bucket_config(config)
    _check_stream_args(seed, epoch, frame_interval)
    frames, h, w, ids = _validated_rows(num_frames, heights, widths, sample_ids)
    buckets, first = _bucket_table(cfg)
    prefix = _row_prefix(seed, epoch)
    keys = {(e.resolution, e.num_frames, s): _draw_key(e.resolution, e.num_frames, s)
            for e in cfg.entries for s in (_GATE, _KEEP)}
    bucket = np.full(len(frames), -1, dtype=np.int32)
    reason = np.zeros(len(frames), dtype=np.int8)
    for i, (t, hh, ww, sid) in enumerate(zip(frames.tolist(), h.tolist(), w.tolist(), ids.tolist())):
        row = _chain(prefix, sid)

        def draw(res: str, n: int, slot: int, row: int = row) -> float:
            return _to_unit(_chain(row, keys[(res, n, slot)]))

        bucket[i], reason[i] = _reference_row(cfg, t, hh, ww, frame_interval, draw, first)
    return Assignment(bucket, reason, buckets)
