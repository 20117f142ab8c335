"""The columnar metadata reader: the same rows, checks and messages as the row-by-row reader it
replaced, from CSV and Parquet; the node cache shared by local ranks; unchanged buckets."""

from __future__ import annotations

import csv
import math
import multiprocessing
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from videodit.cli import main
from videodit.config import load_config
from videodit.data.buckets import assign_buckets, parse_bucket_config
from videodit.data.buckets.plan import BucketPlan
from videodit.data.metadata import read_metadata
from videodit.data.sampler import BucketBatchSampler, fingerprint
from videodit.errors import UserError

HEADER = "path,text,num_frames,height,width,aspect_ratio,fps,extra"


# ---------------------------------------------------------------------------- the reference


def reference_read(csv_path: Path) -> dict:
    """The row-by-row reader this one replaced (csv.DictReader, one check per row), kept here
    as the reference the columnar reader must match."""
    with open(csv_path, newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames or []
        rows = list(reader)
    out = {"paths": [], "texts": [], "num_frames": [], "heights": [], "widths": [], "fps": [],
           "columns": {name: [] for name in header}, "bad_rows": []}
    for line, row in enumerate(rows, start=2):
        problem = reference_problem(row)
        if problem:
            out["bad_rows"].append((line, problem))
            continue
        path = Path(row["path"])
        out["paths"].append(str(path if path.is_absolute() else csv_path.parent / path))
        out["texts"].append(row["text"])
        for key, name, kind in (("num_frames", "num_frames", int), ("heights", "height", int),
                                ("widths", "width", int), ("fps", "fps", float)):
            out[key].append(kind(float(row[name])))
        for name in header:
            out["columns"][name].append(row[name])
    return out


def reference_problem(row: dict) -> str | None:
    if row.get(None):
        return "more fields than the header"
    if not (row.get("path") or "").strip():
        return "empty path"
    for name in ("num_frames", "height", "width", "aspect_ratio", "fps"):
        text = row.get(name)
        try:
            value = float(text)
        except (TypeError, ValueError):
            return f"{name}={text!r} is not a number"
        if math.isnan(value) or value <= 0:
            return f"{name}={text!r} must be positive"
        if name in ("num_frames", "height", "width") and not value.is_integer():
            return f"{name}={text!r} must be a whole number"
    return None


def assert_same_as_reference(meta, ref: dict) -> None:
    assert meta.paths == ref["paths"]
    assert meta.texts == ref["texts"]
    assert meta.num_frames.tolist() == ref["num_frames"] and meta.heights.tolist() == ref["heights"]
    assert meta.widths.tolist() == ref["widths"] and meta.fps.tolist() == ref["fps"]
    assert list(meta.columns) == list(ref["columns"])
    for name, values in ref["columns"].items():
        assert meta.columns[name] == values, name
    assert list(meta.bad_rows) == ref["bad_rows"]
    assert len(meta) == len(ref["paths"])


# Every kind of row the old reader took or refused: quoting, line ends, short and long rows,
# blank and whitespace-only lines, numbers as float() reads them, paths pathlib normalises.
NASTY = [
    HEADER,
    'a.mp4,plain,16,32,32,1.0,8,x',
    '"clips/b.mp4","a caption, with a comma",8,240,320,0.75,24.0,"y"',
    'c.mp4,"two\nlines and ""quotes""",4,16,16,1,8,z',
    ',empty path,16,32,32,1.0,8,x',
    '\u3000 ,ideographic space only,16,32,32,1.0,8,x',
    'd.mp4,negative,-3,32,32,1.0,8,x',
    'e.mp4,nan size,16,nan,32,1.0,8,x',
    'f.mp4,zero fps,16,32,32,1.0,0,x',
    'g.mp4,half frame,16.5,32,32,1.0,8,x',
    'h.mp4,spaces float() takes, 16 ,32,32,1.0,8 ,x',
    'i.mp4,underscore,1_6,32,32,1.0,8,x',
    'j.mp4,a word,sixteen,32,32,1.0,8,x',
    'k.mp4,inf frames,inf,32,32,1.0,8,x',
    'l.mp4,inf fps is positive,16,32,32,1.0,inf,x',
    'm.mp4,nan(1),16,32,32,1.0,nan(1),x',
    'n.mp4,empty number,,32,32,1.0,8,x',
    'o.mp4,long row,16,32,32,1.0,8,x,surplus',
    'p.mp4,short row missing only extra,16,32,32,1.0,8',
    'q.mp4,short row,16,32',
    '   ',
    '',
    './r/../s.mp4,dot path,1e1,3.2e1,32.0,1,+8,x',
    '/abs/t.mp4,absolute,16,32,32,1.0,8,',
    '"u.mp4",unterminated at the end,16,32,32,1.0,8,"x',
]


def write(path: Path, lines: list[str], *, bom: bool = False, crlf: bool = False) -> Path:
    text = ("\r\n" if crlf else "\n").join(lines) + ("\r\n" if crlf else "\n")
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return path


# ---------------------------------------------------------------------------- CSV


@pytest.mark.parametrize("bom, crlf", [(False, False), (True, True)])
def test_csv_rows_checks_and_messages_match_the_row_by_row_reader(tmp_path, bom, crlf):
    path = write(tmp_path / "meta.csv", NASTY, bom=bom, crlf=crlf)
    meta = read_metadata(path)
    assert_same_as_reference(meta, reference_read(path))
    assert meta.columns["extra"][:3] == ["x", "y", "z"] and meta.path(0) == str(tmp_path / "a.mp4")
    report = meta.read_report
    assert (report.rows, report.bad_rows, report.bytes) == (len(meta) + len(meta.bad_rows),
                                                            len(meta.bad_rows), path.stat().st_size)


def test_random_rows_match_the_row_by_row_reader(tmp_path):
    rng = np.random.default_rng(7)
    cells = ["1", "16", "24.0", "0", "-2", "nan", "", " 8", "x", "1e2", "2.5", "inf", "+3", "007"]
    lines = [HEADER]
    for i in range(3000):
        fields = [rng.choice(["v{}.mp4", "", " ", "/abs/v{}.mp4", "d/./v{}.mp4"]).format(i), f"t{i}"]
        fields += [str(rng.choice(cells)) if rng.random() < 0.05 else str(int(rng.integers(1, 500)))
                   for _ in range(3)]
        fields += ["1.0", str(rng.choice(cells)) if rng.random() < 0.05 else "24", "e"]
        cut = int(rng.integers(6, 10)) if rng.random() < 0.02 else 8
        lines.append(",".join((fields + ["more"])[:cut]))
    path = write(tmp_path / "random.csv", lines)
    assert_same_as_reference(read_metadata(path), reference_read(path))


def test_line_numbers_hold_across_blocks_and_a_stopped_read_ends_its_parser(tmp_path, monkeypatch):
    import threading

    from videodit.data import metadata

    rng = np.random.default_rng(11)
    lines = [HEADER]
    for i in range(2000):
        kind = rng.integers(12)
        text = f'"caption {i}\nover two lines"' if kind == 0 else f"caption {i}"
        row = f"v{i}.mp4,{text},{int(rng.integers(1, 99))},32,32,1.0,8,e"
        lines.append(row + ",surplus" if kind == 1 else row.rsplit(",", 1)[0] if kind == 2 else
                     row.replace(",32,", ",-1,", 1) if kind == 3 else row)
    path = write(tmp_path / "blocks.csv", lines)
    monkeypatch.setattr(metadata, "BLOCK_BYTES", 2048)   # about 40 blocks
    assert_same_as_reference(read_metadata(path), reference_read(path))
    before = threading.active_count()
    chunks = metadata.Source(path).chunks()
    next(chunks)
    chunks.close()
    assert threading.active_count() == before


def test_bad_rows_error_names_lines_and_the_file_must_have_good_rows(tmp_path):
    path = write(tmp_path / "meta.csv", NASTY)
    with pytest.raises(UserError) as info:
        read_metadata(path, bad_rows="error")
    message = str(info.value)
    assert "\n" not in message
    assert "bad row(s): line 5: empty path; line 6: empty path; line 7: num_frames='-3'" in message
    assert message.endswith("more); fix them or let videodit skip bad rows")
    write(tmp_path / "none.csv", [HEADER, ",x,1,1,1,1,1,e"])
    with pytest.raises(UserError, match="has no usable rows"):
        read_metadata(tmp_path / "none.csv")
    write(tmp_path / "header.csv", [HEADER])
    with pytest.raises(UserError, match="has no usable rows"):
        read_metadata(tmp_path / "header.csv")


@pytest.mark.parametrize("content, match", [
    (b"path,text,fps\nx.mp4,hi,8\n", r"missing column\(s\) num_frames, height, width, aspect_ratio; Open-Sora"),
    (b"", r"missing column\(s\) path, text, num_frames"),
    (HEADER.encode() + b",path\na.mp4,t,1,2,2,1,8,e,b.mp4\n", r"column\(s\) path more than once"),
    (HEADER.encode() + b"\na.mp4,caf\xe9,1,2,2,1,8,e\n",
     rf"is not UTF-8 text \(byte {len(HEADER) + 10}\); save it as UTF-8 CSV"),
])
def test_unreadable_csvs_are_one_line_user_errors(tmp_path, content, match):
    (tmp_path / "meta.csv").write_bytes(content)
    for cache in (None, tmp_path / "cache"):
        with pytest.raises(UserError, match=match) as info:
            read_metadata(tmp_path / "meta.csv", cache=cache)
        assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="'.*absent.csv' does not exist; set validation.csv"):
        read_metadata(tmp_path / "absent.csv", option="validation.csv")


