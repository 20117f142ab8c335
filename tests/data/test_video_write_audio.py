"""mp4 files with a soundtrack: write_video(..., audio=(waveform, sample_rate))."""

import os

import av
import numpy as np
import pytest

from videodit.data import video_write
from videodit.data.video import read_video
from videodit.data.video_write import audio_codec, write_video
from videodit.errors import UserError

FPS = 8
RATE = 16_000


def _clip(num_frames=16, height=32, width=32):
    frames = np.zeros((num_frames, height, width, 3), np.uint8)
    for t in range(num_frames):
        frames[t, 8:16, 2 + t:10 + t] = (255, 0, 0)
    return frames


def _tone(hz, seconds, rate=RATE, channels=2):
    t = np.arange(round(seconds * rate)) / rate
    return np.stack([0.3 * np.sin(2 * np.pi * hz * t)] * channels).astype(np.float32)


def _read_audio(path):
    """(decoded waveform [channels, samples], rate, stream duration s, frame size, video duration s)."""
    with av.open(str(path)) as container:
        (stream,) = container.streams.audio
        video = container.streams.video[0]
        chunks = []
        for frame in container.decode(stream):
            samples = frame.to_ndarray()
            if not frame.format.is_planar:   # packed (Opus): [1, samples * channels]
                samples = samples.reshape(-1, len(frame.layout.channels)).T
            chunks.append(samples)
        return (np.concatenate(chunks, axis=1), stream.rate, float(stream.duration * stream.time_base),
                stream.codec_context.frame_size or 1024, float(video.duration * video.time_base))


def _peak_hz(waveform, rate):
    mono = waveform.mean(axis=0)
    spectrum = np.abs(np.fft.rfft(mono * np.hanning(len(mono))))
    return np.fft.rfftfreq(len(mono), 1 / rate)[np.argmax(spectrum)]


def _packets(path, kind):
    with av.open(str(path)) as container:
        stream = getattr(container.streams, kind)[0]
        return [bytes(p) for p in container.demux(stream) if p.size]


@pytest.mark.parametrize("seconds", [2.0, 3.1, 0.5])   # exact, trimmed, padded with silence
def test_soundtrack_reads_back_with_the_videos_duration_and_its_pitch(tmp_path, seconds):
    path = tmp_path / "clip.mp4"
    frames = _clip()
    write_video(path, frames, FPS, audio=(_tone(440.0, seconds), RATE))

    waveform, rate, stream_seconds, frame_size, video_seconds = _read_audio(path)
    assert video_seconds == len(frames) / FPS
    one_frame = frame_size / rate
    assert abs(stream_seconds - video_seconds) <= one_frame
    assert abs(waveform.shape[1] / rate - video_seconds) <= one_frame
    assert waveform.shape[0] == 2
    heard = waveform[:, : round(min(seconds, video_seconds) * rate)]
    assert abs(_peak_hz(heard, rate) - 440.0) <= 2.0
    if seconds < video_seconds:   # the padding is silence
        tail = waveform[:, round((seconds + one_frame) * rate): round(video_seconds * rate)]
        assert np.abs(tail).max() < 0.01
    got, fps = read_video(path)   # the picture reads as before
    assert fps == FPS and got.shape == frames.shape


def test_mono_and_a_rate_the_encoder_lacks_are_resampled(tmp_path):
    path = tmp_path / "clip.mp4"
    write_video(path, _clip(), FPS, audio=(_tone(660.0, 2.0, rate=22_000, channels=1), 22_000))
    waveform, rate, stream_seconds, frame_size, video_seconds = _read_audio(path)
    assert waveform.shape[0] == 1
    assert abs(stream_seconds - video_seconds) <= frame_size / rate
    assert abs(_peak_hz(waveform[:, : 2 * rate], rate) - 660.0) <= 2.0


def test_opus_when_aac_is_missing(tmp_path, monkeypatch):
    try:
        av.codec.Codec("libopus", "w")
    except Exception:
        pytest.skip("this PyAV build has no libopus encoder")
    monkeypatch.setattr(video_write, "audio_codec", lambda: "libopus")
    path = tmp_path / "clip.mp4"
    write_video(path, _clip(), FPS, audio=(_tone(523.25, 2.0), RATE))
    with av.open(str(path)) as container:
        assert container.streams.audio[0].codec_context.name == "opus"
    waveform, rate, stream_seconds, frame_size, video_seconds = _read_audio(path)
    assert abs(stream_seconds - video_seconds) <= frame_size / rate
    assert abs(_peak_hz(waveform, rate) - 523.25) <= 2.0


