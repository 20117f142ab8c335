"""Round trips and failure modes of videodit.data.video."""

import os

import av
import numpy as np
import pytest

from videodit.data import video
from videodit.data.video import (IMAGE_FPS, VideoReadError, probe_video, read_video,
                                 write_video)
from videodit.errors import UserError

COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (255, 255, 255)]


def _blocks_clip(num_frames=8, height=32, width=48):
    """Moving 8x8 colour blocks on black; blocks sit on the 2x2 chroma grid."""
    frames = np.zeros((num_frames, height, width, 3), np.uint8)
    for t in range(num_frames):
        for i, colour in enumerate(COLOURS[:4]):
            top, left = 2 + 14 * (i // 2), 2 + 2 * t + 20 * (i % 2)
            frames[t, top:top + 8, left:left + 8] = colour
    return frames


def _block_interiors(frames):
    """Mean colour of each block's 4x4 interior in frame 0 (away from chroma edges)."""
    return [frames[0, 4 + 14 * (i // 2):8 + 14 * (i // 2), 4 + 20 * (i % 2):8 + 20 * (i % 2)]
            .reshape(-1, 3).mean(axis=0) for i in range(4)]


def _listdir(path):
    return sorted(os.listdir(path))


# --------------------------------------------------------------------------- round trips


def test_mp4_round_trip(tmp_path):
    frames = _blocks_clip()
    path = tmp_path / "clip.mp4"
    write_video(path, frames, fps=8)

    decoded, fps = read_video(path)
    assert decoded.shape == frames.shape and decoded.dtype == np.uint8
    assert fps == pytest.approx(8.0)
    for got, want in zip(_block_interiors(decoded), COLOURS):
        np.testing.assert_allclose(got, want, atol=6)
    assert np.abs(decoded.astype(int) - frames).mean() < 4
    assert _listdir(tmp_path) == ["clip.mp4"]  # no temporary files left behind


def test_gif_round_trip_is_exact_and_keeps_repeated_frames(tmp_path):
    frames = _blocks_clip(num_frames=6, height=31, width=33)  # odd sizes are fine for GIF
    frames[3:] = frames[2]  # identical frames must not be merged away
    path = tmp_path / "clip.gif"
    write_video(path, frames, fps=8)

    decoded, fps = read_video(path)
    assert decoded.shape == frames.shape
    np.testing.assert_array_equal(decoded, frames)
    assert fps == pytest.approx(8.0, rel=0.05)


def test_png_round_trip(tmp_path):
    frame = _blocks_clip(num_frames=1, height=31, width=33)
    path = tmp_path / "still.png"
    write_video(path, frame, fps=8)
    decoded, fps = read_video(path)
    np.testing.assert_array_equal(decoded, frame)
    assert fps == IMAGE_FPS
    assert probe_video(path) == {"num_frames": 1, "height": 31, "width": 33, "fps": IMAGE_FPS}


def test_probe_mp4_and_gif(tmp_path):
    frames = _blocks_clip(num_frames=10)
    for name in ("a.mp4", "a.gif"):
        write_video(tmp_path / name, frames, fps=12)
        info = probe_video(tmp_path / name)
        assert info["num_frames"] == 10
        assert (info["height"], info["width"]) == (32, 48)
        assert info["fps"] == pytest.approx(12.0, rel=0.05)


def test_probe_counts_frames_when_container_does_not(tmp_path):
    # Matroska does not store a frame count, so probe_video has to decode.
    path = tmp_path / "clip.mkv"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for frame in _blocks_clip(num_frames=5, width=32):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 0
    assert probe_video(path)["num_frames"] == 5


# --------------------------------------------------------------------------- write errors


def test_write_rejects_bad_suffix_odd_h264_and_multi_frame_png(tmp_path):
    frames = _blocks_clip()
    with pytest.raises(UserError, match=r"\.avi"):
        write_video(tmp_path / "clip.avi", frames, fps=8)
    with pytest.raises(UserError, match="even"):
        write_video(tmp_path / "clip.mp4", frames[:, :31], fps=8)
    with pytest.raises(UserError, match="one frame"):
        write_video(tmp_path / "clip.png", frames, fps=8)
    with pytest.raises(UserError, match="fps"):
        write_video(tmp_path / "clip.mp4", frames, fps=0)
    assert _listdir(tmp_path) == []


def test_crash_mid_write_keeps_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "clip.mp4"
    write_video(path, _blocks_clip(), fps=8)
    original = path.read_bytes()

    def crash(tmp, frames, rate):
        tmp.write_bytes(b"half a video")
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(video, "_write_mp4", crash)
    with pytest.raises(RuntimeError):
        write_video(path, np.zeros_like(_blocks_clip()), fps=8)
    assert path.read_bytes() == original
    assert _listdir(tmp_path) == ["clip.mp4"]


# --------------------------------------------------------------------------- read errors


@pytest.mark.parametrize("name, content, reason", [
    ("missing.mp4", None, "no such file"),
    ("empty.mp4", b"", "empty"),
    ("text.mp4", b"this is not a video\n" * 20, "not a readable video"),
    ("empty.png", b"", "empty"),
    ("text.png", b"not an image either\n", "not a readable image"),
])
def test_unreadable_files_raise_video_read_error(tmp_path, name, content, reason):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    for reader in (read_video, probe_video):
        with pytest.raises(VideoReadError, match=reason) as info:
            reader(path)
        assert str(path) in str(info.value)
