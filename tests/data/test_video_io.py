"""Round trips, reading frames by number, and failure modes of videodit.data.video."""

import os
import tracemalloc

import av
import numpy as np
import pytest

from clipgen import damage_outside, encode_h264, moving_frames, size_change_mp4
from videodit.data import video, video_write
from videodit.data.video import IMAGE_FPS, VideoReadError, probe_video, read_video
from videodit.data.video_write import write_video
from videodit.errors import UserError
from with_decoders import decoder  # noqa: F401 -- the fixture: tests taking it run with PyAV and torchcodec

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


def test_mp4_round_trip(tmp_path, decoder):
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

    monkeypatch.setattr(video_write, "_write_mp4", crash)
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
def test_unreadable_files_raise_video_read_error(tmp_path, name, content, reason, decoder):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    for reader in (read_video, probe_video):
        with pytest.raises(VideoReadError, match=reason) as info:
            reader(path)
        assert str(path) in str(info.value)


# --------------------------------------------------------------------------- reading frames by number


def _windows(total, rng, count=25):
    """Frame-number lists like the dataset asks for, plus unsorted and repeated ones."""
    picks = [[0], [total - 1], list(range(total - 4, total)), [total - 1] * 3 + [0], [7, 3, 3, 50 % total]]
    for _ in range(count):
        start, step = int(rng.integers(0, total)), int(rng.integers(1, 4))
        picks.append(np.minimum(start + step * np.arange(8), total - 1).tolist())
    return picks


@pytest.fixture(params=["packets kept", "seek"])
def window_path(request, monkeypatch):
    """Files up to a size are decoded from the packets read while indexing them; bigger
    ones are read again after a seek. Setting the limit to 0 makes every file 'big'."""
    if request.param == "seek":
        monkeypatch.setattr(video, "_KEEP_PACKET_BYTES", 0)
    return request.param


@pytest.mark.parametrize("keyint, pts", [
    (4, None),            # small GOP: many keyframes to start from
    (1000, None),         # one keyframe: decode from the start, stop after the window
    (10, "variable"),     # variable frame rate: frame numbers cannot come from time
])
def test_indices_give_exactly_the_frames_of_a_full_decode(tmp_path, keyint, pts, window_path, decoder):
    total = 120
    rng = np.random.default_rng(keyint)
    if pts == "variable":
        pts = np.cumsum(rng.integers(1, 4, total)).tolist()
    path = tmp_path / "clip.mp4"
    encode_h264(path, moving_frames(total, 32, 48), keyint=keyint, pts=pts)
    full, fps = read_video(path)
    assert len(full) == total
    for wanted in _windows(total, rng):
        got, got_fps = read_video(path, indices=wanted)
        np.testing.assert_array_equal(got, full[wanted], err_msg=f"indices {wanted}")
        assert got_fps == fps
    # A callable gets the frame count, as the dataset's sampler needs it.
    got, _ = read_video(path, indices=lambda n: [n - 1, 0])
    np.testing.assert_array_equal(got, full[[total - 1, 0]])


def test_scratch_reads_give_the_same_frames_in_one_reused_buffer(tmp_path):
    """PyAV's window reads (torchcodec's decode into tensors of their own)."""
    path = tmp_path / "clip.mp4"
    encode_h264(path, moving_frames(40, 32, 48), keyint=8)
    full, _ = read_video(path)
    first, _ = read_video(path, indices=[3, 4, 5], scratch=True)
    np.testing.assert_array_equal(first, full[[3, 4, 5]])
    second, _ = read_video(path, indices=[30, 31], scratch=True)
    np.testing.assert_array_equal(second, full[[30, 31]])
    assert np.shares_memory(first, second)    # no fresh pages per clip: the dataset copies out at once
    kept, _ = read_video(path, indices=[3, 4, 5])
    assert not np.shares_memory(kept, second)   # without scratch a read owns its frames


