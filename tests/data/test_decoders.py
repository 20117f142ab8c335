"""``data.decoder`` / ``data.decode_device``: the choice (runs everywhere, torchcodec's presence
faked), and torchcodec's frames against PyAV's (where torchcodec loads with FFmpeg's libraries)."""

from fractions import Fraction

import av
import numpy as np
import pytest

from clipgen import encode_h264, moving_frames, size_change_mp4
from conftest import tiny_overrides
from videodit.cli import main
from videodit.config import load_config
from videodit.data import decode_torchcodec, decoder_choice
from videodit.data.decoder_choice import DecoderChoice, resolve_decoder
from videodit.data import video
from videodit.data.video import FrameTooLarge, VideoReadError, read_video
from videodit.data.video_write import write_video
from videodit.errors import UserError
from with_decoders import needs_torchcodec

NOT_INSTALLED = "torchcodec is not installed"
NO_FFMPEG = "torchcodec finds no FFmpeg shared libraries (libavcodec, libavformat, ...: FFmpeg 4 to 8)"


@pytest.fixture
def torchcodec_is(monkeypatch):
    """``torchcodec_is(None)``: it loads; ``torchcodec_is("why")``: it does not, for that reason."""
    def fake(problem):
        monkeypatch.setattr(decoder_choice, "torchcodec_problem", lambda: problem)
    return fake


# --------------------------------------------------------------------------- the choice


def test_auto_takes_torchcodec_where_it_loads_else_pyav_with_one_line_at_most(torchcodec_is):
    lines = []
    torchcodec_is(None)
    assert resolve_decoder("auto", "cpu", notice=lines.append) == DecoderChoice("torchcodec", "cpu")
    assert resolve_decoder("pyav", "cpu", notice=lines.append) == DecoderChoice("pyav", "cpu")
    torchcodec_is(NOT_INSTALLED)   # the usual case without the extra: nothing to say
    assert resolve_decoder("auto", "cpu", notice=lines.append) == DecoderChoice("pyav", "cpu")
    assert lines == []
    torchcodec_is(NO_FFMPEG)       # installed but unusable: said once, in one line
    assert resolve_decoder("auto", "cpu", notice=lines.append) == DecoderChoice("pyav", "cpu")
    assert lines == [f"data.decoder=auto: decoding with PyAV ({NO_FFMPEG})"]


@pytest.mark.parametrize("problem", [NOT_INSTALLED, NO_FFMPEG])
def test_torchcodec_asked_for_but_missing_is_one_line_naming_what_to_install(torchcodec_is, problem):
    torchcodec_is(problem)
    with pytest.raises(UserError) as info:
        resolve_decoder("torchcodec", "cpu")
    message = str(info.value)
    assert message.startswith(f"data.decoder=torchcodec: {problem}; pip install 'videodit[torchcodec]'")
    assert "apt-get install ffmpeg" in message and message.endswith("or set data.decoder=pyav")
    assert "\n" not in message


def test_decoding_on_cuda_needs_torchcodec_and_a_gpu(torchcodec_is):
    torchcodec_is(None)
    with pytest.raises(UserError, match=r"^data.decode_device=cuda decodes with torchcodec \(NVDEC\) and "
                                        r"data.decoder=pyav decodes on the CPU only; set data.decoder=torchcodec"):
        resolve_decoder("pyav", "cuda", cuda_available=True)
    with pytest.raises(UserError, match=r"^data.decode_device=cuda needs a GPU and none is visible; set "
                                        r"data.decode_device=cpu$"):
        resolve_decoder("torchcodec", "cuda", cuda_available=False)
    assert resolve_decoder("auto", "cuda", cuda_available=True) == DecoderChoice("torchcodec", "cuda")
    torchcodec_is(NOT_INSTALLED)   # auto may fall back to PyAV on the CPU, never from a GPU asked for
    with pytest.raises(UserError, match=r"^data.decode_device=cuda: torchcodec is not installed; pip install "
                                        r".*or set data.decode_device=cpu$"):
        resolve_decoder("auto", "cuda", cuda_available=True)


def test_the_config_takes_only_known_decoders_and_devices():
    cfg = load_config("tiny", ["data.decoder=torchcodec", "data.decode_device=cuda"])
    assert (cfg.data.decoder, cfg.data.decode_device) == ("torchcodec", "cuda")
    assert (load_config("tiny").data.decoder, load_config("tiny").data.decode_device) == ("auto", "cpu")
    for bad in ("data.decoder=ffmpeg", "data.decode_device=gpu"):
        with pytest.raises(UserError, match="data.decode"):
            load_config("tiny", [bad])


