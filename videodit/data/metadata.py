"""Metadata CSVs with Open-Sora's columns, validated all at once.

Columns: ``path, text, num_frames, height, width, aspect_ratio, fps`` (``resolution`` and
any other columns are kept). Relative paths resolve against the CSV's folder. Every
problem is collected before reporting: missing columns by name, bad rows by CSV line.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path

from videodit.errors import UserError

REQUIRED_COLUMNS = ("path", "text", "num_frames", "height", "width", "aspect_ratio", "fps")
_POSITIVE_INT = ("num_frames", "height", "width")
_POSITIVE_FLOAT = ("aspect_ratio", "fps")


@dataclass
class Metadata:
    """Validated rows. ``paths`` are absolute; ``columns`` hold every CSV column as read."""

    csv_path: Path
    paths: list[str]
    texts: list[str]
    num_frames: list[int]
    heights: list[int]
    widths: list[int]
    fps: list[float]
    columns: dict[str, list[str]] = field(default_factory=dict)
    bad_rows: list[tuple[int, str]] = field(default_factory=list)   # (CSV line, reason), skipped

    def __len__(self) -> int:
        return len(self.paths)


def read_metadata(csv_path: str | Path, bad_rows: str = "skip", option: str = "data.csv") -> Metadata:
    """Read and validate a metadata CSV.

    ``bad_rows="skip"`` drops invalid rows (listed in ``Metadata.bad_rows``);
    ``"error"`` refuses the file, naming every bad row. ``option`` is the config key named
    when the file is missing.
    """
    csv_path = Path(csv_path)
    if not csv_path.is_file():
        raise UserError(f"metadata CSV {str(csv_path)!r} does not exist; set {option} to an existing file")
    # utf-8-sig: spreadsheet programs (Excel) start a UTF-8 CSV with a byte-order mark.
    try:
        with open(csv_path, newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            header = reader.fieldnames or []
            missing = [c for c in REQUIRED_COLUMNS if c not in header]
            if missing:
                raise UserError(f"{csv_path} is missing column(s) {', '.join(missing)}; Open-Sora metadata "
                                f"needs {', '.join(REQUIRED_COLUMNS)}")
            rows = list(reader)
    except UnicodeDecodeError as exc:
        raise UserError(f"{csv_path} is not UTF-8 text (byte {exc.start}); save it as UTF-8 CSV") from None
    except csv.Error as exc:
        raise UserError(f"{csv_path} is not a readable CSV ({exc}); check its quoting") from None

    meta = Metadata(csv_path, [], [], [], [], [], [], {name: [] for name in header})
    root = csv_path.parent
    for line, row in enumerate(rows, start=2):   # line 1 is the header
        problem = _row_problem(row)
        if problem:
            meta.bad_rows.append((line, problem))
            continue
        path = Path(row["path"])
        meta.paths.append(str(path if path.is_absolute() else root / path))
        meta.texts.append(row["text"])
        meta.num_frames.append(int(float(row["num_frames"])))
        meta.heights.append(int(float(row["height"])))
        meta.widths.append(int(float(row["width"])))
        meta.fps.append(float(row["fps"]))
        for name in header:
            meta.columns[name].append(row[name])

    if meta.bad_rows and bad_rows == "error":
        shown = "; ".join(f"line {line}: {why}" for line, why in meta.bad_rows[:5])
        more = f" (and {len(meta.bad_rows) - 5} more)" if len(meta.bad_rows) > 5 else ""
        raise UserError(f"{csv_path} has {len(meta.bad_rows)} bad row(s): {shown}{more}; fix them or "
                        "let videodit skip bad rows")
    if not meta.paths:
        raise UserError(f"{csv_path} has no usable rows")
    return meta


def _row_problem(row: dict) -> str | None:
    if row.get(None):
        return "more fields than the header"
    if not (row.get("path") or "").strip():
        return "empty path"
    for name in _POSITIVE_INT + _POSITIVE_FLOAT:
        text = row.get(name)
        try:
            value = float(text)
        except (TypeError, ValueError):
            return f"{name}={text!r} is not a number"
        if math.isnan(value) or value <= 0:
            return f"{name}={text!r} must be positive"
        if name in _POSITIVE_INT and not value.is_integer():
            return f"{name}={text!r} must be a whole number"
    return None


def write_csv(path: str | Path, columns: tuple[str, ...] | list[str], rows: list[dict]) -> None:
    """Write ``rows`` as CSV atomically, with ``\\n`` line ends for stable bytes."""
    from videodit.data.video import atomic_output   # video.py pulls in PyAV; metadata stays light

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    with atomic_output(path) as tmp:
        tmp.write_text(buffer.getvalue(), encoding="utf-8", newline="")