def test_numbers_too_large_for_exact_arrays_are_bad_rows(tmp_path):
    path = write(tmp_path / "meta.csv", [HEADER, "a.mp4,t,1e20,32,32,1,8,e", "b.mp4,t,4,32,32,1,8,e"])
    meta = read_metadata(path)
    assert list(meta.bad_rows) == [(2, "num_frames='1e20' is too large")] and meta.paths == [str(tmp_path / "b.mp4")]


# ---------------------------------------------------------------------------- Parquet


def test_parquet_gives_the_same_rows_and_the_same_checks(tmp_path):
    table = pa.table({
        "path": ["a.mp4", None, "c.mp4", "d.mp4", " ", "/abs/f.mp4", "g.mp4"],
        "text": ["a", "b", None, "d", "e", "f", "g"],
        "num_frames": pa.array([16.0, 16, -3, 16.5, 16, 1, 8]),
        "height": pa.array([32, 32, 32, 32, 32, None, 240], pa.int64()),
        "width": pa.array([32, 32, 32, 32, 32, 32, 320], pa.int32()),
        "aspect_ratio": [1.0, 1, 1, 1, 1, 1, 0.75],
        "fps": [8.0, 8, 8, 8, 8, 8, float("nan")],
        "extra": ["x", "y", "z", "w", "v", "u", "t"],
    })
    pq.write_table(table, tmp_path / "meta.parquet")
    meta = read_metadata(tmp_path / "meta.parquet")
    assert meta.paths == [str(tmp_path / "a.mp4")] and meta.num_frames.tolist() == [16]
    assert list(meta.bad_rows) == [(2, "empty path"), (3, "num_frames=-3.0 must be positive"),
                                   (4, "num_frames=16.5 must be a whole number"), (5, "empty path"),
                                   (6, "height=None is not a number"), (7, "fps=nan must be positive")]
    assert meta.unit == "row"
    with pytest.raises(UserError, match="has 6 bad row\\(s\\): row 2: empty path; row 3: num_frames=-3.0") as info:
        read_metadata(tmp_path / "meta.parquet", bad_rows="error")
    assert "\n" not in str(info.value)
    pq.write_table(table.drop_columns(["fps", "width"]), tmp_path / "cols.parquet")
    with pytest.raises(UserError, match=r"missing column\(s\) width, fps"):
        read_metadata(tmp_path / "cols.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match="is not a readable Parquet file"):
        read_metadata(tmp_path / "junk.parquet")


GOOD_PARQUET = {"path": ["a.mp4", "b.mp4"], "text": ["a", "b"], "num_frames": pa.array([16, 1], pa.int64()),
                "height": pa.array([32, 32], pa.int32()), "width": pa.array([32, 32], pa.uint16()),
                "aspect_ratio": pa.array([1.0, 1.0], pa.float32()), "fps": pa.array([8, 8], pa.decimal128(4, 1))}


@pytest.mark.parametrize("column, values, shown", [
    ("num_frames", pa.array(["16", "1e1"]), "num_frames holds text, not numbers; write it as int64"),
    ("num_frames", pa.array(["16", "abc"]).dictionary_encode(), "num_frames holds text, not numbers"),
    ("height", pa.array([True, False]), "height holds bool, not numbers; write it as int64"),
    ("width", pa.array([0, 1], pa.date32()), "width holds date32[day], not numbers"),
    ("fps", pa.array(["8", "8"], pa.large_string()), "fps holds text, not numbers; write it as float64"),
    ("aspect_ratio", pa.array([None, None], pa.null()), "aspect_ratio holds null, not numbers"),
    ("text", pa.array([1, 2]), "text holds numbers, not text; store the captions as text"),
    ("path", pa.array([1, 2]), "path holds numbers, not text; store the paths as text"),
])
def test_a_parquet_column_of_the_wrong_type_is_refused_whole_in_one_line(tmp_path, capsys, column, values, shown):
    """A Parquet column has one type for all its rows: a wrong one is refused before any row is
    read (as a CSV missing a column is), never parsed value by value into something."""
    pq.write_table(pa.table(GOOD_PARQUET), tmp_path / "good.parquet")
    assert read_metadata(tmp_path / "good.parquet").num_frames.tolist() == [16, 1]   # numbers of any kind
    pq.write_table(pa.table({**GOOD_PARQUET, column: values}), tmp_path / "meta.parquet")
    cache = tmp_path / "cache"
    for bad_rows in ("skip", "error"):
        with pytest.raises(UserError, match=re.escape(f"meta.parquet: column {shown}")) as info:
            read_metadata(tmp_path / "meta.parquet", bad_rows, cache=cache)
        assert "\n" not in str(info.value)
    assert not cache.exists()   # refused before anything was written
    assert main(["buckets", str(tmp_path / "meta.parquet"), "--config", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and shown in err


def test_convert_to_parquet_and_back_keeps_the_good_rows(tmp_path, capsys):
    path = write(tmp_path / "meta.csv", NASTY)
    assert main(["data", "convert", str(path), str(tmp_path / "meta.parquet")]) == 0
    out = capsys.readouterr().out
    ref = reference_read(path)
    assert f"wrote {len(ref['paths'])} rows" in out and "first: line 5: empty path" in out
    schema = pq.read_schema(tmp_path / "meta.parquet")
    assert schema.field("num_frames").type == pa.int64() and schema.field("fps").type == pa.float64()
    for converted in (tmp_path / "meta.parquet", tmp_path / "back.csv"):
        if converted.suffix == ".csv":
            assert main(["data", "convert", str(tmp_path / "meta.parquet"), str(converted)]) == 0
        meta = read_metadata(converted)
        assert meta.paths == ref["paths"] and meta.texts == ref["texts"] and not len(meta.bad_rows)
        assert meta.num_frames.tolist() == ref["num_frames"] and meta.fps.tolist() == ref["fps"]
        assert meta.digest == read_metadata(path).digest   # same rows, same data fingerprint
    assert main(["data", "convert", str(path), str(path)]) == 2


def test_filter_reads_and_writes_parquet(tmp_path):
    from videodit.data.scan import filter_metadata

    path = write(tmp_path / "meta.csv", NASTY)
    main(["data", "convert", str(path), str(tmp_path / "meta.parquet")])
    summary = filter_metadata(tmp_path / "meta.parquet", tmp_path / "short.parquet", max_frames=8)
    kept = pq.read_table(tmp_path / "short.parquet")
    assert kept.column("path").to_pylist() == ["clips/b.mp4", "c.mp4"] and summary["kept"] == 2


# ---------------------------------------------------------------------------- the node cache


def test_cached_read_is_the_same_and_maps_on_the_next_read(tmp_path):
    path = write(tmp_path / "meta.csv", NASTY)
    cache = tmp_path / "cache"
    first, second = read_metadata(path, cache=cache), read_metadata(path, cache=cache)
    assert first.read_report.how.startswith("read and cached in " + str(cache))
    assert second.read_report.how.startswith("mapped from " + str(cache))
    for meta in (first, second, pickle.loads(pickle.dumps(second))):
        assert_same_as_reference(meta, reference_read(path))
    assert len(pickle.dumps(second)) < 2000   # workers map the cache again; the rows are not copied
    assert not second.num_frames.flags.writeable
    cfg = load_config("tiny", [f"data.csv={path}"])
    plan = BucketPlan(second, cfg.data, 2, seed=0)
    samplers = [BucketBatchSampler(plan.assign, [2], seed=0, share=share, share_key=plan.assign_key)
                for share in (None, second.shared, first.shared)]   # alone, made in the cache, mapped
    assert list(samplers[0]) == list(samplers[1]) == list(samplers[2])
    derived = cache / second.read_report.how.split("/")[-1] / "derived"
    assert sorted(p.name.split("-")[0] for p in derived.iterdir() if not p.name.startswith(".")) == ["buckets", "plan"]


def test_cache_key_follows_size_mtime_and_content(tmp_path):
    path = write(tmp_path / "meta.csv", [HEADER, "a.mp4,t,16,32,32,1,8,e"])
    cache = tmp_path / "cache"
    stat = path.stat()
    read_metadata(path, cache=cache)
    path.write_text(path.read_text().replace("a.mp4", "b.mp4"))   # same size, same mtime
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    meta = read_metadata(path, cache=cache)
    assert meta.paths == [str(tmp_path / "b.mp4")] and meta.read_report.how.startswith("read and cached")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))   # touched: read again
    assert read_metadata(path, cache=cache).read_report.how.startswith("read and cached")
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 3


def _read_as_local_rank(rank, path, cache, barrier, results):
    os.environ["LOCAL_RANK"] = str(rank)
    barrier.wait()
    meta = read_metadata(path, cache=cache)
    results.put((rank, meta.read_report.how.split(" /")[0], meta.digest, len(meta)))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_local_rank_zero_reads_and_the_other_ranks_map_its_copy(tmp_path):
    lines = [HEADER] + [f"v{i}.mp4,caption {i},{i % 90 + 1},240,320,0.75,24,e" for i in range(20000)]
    path = write(tmp_path / "meta.csv", lines)
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(4), context.Queue()
    workers = [context.Process(target=_read_as_local_rank, args=(rank, path, tmp_path / "cache", barrier, results))
               for rank in (3, 1, 0, 2)]
    for worker in workers:
        worker.start()
    got = sorted(results.get(timeout=60) for _ in workers)
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    assert [how for _, how, _, _ in got] == ["read and cached in", "mapped from", "mapped from", "mapped from"]
    assert len({(digest, n) for _, _, digest, n in got}) == 1 and got[0][3] == 20000


# ---------------------------------------------------------------------------- buckets


def test_bucket_assignment_is_unchanged(tmp_path):
    rng = np.random.default_rng(3)
    sizes = np.array([(144, 256), (240, 426), (360, 640), (480, 854), (720, 1280), (1080, 1920), (256, 256)])
    rows = []
    for i in range(4000):
        h, w = sizes[rng.integers(len(sizes))] * rng.uniform(0.9, 1.1)
        h, w = (int(w), int(h)) if rng.random() < 0.2 else (int(h), int(w))
        frames = 1 if rng.random() < 0.3 else int(rng.integers(2, 600))
        rows.append(f"v{i}.mp4,t,{frames},{h},{w},{h / w:.4f},24,e")
    path = write(tmp_path / "meta.csv", [HEADER] + rows + ["bad.mp4,t,0,1,1,1,1,e"])
    cfg = load_config("opensora-v1.2-stage1", [f"data.csv={path}"])
    ref = reference_read(path)
    for cache in (None, tmp_path / "cache"):
        plan = BucketPlan(read_metadata(path, cache=cache), cfg.data, cfg.train.batch_size, cfg.train.seed)
        for epoch in (0, 1):
            want = assign_buckets(np.asarray(ref["num_frames"]), np.asarray(ref["heights"]),
                                  np.asarray(ref["widths"]), parse_bucket_config(cfg.data.bucket_config),
                                  seed=cfg.train.seed, epoch=epoch, frame_interval=cfg.data.frame_interval)
            got = plan.assignment(epoch)
            assert np.array_equal(got.bucket, want.bucket) and np.array_equal(got.reason, want.reason)
            assert got.buckets == want.buckets
    # A checkpoint written with the row-by-row reader names its data by this fingerprint.
    legacy = fingerprint(ref["paths"], ref["num_frames"], ref["heights"], ref["widths"],
                         plan.config.to_dict(), cfg.data.frame_interval)
    assert plan.legacy_fingerprint() == legacy and plan.fingerprint != legacy


# ---------------------------------------------------------------------------- the node cache key


def _sparse_key(monkeypatch):
    """Hash only 4 blocks of 64 bytes, as a large file's 64 blocks of 64 KiB cover a small part
    of it; returns the offsets of the blocks hashed for a file of ``size`` bytes."""
    from videodit.data import metadata, node_cache
    monkeypatch.setattr(metadata, "entry_key", lambda path, version: node_cache.entry_key(path, version, 64, 4))
    return lambda size: [int(o) for o in np.linspace(0, size - 64, 4)]


def _rows_file(path: Path) -> tuple[Path, int, int]:
    """A CSV of 200 rows, and the byte range of row 40, which lies between hashed blocks."""
    lines = [HEADER] + [f"v{i:04d}.mp4,caption {i:04d},16,240,320,0.75,24,e" for i in range(200)]
    write(path, lines)
    start = len("\n".join(lines[:41])) + 1
    return path, start, start + len(lines[41])


def test_an_edit_between_hashed_blocks_with_its_mtime_restored_is_read_again(tmp_path, monkeypatch):
    blocks = _sparse_key(monkeypatch)
    path, start, end = _rows_file(tmp_path / "meta.csv")
    assert all(o + 64 <= start or o >= end for o in blocks(path.stat().st_size))
    cache, stat = tmp_path / "cache", path.stat()
    assert len(read_metadata(path, cache=cache)) == 200
    with open(path, "r+b") as handle:   # in place, the same length: v0040 gets -1 frames
        handle.seek(start)
        row = handle.read(end - start)
        handle.seek(start)
        handle.write(row.replace(b",16,", b",-1,"))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))   # as touch -r, cp -p, rsync -t do
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    meta = read_metadata(path, cache=cache)
    assert meta.read_report.how.startswith("read and cached")
    assert len(meta) == 199 and meta.bad_rows[0][0] == 42
    again = read_metadata(path, cache=cache)   # unchanged since: mapped
    assert again.read_report.how.startswith("mapped from") and len(again) == 199


