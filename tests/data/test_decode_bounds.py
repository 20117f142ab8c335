"""Bounds on what a file may make the reader do: frames beyond ``data.max_pixels`` (by the CSV,
the container's header, or as decoded) and files that are not regular files fail like any
unreadable file (skipped and reported in training, one line elsewhere); frames far larger than
the bucket are shrunk as they are read, never held at full size."""

import os
import struct
import zlib

import pytest
import torch

from clipgen import moving_frames, size_change_mp4
from conftest import tiny_overrides
from videodit.cli import main
from videodit.config import DataConfig, load_config
from videodit.data.buckets.plan import BucketPlan
from videodit.data.dataset import BadFileGuard, VideoDataset, clip_tensor, collate
from videodit.data.metadata import read_metadata
from videodit.data.scan import scan
from videodit.data.video import (MAX_PIXELS, FrameTooLarge, VideoReadError, probe_video, read_video,
                                 shrunk_size)
from videodit.data.video_write import write_video
from videodit.errors import UserError
from videodit.sample import read_reference
from with_decoders import decoder  # noqa: F401 -- the fixture: tests taking it run with PyAV and torchcodec

HEIGHT, WIDTH = 16, 24


def png_header(path, width: int, height: int) -> None:
    """A PNG whose header declares ``width`` x ``height`` but that holds a few bytes of pixels:
    any attempt to decode it in full fails (or would need width x height x 3 bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))


def test_the_readers_bound_is_the_config_default():
    assert DataConfig().max_pixels == MAX_PIXELS


# --------------------------------------------------------------------------- training samples


def _dataset(folder, rows, max_pixels):
    """A VideoDataset over ``rows`` (name, csv height, csv width) of files in ``folder``, with the
    data.* config of a 16x24 bucket and ``max_pixels`` as data.max_pixels."""
    lines = ["path,text,num_frames,height,width,aspect_ratio,fps"]
    lines += [f"{name},{name},6,{h},{w},{h / w},8" for name, h, w in rows]
    (folder / "meta.csv").write_text("\n".join(lines) + "\n")
    cfg = load_config("tiny", [f"data.csv={folder / 'meta.csv'}", "data.num_frames=2", f"data.height={HEIGHT}",
                               f"data.width={WIDTH}", f"data.max_pixels={max_pixels}",
                               "data.make_toy_if_missing=false"])
    meta = read_metadata(folder / "meta.csv")
    return VideoDataset(meta, BucketPlan(meta, cfg.data, 2, 0), seed=0, max_pixels=cfg.data.max_pixels)


@pytest.mark.parametrize("case, reason", [
    # The CSV says 16000x16000: refused before the file is opened (it is a small, good clip).
    ("csv", "its frames are 16000x16000 (width x height, by the CSV), 256000000 pixels, more than "
            "data.max_pixels=4000"),
    # The CSV says 16x24 but the stream's header says 48x96: refused before a frame is decoded.
    ("header", "its frames are 96x48 (width x height), 4608 pixels, more than data.max_pixels=4000"),
    # The header says 32x48 but the stream grows to 64x96 mid-file: refused at that frame.
    ("decoded", "its frames are 96x64 (width x height, as decoded), 6144 pixels, more than "
                "data.max_pixels=4000"),
    # A FIFO would block PyAV's open forever.
    ("fifo", "not a regular file but a FIFO; give a regular file"),
])
def test_a_clip_beyond_max_pixels_or_not_a_file_is_skipped_and_reported(tmp_path, case, reason, decoder):
    write_video(tmp_path / "good.mp4", moving_frames(6, 32, 48), fps=8)
    bad, csv_size = tmp_path / f"bad-{case}.mp4", (HEIGHT, WIDTH)
    if case == "csv":
        write_video(bad, moving_frames(6, 32, 48, seed=1), fps=8)
        csv_size = (16000, 16000)
    elif case == "header":
        write_video(bad, moving_frames(6, 48, 96, seed=1), fps=8)
    elif case == "decoded":
        size_change_mp4(bad, moving_frames(3, 32, 48), moving_frames(3, 64, 96, seed=1))
    else:
        os.mkfifo(bad)
    dataset = _dataset(tmp_path, [("good.mp4", 32, 48), (bad.name, *csv_size)], max_pixels=4000)
    samples = dataset.__getitems__([(0, 0, 0), (1, 0, 0)])
    failed = samples[1]["failed"]   # a replacement drawn from the bucket may be the bad clip again
    assert failed and {path for path, _ in failed} == {str(bad)}
    assert reason in failed[0][1]
    if case != "fifo":
        assert "or raise data.max_pixels" in failed[0][1]
    batch = collate(samples)   # the bad clip was replaced by the good one: the batch keeps its shape
    assert batch.video.shape == (2, 3, 2, HEIGHT, WIDTH) and batch.text == ["good.mp4", "good.mp4"]
    guard = BadFileGuard(max_fraction=0.9)
    guard.update(batch)
    assert guard.summary().startswith(f"skipped 1 unreadable file(s) ({len(failed)} failed reads), e.g. {bad}: ")


def test_training_skips_and_names_a_clip_beyond_max_pixels(toy_dir, tmp_path, capsys):
    # A row claiming 16000x16000 in a real training run (the default data.max_pixels): skipped,
    # reported at the end with the clip named and the key to change; the run completes.
    rows = (toy_dir / "train.csv").read_text().splitlines()[:4]   # the header and 3 clips
    first = rows[1].split(",")
    huge = ",".join([str(toy_dir / first[0]), "a huge clip", first[2], "16000", "16000", "1.0", first[6]])
    csv = tmp_path / "train.csv"
    csv.write_text("\n".join([rows[0], *[f"{toy_dir / r.split(',', 1)[0]},{r.split(',', 1)[1]}" for r in rows[1:]],
                              huge]) + "\n")
    # One batch of all 4 rows: the huge one is read (and replaced) in the first step.
    overrides = tiny_overrides(toy_dir, **{"data.csv": str(csv), "train.max_steps": 1, "train.batch_size": 4})
    assert main(["train", "--out", str(tmp_path / "run"), *overrides]) == 0
    out = capsys.readouterr()
    line = next(line for line in (out.out + out.err).splitlines() if "unreadable file" in line)
    assert str(toy_dir / first[0]) in line and "16000x16000" in line and "data.max_pixels=67108864" in line


# --------------------------------------------------------------------------- shrinking while reading


def test_frames_far_larger_than_the_bucket_are_shrunk_while_decoded(tmp_path, decoder):
    # 640x960 for a 16x24 bucket: 40x its cover size, decoded at 4x (64x96) in the colour
    # conversion, the window reader and the full decode alike; the sample stays close to what
    # resizing the full-size frames gives.
    frames = moving_frames(6, 640, 960)
    write_video(tmp_path / "big.mp4", frames, fps=8)
    assert shrunk_size(960, 640, (HEIGHT, WIDTH)) == (96, 64)
    assert shrunk_size(192, 128, (HEIGHT, WIDTH)) is None   # up to 8x: read as it is
    full, _ = read_video(tmp_path / "big.mp4")
    for indices in ([1, 4], None):
        shrunk, _ = read_video(tmp_path / "big.mp4", indices=indices, fit=(HEIGHT, WIDTH))
        assert shrunk.shape == (2 if indices else 6, 64, 96, 3)
    want = clip_tensor(full[[1, 4]], HEIGHT, WIDTH)
    got = clip_tensor(read_video(tmp_path / "big.mp4", indices=[1, 4], fit=(HEIGHT, WIDTH))[0], HEIGHT, WIDTH)
    assert (got - want).abs().mean() * 127.5 < 3   # levels of 255


def test_a_jpeg_is_decoded_at_a_fraction_of_its_size(tmp_path, monkeypatch):
    from PIL import Image, JpegImagePlugin

    Image.new("RGB", (4000, 4000), (200, 40, 30)).save(tmp_path / "big.jpg", quality=90)
    decoded = []
    load = JpegImagePlugin.JpegImageFile.load
    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "load", lambda self: decoded.append(self.size) or load(self))
    reference = read_reference(str(tmp_path / "big.jpg"), 1, HEIGHT, WIDTH)
    assert set(decoded) == {(500, 500)}   # DCT scaling at 1/8: 4000x4000 was never decoded
    assert reference.shape == (3, 1, HEIGHT, WIDTH)
    assert torch.allclose(reference[:, 0, 8, 12], torch.tensor([200, 40, 30]) / 127.5 - 1, atol=3 / 127.5)


# --------------------------------------------------------------------------- one line elsewhere


@pytest.mark.parametrize("case, message", [
    ("header", "the reference '{path}' is 9000x9000 (width x height), 81000000 pixels, more than the "
               "67108864 a reference may have (data.max_pixels)"),
    # Beyond Pillow's own decompression-bomb bound (2 x Image.MAX_IMAGE_PIXELS): no size, a count.
    ("bomb", "the reference '{path}' has 400000000 pixels, more than the 67108864 a reference may have"),
    ("video", "the reference '{path}' is 96x48 (width x height), 4608 pixels, more than the 4000 a reference"),
    ("fifo", "cannot read the reference '{path}': not a regular file but a FIFO; give a regular file"),
])
def test_a_huge_or_irregular_reference_is_refused_in_one_line(tmp_path, case, message):
    path, limit = tmp_path / "ref.png", None
    if case == "header":
        png_header(path, 9000, 9000)   # decoding it would need 243 MB (and fail: it holds no pixels)
    elif case == "bomb":
        png_header(path, 20000, 20000)
    elif case == "video":
        path, limit = tmp_path / "ref.mp4", 4000
        write_video(path, moving_frames(4, 48, 96), fps=8)
    else:
        os.mkfifo(path)
    with pytest.raises(UserError) as info:
        read_reference(str(path), 2, HEIGHT, WIDTH, max_pixels=limit)
    assert message.format(path=path) in str(info.value) and "\n" not in str(info.value)


def test_readers_and_scan_refuse_a_fifo_or_device_and_probe_huge_images_by_header(tmp_path, decoder):
    os.mkfifo(tmp_path / "fifo.mp4")
    for path, kind in ((tmp_path / "fifo.mp4", "a FIFO"), ("/dev/zero", "a character device")):
        for reader in (read_video, probe_video):
            with pytest.raises(VideoReadError, match=f"not a regular file but {kind}"):
                reader(path)
    png_header(tmp_path / "huge.png", 9000, 9000)
    assert probe_video(tmp_path / "huge.png")["height"] == 9000   # by its header; training refuses it
    with pytest.raises(FrameTooLarge):
        read_video(tmp_path / "huge.png")
    write_video(tmp_path / "ok.mp4", moving_frames(4, 16, 16), fps=8)
    summary = scan([str(tmp_path)], str(tmp_path / "meta.csv"), progress=False)
    report = (tmp_path / "meta.errors.csv").read_text()   # the FIFO is reported, never waited on
    assert summary["failed"] == 1 and "fifo.mp4" in report and "not a regular file but a FIFO" in report
    assert "ok.mp4" in (tmp_path / "meta.csv").read_text() and "huge.png" in (tmp_path / "meta.csv").read_text()
    with pytest.raises(UserError, match="captions file .* is not a regular file but a FIFO"):
        scan([str(tmp_path / "ok.mp4")], str(tmp_path / "meta2.csv"), captions=str(tmp_path / "fifo.mp4"),
             progress=False)