@pytest.mark.parametrize("command", ["cache build", "train"])
def test_a_run_with_an_unusable_decoder_stops_in_one_line_before_touching_out(toy_dir, tmp_path, capsys,
                                                                              torchcodec_is, command):
    torchcodec_is(NO_FFMPEG)
    out = tmp_path / "c"
    argv = [*command.split(), "tiny", *tiny_overrides(toy_dir, **{"data.decoder": "torchcodec"}), "--out", str(out)]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: data.decoder=torchcodec: {NO_FFMPEG}; {decoder_choice.INSTALL_TORCHCODEC}, or set " \
                  "data.decoder=pyav"
    assert not out.exists()


def test_loader_workers_get_the_decoder_and_nvdec_workers_are_spawned():
    choice = DecoderChoice("torchcodec", "cuda")
    spawned = decoder_choice.decoding_workers(choice, num_workers=2)
    assert spawned["multiprocessing_context"] == "spawn"
    before = decoder_choice.current_decoder()
    try:
        spawned["worker_init_fn"](0)   # what a fresh worker runs first
        assert decoder_choice.current_decoder() == choice
    finally:
        decoder_choice.use_decoder(before)
    forked = decoder_choice.decoding_workers(DecoderChoice("torchcodec", "cpu"), num_workers=2)
    assert forked["multiprocessing_context"] is None   # a forked worker inherits the choice


def test_read_video_asks_the_chosen_decoder_and_reads_with_pyav_what_it_leaves(tmp_path, monkeypatch):
    path = tmp_path / "clip.mp4"
    write_video(path, moving_frames(8, 32, 48), fps=8)
    pyav, _ = read_video(path, indices=[2, 5])
    calls = []

    def leave_it(path, resolve, **rules):
        calls.append(rules)
        # What PyAV's reader decides is handed over: the frame numbers, the bound, the shrink.
        assert resolve(8).tolist() == [2, 5]
        with pytest.raises(VideoReadError, match="frame 5 was asked for but the video has 5 frames"):
            resolve(5)
        with pytest.raises(FrameTooLarge, match="its frames are 96x64 .* more than data.max_pixels=5000"):
            rules["check_size"](96, 64)
        assert rules["shrinks"](960, 640) and not rules["shrinks"](48, 32)
        return None

    monkeypatch.setattr(decode_torchcodec, "read_window", leave_it)
    monkeypatch.setattr(decoder_choice, "_current", DecoderChoice("torchcodec", "cpu"))
    got, _ = read_video(path, indices=[2, 5], threaded=False, max_pixels=5000, fit=(16, 24))
    assert len(calls) == 1 and calls[0]["codecs"] == video._TABLE_CODECS
    assert (calls[0]["threaded"], calls[0]["device"]) == (False, "cpu")
    np.testing.assert_array_equal(got, pyav)
    write_video(tmp_path / "still.png", moving_frames(1, 32, 48), fps=8)
    read_video(tmp_path / "still.png")   # images are Pillow's whatever the decoder
    assert len(calls) == 1


# --------------------------------------------------------------------------- the same frames


