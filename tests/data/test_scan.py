"""videodit.data.scan: metadata CSVs from folders of media, and filtering them."""

import csv
import os

import av
import numpy as np
from pathlib import Path

import pytest
from tqdm import tqdm

from videodit.data import scan as scan_module
from videodit.data.metadata import read_metadata
from videodit.data.scan import FILTER_REASONS, SCAN_COLUMNS, error_report_path, filter_metadata, scan
from videodit.data.video import IMAGE_FPS
from videodit.data.video_write import write_video
from videodit.errors import UserError

# name -> (num_frames, height, width, fps) of the good files made by `media`.
GOOD = {
    "videos/a.mp4": (8, 32, 48, 8.0),
    "videos/sub/b.mp4": (12, 64, 64, 24.0),
    "img.png": (1, 20, 30, IMAGE_FPS),
    "anim.gif": (5, 16, 24, 10.0),
}
BROKEN = ["broken/zero.mp4", "broken/text.mp4", "broken/trunc.mp4"]


def _frames(num_frames, height, width, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8)


def _read_rows(path):
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture()
def media(tmp_path):
    """tmp_path/data with the GOOD files, the BROKEN ones, and files a scan must ignore."""
    root = tmp_path / "data"
    for name, (num_frames, height, width, fps) in GOOD.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        write_video(root / name, _frames(num_frames, height, width), fps)
    (root / "broken").mkdir()
    (root / "broken/zero.mp4").write_bytes(b"")
    (root / "broken/text.mp4").write_text("this is not a video\n")
    whole = (root / "videos/a.mp4").read_bytes()
    (root / "broken/trunc.mp4").write_bytes(whole[: len(whole) // 2])   # moov atom at the end: gone
    (root / "notes.txt").write_text("not media\n")
    (root / ".partial.mp4").write_text("hidden: an interrupted write")
    (root / ".cache").mkdir()
    (root / ".cache/hidden.mp4").write_text("hidden folder")
    return root


def _captions_csv(root):
    path = root / "captions.csv"
    path.write_text('path,text,source\nvideos/a.mp4,"a clip, with a comma",x\nimg.png,an image,y\n'
                    "missing.mp4,nobody,z\n", encoding="utf-8")
    return path


def test_scan_writes_opensora_rows(media):
    out = media / "meta.csv"
    summary = scan([str(media)], str(out), captions=str(_captions_csv(media)), workers=2, progress=False)

    assert (summary["found"], summary["ok"], summary["failed"], summary["skipped"]) == (7, 4, 3, 0)
    assert (summary["captioned"], summary["captions_unmatched"], summary["corrected"]) == (2, 1, [])
    assert summary["csv"] == str(out) and summary["report"] == str(media / "meta.errors.csv")

    with open(out, newline="") as handle:
        assert next(csv.reader(handle)) == list(SCAN_COLUMNS)
    rows = {row["path"]: row for row in _read_rows(out)}
    assert sorted(rows) == sorted(GOOD)   # relative to the CSV's folder, broken/hidden/txt absent
    for name, (num_frames, height, width, fps) in GOOD.items():
        row = rows[name]
        assert int(row["num_frames"]) == num_frames, name
        assert (int(row["height"]), int(row["width"])) == (height, width), name
        assert float(row["fps"]) == pytest.approx(fps), name
        assert float(row["aspect_ratio"]) == pytest.approx(height / width)
        assert int(row["resolution"]) == height * width
    assert rows["videos/a.mp4"]["text"] == "a clip, with a comma"
    assert rows["img.png"]["text"] == "an image"
    assert rows["anim.gif"]["text"] == "" and rows["videos/sub/b.mp4"]["text"] == ""

    report = _read_rows(error_report_path(out))
    assert sorted(r["path"] for r in report) == sorted(BROKEN)
    assert all(r["error"] and "\n" not in r["error"] for r in report)
    assert "empty" in {r["path"]: r["error"] for r in report}["broken/zero.mp4"]

    meta = read_metadata(out, bad_rows="error")
    assert len(meta) == 4 and all(os.path.isfile(p) for p in meta.paths)
    assert not [p for p in os.listdir(media) if ".tmp" in p]   # atomic writes leave no temporaries


def test_scan_outside_csv_folder_writes_absolute_paths_and_tab_captions(media, tmp_path):
    captions = tmp_path / "captions.txt"
    captions.write_text(f"{media / 'anim.gif'}\ta gif\twith a tab\n\n{media / 'img.png'}\tstill\n")
    out = tmp_path / "elsewhere" / "meta.csv"
    summary = scan([str(media / "videos"), str(media / "img.png"), str(media / "anim.gif"),
                    str(media / "notes.txt"), str(media / "videos")],   # a repeat is scanned once
                   str(out), captions=str(captions), workers=2, progress=False)
    assert (summary["found"], summary["ok"], summary["failed"], summary["skipped"]) == (4, 4, 0, 1)
    rows = {row["path"]: row["text"] for row in _read_rows(out)}
    assert rows == {str(media / name): text for name, text in [
        ("videos/a.mp4", ""), ("videos/sub/b.mp4", ""), ("img.png", "still"), ("anim.gif", "a gif\twith a tab")]}
    assert _read_rows(error_report_path(out)) == []   # written even when empty: no stale report


def test_scan_in_process_matches_worker_pool(media, tmp_path):
    scan([str(media)], str(tmp_path / "one.csv"), workers=1, progress=False)
    scan([str(media)], str(tmp_path / "pool.csv"), workers=3, progress=False)
    assert (tmp_path / "one.csv").read_text() == (tmp_path / "pool.csv").read_text()
    assert (tmp_path / "one.errors.csv").read_text() == (tmp_path / "pool.errors.csv").read_text()


def test_verify_decodes_containers_that_lie_about_frame_counts(tmp_path):
    # Index (moov) at the front, then cut: the container still claims all 12 frames.
    whole = tmp_path / "whole.mp4"
    with av.open(str(whole), "w", format="mp4", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for rgb in _frames(12, 32, 32):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(stream.encode(None))
    folder = tmp_path / "clips"
    folder.mkdir()
    data = whole.read_bytes()
    (folder / "cut.mp4").write_bytes(data[: len(data) * 2 // 3])
    write_video(folder / "fine.mp4", _frames(6, 32, 32), 8)

    scan([str(folder)], str(folder / "fast.csv"), workers=2, progress=False)
    assert {r["path"]: int(r["num_frames"]) for r in _read_rows(folder / "fast.csv")} == {
        "cut.mp4": 12, "fine.mp4": 6}
    summary = scan([str(folder)], str(folder / "verified.csv"), workers=2, progress=False, verify=True)
    counts = {r["path"]: int(r["num_frames"]) for r in _read_rows(folder / "verified.csv")}
    assert 0 < counts["cut.mp4"] < 12 and counts["fine.mp4"] == 6
    assert summary["corrected"] == ["cut.mp4"]


def test_verify_reports_a_frame_size_change_mid_stream(tmp_path):
    from clipgen import size_change_mp4

    folder = tmp_path / "clips"
    folder.mkdir()
    size_change_mp4(folder / "joined.mp4", _frames(6, 32, 48), _frames(5, 48, 32, seed=1))
    write_video(folder / "fine.mp4", _frames(6, 32, 32), 8)

    scan([str(folder)], str(folder / "fast.csv"), workers=1, progress=False)   # metadata only
    assert sorted(r["path"] for r in _read_rows(folder / "fast.csv")) == ["fine.mp4", "joined.mp4"]
    summary = scan([str(folder)], str(folder / "verified.csv"), workers=2, progress=False, verify=True)
    assert (summary["ok"], summary["failed"]) == (1, 1)
    [error] = _read_rows(folder / "verified.errors.csv")
    assert error["path"] == "joined.mp4"
    assert "frame size changes mid-stream from 48x32 to 32x48 (width x height) at frame 6" in error["error"]
    assert "re-encode" in error["error"]


def _crashing_probe(path, verify):
    """Stands in for a decoder segfault: the worker process dies on 'crash' files."""
    if os.path.basename(path).startswith("crash"):
        os._exit(11)
    return scan_module._probe_one(path, verify)


def test_a_worker_crash_is_reported_and_the_scan_goes_on(tmp_path):
    files = []
    for k in range(12):
        name = tmp_path / (f"crash{k}.mp4" if k in (3, 9) else f"ok{k:02d}.png")
        write_video(name, _frames(1, 8, 8, seed=k), 1) if name.suffix == ".png" else name.write_bytes(b"x")
        files.append(str(name))
    with tqdm(total=len(files), disable=True) as bar:
        results = scan_module._probe_files(files, 2, False, bar, probe=_crashing_probe)
    for path, (info, error) in zip(files, results):
        if os.path.basename(path).startswith("crash"):
            assert info is None and "crashed" in error
        else:
            assert error is None and info["num_frames"] == 1, (path, error)


def _write_meta(path, header, rows):
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)


@pytest.fixture()
def meta_csv(tmp_path):
    header = ["path", "text", "num_frames", "height", "width", "aspect_ratio", "fps", "resolution", "extra"]
    rows = [
        ["clips/short.mp4", "short", "4", "240", "320", "0.75", "24", "76800", "e1"],
        ["clips/long.mp4", "long, with comma", "120", "720", "1280", "0.5625", "30.0", "921600", "e2"],
        ["/abs/img.png", "image", "1", "512", "512", "1.0", "120.0", "262144", "e3"],
        ["clips/portrait.mp4", "tall", "48", "640", "360", "1.7777", "25", "230400", "e4"],
        ["clips/bad.mp4", "bad", "zero", "240", "320", "0.75", "24", "76800", "e5"],
        ["clips/slow.mp4", "slow", "60", "480", "640", "0.75", "8", "307200", "e6"],
    ]
    path = tmp_path / "in.csv"
    _write_meta(path, header, rows)
    return path


def test_filter_keeps_columns_and_original_paths(meta_csv, tmp_path):
    out = tmp_path / "out" / "kept.csv"
    summary = filter_metadata(str(meta_csv), str(out), min_frames=2, max_resolution=500_000, min_fps=10,
                              max_aspect_ratio=1.5)
    with open(out, newline="") as handle:
        assert next(csv.reader(handle))[-1] == "extra"
    kept = _read_rows(out)
    assert [r["path"] for r in kept] == ["clips/short.mp4"]   # not resolved against in.csv's folder
    assert kept[0] == {"path": "clips/short.mp4", "text": "short", "num_frames": "4", "height": "240",
                       "width": "320", "aspect_ratio": "0.75", "fps": "24", "resolution": "76800",
                       "extra": "e1"}
    assert (summary["rows"], summary["kept"], summary["dropped"]) == (6, 1, 5)
    assert set(summary["dropped_by"]) == set(FILTER_REASONS)
    assert {k: v for k, v in summary["dropped_by"].items() if v} == {
        "invalid": 1, "min_frames": 1, "max_resolution": 1, "min_fps": 1, "max_aspect_ratio": 1}
    assert summary["invalid_rows"][0][0] == 6   # CSV line of the bad row


def test_filter_bounds_are_inclusive_and_images_videos_switches(meta_csv, tmp_path):
    out = tmp_path / "kept.csv"
    filter_metadata(meta_csv, out, min_height=240, max_height=480, min_width=320, max_width=640)
    assert [r["path"] for r in _read_rows(out)] == ["clips/short.mp4", "clips/slow.mp4"]
    summary = filter_metadata(meta_csv, out, videos=False)
    assert [r["path"] for r in _read_rows(out)] == ["/abs/img.png"]
    assert summary["dropped_by"]["videos"] == 4
    summary = filter_metadata(meta_csv, out, images=False, min_aspect_ratio=1.0, max_frames=48)
    assert [r["path"] for r in _read_rows(out)] == ["clips/portrait.mp4"]
    assert summary["dropped_by"]["images"] == 1


def test_filter_onto_its_own_input_is_refused_and_keeps_it(meta_csv):
    before = Path(meta_csv).read_bytes()
    with pytest.raises(UserError, match="is the input CSV"):
        filter_metadata(meta_csv, meta_csv, max_frames=4)
    assert Path(meta_csv).read_bytes() == before


def _one_line_user_error(call, match):
    with pytest.raises(UserError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_bad_inputs_raise_one_line_user_errors(media, meta_csv, tmp_path):
    out = tmp_path / "meta.csv"
    out.write_text("keep me")
    _one_line_user_error(lambda: scan([str(tmp_path / "nope")], str(out), progress=False), "does not exist")
    _one_line_user_error(lambda: scan([], str(out), progress=False), "no paths")
    (tmp_path / "empty").mkdir()
    _one_line_user_error(lambda: scan([str(tmp_path / "empty")], str(out), progress=False),
                         "no videos or images")
    _one_line_user_error(lambda: scan([str(media)], str(out), captions=str(tmp_path / "no.csv"),
                                      progress=False), "captions file")
    (tmp_path / "caps.txt").write_text("videos/a.mp4 no tab here\n")
    _one_line_user_error(lambda: scan([str(media)], str(out), captions=str(tmp_path / "caps.txt"),
                                      progress=False), r"caps.txt:1 has no tab")
    (tmp_path / "caps.csv").write_text("file,caption\na.mp4,x\n")
    _one_line_user_error(lambda: scan([str(media)], str(out), captions=str(tmp_path / "caps.csv"),
                                      progress=False), "missing column")
    _one_line_user_error(lambda: scan([str(media)], str(out), workers=-1, progress=False), "workers")
    assert out.read_text() == "keep me" and not error_report_path(out).exists()

    _write_meta(tmp_path / "cols.csv", ["path", "text", "num_frames"], [["a.mp4", "x", "3"]])
    _one_line_user_error(lambda: filter_metadata(tmp_path / "cols.csv", out), "missing column")
    _one_line_user_error(lambda: filter_metadata(tmp_path / "absent.csv", out), "does not exist")
    _one_line_user_error(lambda: filter_metadata(meta_csv, out, min_fps=30, max_fps=10), "greater than")
    _one_line_user_error(lambda: filter_metadata(meta_csv, out, min_frames="8"), "not a number")
    _one_line_user_error(lambda: filter_metadata(meta_csv, out, images=False, videos=False), "every row")
    assert out.read_text() == "keep me"