def test_a_window_decodes_only_from_the_keyframe_before_it_to_its_last_frame(tmp_path, window_path, decoder):
    pristine, damaged = tmp_path / "pristine.mp4", tmp_path / "damaged.mp4"
    encode_h264(pristine, moving_frames(64, 32, 48), keyint=8, bframes=0)
    damage_outside(pristine, damaged, keep=range(40, 45))   # keyframe 40 .. frame 44 intact
    with pytest.raises(VideoReadError, match="decoding failed"):
        read_video(damaged)
    # Frames 41..44 need packets 40..44 only (threaded=False: frame threads would read ahead).
    got, _ = read_video(damaged, indices=[41, 42, 44, 44], threaded=False)
    np.testing.assert_array_equal(got, read_video(pristine)[0][[41, 42, 44, 44]])


def test_a_window_holds_only_its_frames_in_memory(tmp_path):
    path = tmp_path / "clip.mp4"
    encode_h264(path, moving_frames(300, 64, 64), keyint=30)
    peaks = []
    for indices in (None, [200, 201, 202, 203]):
        tracemalloc.start()
        read_video(path, indices=indices)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    whole = 300 * 64 * 64 * 3
    assert peaks[0] >= whole and peaks[1] < whole / 20, peaks


def test_indices_on_images_and_gifs(tmp_path, decoder):
    frames = _blocks_clip(num_frames=6, height=16, width=16)
    write_video(tmp_path / "clip.gif", frames, fps=8)
    got, _ = read_video(tmp_path / "clip.gif", indices=[5, 0, 5])
    np.testing.assert_array_equal(got, frames[[5, 0, 5]])
    write_video(tmp_path / "still.png", frames[:1], fps=8)
    got, fps = read_video(tmp_path / "still.png", indices=[0, 0, 0])
    np.testing.assert_array_equal(got, frames[[0, 0, 0]])
    assert fps == IMAGE_FPS


def test_indices_past_the_end_raise_video_read_error(tmp_path, decoder):
    path = tmp_path / "clip.mp4"
    write_video(path, _blocks_clip(num_frames=8), fps=8)
    with pytest.raises(VideoReadError, match="frame 8 was asked for but the video has 8 frames"):
        read_video(path, indices=[0, 8])


def test_a_stream_that_changes_size_reads_at_its_first_size(tmp_path, decoder):
    green, red = (30, 200, 30), (200, 30, 30)
    path = tmp_path / "concatenated.mp4"
    size_change_mp4(path, np.full((6, 32, 48, 3), green, np.uint8), np.full((5, 48, 32, 3), red, np.uint8))
    frames, fps = read_video(path)   # np.stack of 48x32 and 32x48 frames used to raise ValueError
    assert frames.shape == (11, 32, 48, 3) and fps == pytest.approx(8.0)
    np.testing.assert_allclose(frames[:6].reshape(-1, 3).mean(axis=0), green, atol=4)
    np.testing.assert_allclose(frames[6:].reshape(-1, 3).mean(axis=0), red, atol=4)   # rescaled
    window, _ = read_video(path, indices=[9, 10])
    np.testing.assert_array_equal(window, frames[[9, 10]])


def test_indices_on_a_cut_file_follow_the_frames_that_decode(tmp_path, decoder):
    # Index (moov) at the front, then cut: more packets survive than frames decode, so
    # frame numbers must come from a full decode, as they always did.
    whole = tmp_path / "whole.mp4"
    with av.open(str(whole), "w", format="mp4", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for rgb in np.random.default_rng(0).integers(0, 256, (12, 32, 32, 3), dtype=np.uint8):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(stream.encode(None))
    data = whole.read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: len(data) * 2 // 3])
    full, _ = read_video(cut)
    assert 0 < len(full) < 12
    got, _ = read_video(cut, indices=lambda total: [total // 2])
    np.testing.assert_array_equal(got, full[[len(full) // 2]])