def encode(path, frames, codec, *, keyint=12, rate=24, options=None):
    """``frames`` encoded with PyAV's ``codec`` encoder (each clip a constant frame rate)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        stream.codec_context.time_base = Fraction(1, rate)
        stream.gop_size = keyint
        stream.options = options or {}
        for t, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts, frame.time_base = t, Fraction(1, rate)
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


CODECS = {   # name: (PyAV encoder, file, encoder options)
    "h264": ("libx264", "clip.mp4", {"x264-params": "keyint=12:min-keyint=12:scenecut=0:bframes=3"}),
    "hevc": ("libx265", "clip.mp4", {"x265-params": "keyint=12:min-keyint=12:scenecut=0:bframes=3:log-level=none"}),
    "vp9": ("libvpx-vp9", "clip.webm", {"lag-in-frames": "0"}),
    "av1": ("libsvtav1", "clip.mp4", {"svtav1-params": "keyint=12"}),
    "mpeg4": ("mpeg4", "clip.mp4", {"bf": "2"}),
    "mjpeg": ("mjpeg", "clip.avi", {}),
}


def windows(total, rng):
    picks = [[0], [total - 1], [total - 1, 0, 0], list(range(total))]
    for _ in range(6):
        start = int(rng.integers(0, total))
        picks.append(np.minimum(start + 2 * np.arange(5), total - 1).tolist())
    return picks


def pyav_and_torchcodec(monkeypatch, path, **kwargs):
    """``read_video(path, **kwargs)`` with PyAV, then with torchcodec."""
    monkeypatch.setattr(decoder_choice, "_current", DecoderChoice("pyav"))
    want = read_video(path, **kwargs)
    monkeypatch.setattr(decoder_choice, "_current", DecoderChoice("torchcodec"))
    return want, read_video(path, **kwargs)


@needs_torchcodec
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_torchcodec_gives_pyavs_frames_bit_for_bit(tmp_path, monkeypatch, codec):
    encoder, name, options = CODECS[codec]
    try:
        av.codec.Codec(encoder, "w")
    except Exception:   # noqa: BLE001 -- this PyAV build lacks the encoder
        pytest.skip(f"PyAV here has no {encoder} encoder to make a {codec} clip")
    path = tmp_path / name
    encode(path, moving_frames(40, 48, 64), encoder, options=options)
    decode_torchcodec.READS.clear()
    rng = np.random.default_rng(0)
    for wanted in [None, *windows(40, rng)]:
        (want, want_fps), (got, got_fps) = pyav_and_torchcodec(monkeypatch, path, indices=wanted, threaded=False)
        np.testing.assert_array_equal(got, want, err_msg=f"{codec}: indices {wanted}")
        assert got_fps == want_fps == 24.0
    assert decode_torchcodec.READS == {"torchcodec": 11}   # torchcodec read them all, PyAV none


@needs_torchcodec
def test_torchcodec_gives_pyavs_frames_of_a_real_size_clip(tmp_path, monkeypatch):
    path = tmp_path / "832x480.mp4"
    encode_h264(path, moving_frames(24, 480, 832), keyint=8, rate=16)
    decode_torchcodec.READS.clear()
    for wanted in ([3, 4, 5, 6], [23, 0], None):
        for threaded in (False, True):
            (want, _), (got, _) = pyav_and_torchcodec(monkeypatch, path, indices=wanted, threaded=threaded)
            np.testing.assert_array_equal(got, want)
    assert decode_torchcodec.READS == {"torchcodec": 6}


@needs_torchcodec
def test_what_torchcodec_cannot_read_exactly_is_read_by_pyav(tmp_path, monkeypatch):
    size_change_mp4(tmp_path / "joined.mp4", moving_frames(4, 32, 48), moving_frames(4, 48, 32, seed=1))
    write_video(tmp_path / "anim.gif", moving_frames(6, 16, 16), fps=8)
    encode_h264(tmp_path / "big.mp4", moving_frames(4, 640, 960), keyint=4)
    with av.open(str(tmp_path / "whole.mp4"), "w", format="mp4", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("libx264", rate=8)   # the index first, so that the cut file opens
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for rgb in np.random.default_rng(0).integers(0, 256, (12, 32, 32, 3), dtype=np.uint8):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(stream.encode(None))
    data = (tmp_path / "whole.mp4").read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[: len(data) * 2 // 3])
    cases = {"joined.mp4": ({}, "pyav: decoding failed"), "anim.gif": ({}, "pyav: codec gif"),
             "big.mp4": ({"fit": (16, 24)}, "pyav: frames to shrink"),
             "cut.mp4": ({}, "pyav: frame count of header and packets differ")}
    for name, (kwargs, path_taken) in cases.items():
        decode_torchcodec.READS.clear()
        (want, _), (got, _) = pyav_and_torchcodec(monkeypatch, tmp_path / name, **kwargs)
        np.testing.assert_array_equal(got, want)
        assert decode_torchcodec.READS == {path_taken: 1}, name


@needs_torchcodec
def test_a_cache_built_with_torchcodec_is_the_cache_built_with_pyav(toy_dir, tmp_path):
    def build(decoder):
        out = tmp_path / decoder
        assert main(["cache", "build", "tiny", *tiny_overrides(toy_dir, **{"data.decoder": decoder}),
                     "--out", str(out), "--shard-size", "16"]) == 0
        return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}

    decode_torchcodec.READS.clear()
    with_torchcodec = build("torchcodec")
    assert decode_torchcodec.READS["torchcodec"] == 54   # every toy clip
    assert with_torchcodec == build("pyav")