def test_aac_is_the_codec_here():
    assert audio_codec() in ("aac", "libopus")


def test_no_audio_writes_are_unchanged(tmp_path):
    frames = _clip()
    plain, explicit, sound = tmp_path / "plain.mp4", tmp_path / "none.mp4", tmp_path / "sound.mp4"
    write_video(plain, frames, FPS)
    write_video(explicit, frames, FPS, audio=None)
    write_video(sound, frames, FPS, audio=(_tone(440.0, 2.0), RATE))
    assert plain.read_bytes() == explicit.read_bytes()
    with av.open(str(plain)) as container:
        assert [s.type for s in container.streams] == ["video"]
    # The soundtrack leaves the picture alone: the same H.264 packets, the same frames.
    assert _packets(sound, "video") == _packets(plain, "video")
    np.testing.assert_array_equal(read_video(sound)[0], read_video(plain)[0])
    # And a soundtrack is as reproducible as the picture.
    again = tmp_path / "again.mp4"
    write_video(again, frames, FPS, audio=(_tone(440.0, 2.0), RATE))
    assert again.read_bytes() == sound.read_bytes()


@pytest.mark.parametrize("name", ["clip.gif", "frame.png"])
def test_gif_and_images_refuse_a_soundtrack(tmp_path, name):
    frames = _clip(num_frames=1 if name.endswith(".png") else 4)
    with pytest.raises(UserError, match=r"cannot hold a soundtrack; write \.mp4") as err:
        write_video(tmp_path / name, frames, FPS, audio=(_tone(440.0, 0.5), RATE))
    assert "\n" not in str(err.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("audio, match", [
    ((np.zeros((3, 100), np.float32), RATE), "1 or 2 channels"),
    ((np.zeros((2, 100), np.int16), RATE), "must be float"),
    ((np.full((2, 100), np.nan, np.float32), RATE), "NaN or infinite"),
    ((np.zeros((2, 100), np.float32), 0), "sample_rate=0"),
    ((np.zeros((2, 100), np.float32), 16000.5), "whole number"),
    (np.zeros((2, 100), np.float32), "must be a pair"),
])
def test_bad_soundtracks_are_refused_in_one_line_and_nothing_is_written(tmp_path, audio, match):
    with pytest.raises(UserError, match=match) as err:
        write_video(tmp_path / "clip.mp4", _clip(), FPS, audio=audio)
    assert "\n" not in str(err.value)
    assert os.listdir(tmp_path) == []


def test_loud_samples_are_clipped_not_refused(tmp_path):
    path = tmp_path / "clip.mp4"
    write_video(path, _clip(), FPS, audio=(3.0 * _tone(440.0, 2.0), RATE))
    waveform = _read_audio(path)[0]
    assert np.abs(waveform).max() < 1.3   # clipped to [-1, 1] before encoding (AAC overshoots a little)


def test_crash_while_muxing_audio_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "clip.mp4"
    write_video(path, _clip(), FPS)
    original = path.read_bytes()

    def crash(container, stream, audio):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(video_write, "_mux_audio", crash)
    with pytest.raises(RuntimeError):
        write_video(path, _clip(), FPS, audio=(_tone(440.0, 2.0), RATE))
    assert path.read_bytes() == original
    assert os.listdir(tmp_path) == ["clip.mp4"]


def test_a_build_without_aac_or_opus_is_named_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(video_write, "_AUDIO_CODECS", ("no-such-encoder",))
    video_write.audio_codec.cache_clear()
    try:
        with pytest.raises(UserError, match="no AAC or Opus encoder") as err:
            write_video(tmp_path / "clip.mp4", _clip(), FPS, audio=(_tone(440.0, 2.0), RATE))
    finally:
        video_write.audio_codec.cache_clear()
    assert "\n" not in str(err.value)
    assert os.listdir(tmp_path) == []