def test_a_copy_put_in_place_with_the_same_mtime_is_read_again(tmp_path, monkeypatch):
    _sparse_key(monkeypatch)   # the edit falls between sampled blocks
    path, start, end = _rows_file(tmp_path / "meta.csv")
    cache, stat = tmp_path / "cache", path.stat()
    read_metadata(path, cache=cache)
    data = path.read_bytes()
    edited = write(tmp_path / "edited.csv", [])
    edited.write_bytes(data[:start] + data[start:end].replace(b"v0040", b"w0040") + data[end:])
    os.utime(edited, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    shutil.copy2(edited, tmp_path / "meta.csv.tmp")   # new inode, the same size and mtime
    os.replace(tmp_path / "meta.csv.tmp", path)       # as rsync -t puts a file in place
    assert path.stat().st_ino != stat.st_ino and path.stat().st_mtime_ns == stat.st_mtime_ns
    meta = read_metadata(path, cache=cache)
    assert meta.read_report.how.startswith("read and cached") and meta.path(40) == str(tmp_path / "w0040.mp4")
    copy = shutil.copy2(path, tmp_path / "copy.csv")   # a copy beside it: its own entry, its own rows
    assert read_metadata(copy, cache=cache).read_report.how.startswith("read and cached")


# ---------------------------------------------------------------------------- files that are not files


@pytest.mark.parametrize("fifo, argv", [
    ("meta.csv", ["buckets", "{fifo}", "--config", "tiny"]),
    ("meta.parquet", ["buckets", "{fifo}", "--config", "tiny"]),
    ("meta.csv", ["data", "convert", "{fifo}", "{tmp}/out.parquet"]),
    ("meta.csv", ["train", "tiny", "--out", "{tmp}/run", "data.csv={fifo}"]),
    ("buckets.yaml", ["config", "show", "tiny", "data.bucket_config_file={fifo}"]),
    ("stage1.py", ["buckets", "--from-opensora", "{fifo}"]),
    ("vae.pth", ["plan", "tiny", "--gpu-mem", "80GiB", "vae.kind=wan2.1", "vae.path={fifo}"]),
])
@pytest.mark.timeout(60)   # a FIFO opened for reading would block until a writer came: forever
def test_a_fifo_given_as_a_file_is_refused_in_one_line_not_waited_on(tmp_path, capsys, fifo, argv):
    os.mkfifo(tmp_path / fifo)
    argv = [a.format(fifo=tmp_path / fifo, tmp=tmp_path) for a in argv]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert f"{tmp_path / fifo} is not a regular file but a FIFO; give a regular file" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before   # no run folder, no output
