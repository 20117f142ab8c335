"""Soundtracks (data/audio.py): LTX-2's log-mel against Lightricks' own code (tests/fixtures/ltx2_audio,
scripts/make_ltx2_audio_fixtures.py), the exact window under a sample's frames, stereo and 16 kHz from
any source, silence with a False mask for a clip without one, and every bad soundtrack a counted skip or
one line, never a hang or a full decode."""

import json
import os
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from clipgen import damage_audio, encode_h264, encode_with_audio, moving_frames, tone_burst
from tolerance import assert_close
from videodit.config import DataConfig, load_config
from videodit.data.audio import (AudioReadError, AudioSpec, clip_audio, frame_window, log_mel, probe_audio,
                                 resample, to_stereo)
from videodit.data.buckets.plan import BucketPlan
from videodit.data.dataset import VideoDataset, collate
from videodit.data.metadata import read_metadata
from videodit.data.scan import scan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ltx2_audio"
WAVE = AudioSpec(output="waveform")


def _full_decode(path) -> tuple[np.ndarray, int]:
    """Every sample of the first audio stream, float32 [channels, samples], decoded from the start."""
    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        packed = av.AudioResampler(format="flt", layout=stream.layout, rate=stream.rate)
        parts = [p.to_ndarray().reshape(-1, stream.layout.nb_channels) for f in container.decode(stream)
                 for p in packed.resample(f)]
        return np.concatenate(parts).T.copy(), stream.rate


# --------------------------------------------------------------------------- LTX-2's preprocessing


@pytest.mark.parametrize("case", json.loads((FIXTURES / "cases.json").read_text())["cases"])
def test_log_mel_equals_ltx2s_own_preprocessing(case):
    # Measured 1.0e-6 to 1.6e-6 of the output's range (the mel filters: ours float64, theirs float32);
    # the resampled waveform is theirs bit for bit (0). LTX's own downmix runs for the multichannel cases.
    tensors, info = load_file(str(FIXTURES / "tensors.safetensors")), json.loads((FIXTURES / "cases.json").read_text())
    rate = info["cases"][case]["rate"]
    wave = tensors[f"{case}.input"].numpy().astype(np.float32) / 32768
    mel = AudioSpec().encode(wave, rate)
    assert mel.shape == (2, 1 + -(-wave.shape[1] * 16000 // rate) // 160, 64) == tensors[f"{case}.mel"].shape
    assert_close(mel, tensors[f"{case}.mel"], 1e-5, f"log-mel {case}")
    if f"{case}.resampled" in tensors:
        assert_close(resample(to_stereo(torch.from_numpy(wave)), rate), tensors[f"{case}.resampled"], 1e-6,
                     f"resampled {case}")


def test_silence_is_the_log_mel_of_zeros_and_short_windows_work():
    for samples in (0, 100, 513, 3200):
        assert torch.equal(AudioSpec().silence(samples), log_mel(torch.zeros(2, samples)))
    assert AudioSpec().silence(3200).shape == (2, 21, 64) and WAVE.silence(3200).shape == (2, 3200)
    assert log_mel(torch.randn(2, 200)).shape == (2, 2, 64)   # under half an FFT: LTX's own code fails here


@pytest.mark.parametrize("rate", [44100, 48000, 22050])
def test_resampling_to_16khz_keeps_a_tone(rate):
    t = np.arange(rate // 2) / rate
    tone = torch.from_numpy(np.stack([np.sin(2 * np.pi * 1000 * t)] * 2).astype(np.float32))
    out = resample(tone, rate)
    assert out.shape == (2, -(-len(t) * 16000 // rate))
    want = np.sin(2 * np.pi * 1000 * np.arange(out.shape[1]) / 16000)
    assert np.abs(out[:, 200:-200].numpy() - want[200:-200]).max() < 2e-3   # away from the edges' zero padding


def test_mono_is_duplicated_and_surround_downmixed_as_ltx_does():
    ones = torch.eye(8)[:, None, :].expand(8, 1, 8).reshape(8, 8)   # channel c: 1 at sample c only
    left, right = to_stereo(ones)
    assert torch.allclose(left[[0, 2, 4, 6]], torch.tensor([1, 0.707, 0.707, 0.707]) / 3.121)
    assert left[[1, 3, 5, 7]].abs().max() == 0 and torch.allclose(right[[1, 2, 5, 7]], left[[0, 2, 4, 6]])
    assert torch.equal(to_stereo(torch.arange(5.0)[None]), torch.arange(5.0).repeat(2, 1))
    assert torch.equal(to_stereo(torch.ones(3, 4) * torch.tensor([[1.0], [2.0], [6.0]])), torch.full((2, 4), 3.0))


# --------------------------------------------------------------------------- the window


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """Files with a 50 ms 1 kHz burst at 1.0 s under 48 frames at 24 fps."""
    folder = tmp_path_factory.mktemp("audio_clips")
    frames = moving_frames(48, 16, 16)
    encode_with_audio(folder / "pcm48k.mp4", frames, tone_burst(2.0, 48000, 2, 1.0, 0.05), sample_rate=48000,
                      codec="pcm_s16le")
    encode_with_audio(folder / "aac44k.mp4", frames, tone_burst(2.0, 44100, 2, 1.0, 0.05))
    encode_with_audio(folder / "mono.mp4", frames, tone_burst(2.0, 48000, 1, 1.0, 0.05), sample_rate=48000,
                      layout="mono")
    encode_with_audio(folder / "silent_film.mp4", frames, None)
    encode_with_audio(folder / "surround71.mp4", frames, tone_burst(2.0, 48000, 8, 1.0, 0.05), sample_rate=48000,
                      layout="7.1", codec="flac")
    encode_with_audio(folder / "hires.mp4", frames, tone_burst(0.5, 192000, 2, 0.2, 0.05), sample_rate=192000,
                      codec="pcm_s16le")
    encode_with_audio(folder / "odd_rate.mp4", frames, tone_burst(0.5, 47999, 2, 0.2, 0.05), sample_rate=47999,
                      codec="pcm_s16le")
    damage_audio(folder / "aac44k.mp4", folder / "damaged.mp4")
    return folder


def test_the_window_is_the_frames_time_span_exactly(clips):
    # Frames 20..31 at 24 fps: [20/24 s, 32/24 s); 48 kHz PCM decodes exactly, so the window is the full
    # decode's samples 40000..63999, and the burst (48000..50399) sits at 8000..10399 of it.
    full, rate = _full_decode(clips / "pcm48k.mp4")
    with av.open(str(clips / "pcm48k.mp4")) as container:
        assert frame_window(clips / "pcm48k.mp4", container, container.streams.video[0], 20, 31) == \
            (Fraction(20, 24), Fraction(32, 24))
    got = clip_audio(clips / "pcm48k.mp4", list(range(20, 32)), WAVE)
    assert got.present and torch.equal(got.audio, resample(torch.from_numpy(full[:, 40000:64000]), rate))
    loud = np.flatnonzero(np.abs(full[0, 40000:64000]) > 0.05)
    assert 8000 <= loud[0] <= 8004 and 10395 <= loud[-1] < 10400
    loud16 = np.flatnonzero(got.audio[0].abs().numpy() > 0.05)   # the same at 16 kHz: 2667 .. 3466
    assert abs(int(loud16[0]) - 2667) <= 2 and abs(int(loud16[-1]) - 3466) <= 2


@pytest.mark.parametrize("first", [0, 5, 23, 30, 40])
def test_a_seeked_aac_window_equals_the_full_decode(clips, first):
    full, rate = _full_decode(clips / "aac44k.mp4")
    picked = list(range(first, min(first + 8, 48)))
    start, count = -(-first * rate // 24), (len(picked) * rate) // 24
    got = clip_audio(clips / "aac44k.mp4", picked, WAVE)
    want = np.zeros((2, count), np.float32)
    have = full[:, start : start + count]
    want[:, : have.shape[1]] = have   # AAC's last frame is padded: the window may run past the stream
    assert torch.equal(got.audio, resample(torch.from_numpy(want), rate))


def test_frame_times_come_from_timestamps_with_b_frames_and_variable_rate(tmp_path):
    pts = np.cumsum(np.random.default_rng(0).integers(1, 4, 30)).tolist()
    encode_h264(tmp_path / "vfr.mp4", moving_frames(30, 16, 16), keyint=6, bframes=2, pts=pts)
    with av.open(str(tmp_path / "vfr.mp4")) as container:
        stream = container.streams.video[0]
        shown = sorted(frame.pts for frame in container.decode(stream))
        base = stream.time_base
    for first, last in [(0, 4), (7, 19), (20, 29)]:
        with av.open(str(tmp_path / "vfr.mp4")) as container:
            start, end = frame_window(tmp_path / "vfr.mp4", container, container.streams.video[0], first, last)
        assert start == shown[first] * base
        assert end == (shown[last + 1] * base if last + 1 < len(shown) else shown[last] * base + Fraction(1, 24))


def test_mono_and_surround_become_stereo(clips):
    mono = clip_audio(clips / "mono.mp4", list(range(20, 32)), WAVE)
    assert mono.audio.shape[0] == 2 and torch.equal(mono.audio[0], mono.audio[1]) and mono.audio.abs().max() > 0.4
    full, rate = _full_decode(clips / "surround71.mp4")
    got = clip_audio(clips / "surround71.mp4", list(range(20, 32)), WAVE)
    assert torch.equal(got.audio, resample(to_stereo(torch.from_numpy(full[:, 40000:64000])), rate))


def test_a_clip_without_a_soundtrack_is_silence_with_a_false_mask(clips):
    for spec in (AudioSpec(), WAVE):
        got = clip_audio(clips / "silent_film.mp4", list(range(20, 32)), spec)
        assert not got.present and torch.equal(got.audio, spec.silence(8000))
    # The metadata saying so is trusted: the soundtrack is not read.
    got = clip_audio(clips / "pcm48k.mp4", list(range(20, 32)), WAVE, known={"has_audio": False}, fps=24.0)
    assert not got.present and torch.equal(got.audio, WAVE.silence(8000))


# --------------------------------------------------------------------------- bad soundtracks


@pytest.mark.parametrize("name, spec, reason", [
    ("damaged.mp4", AudioSpec(), "does not decode"),
    ("surround71.mp4", AudioSpec(max_channels=6), "8 channels, more than data.max_audio_channels=6"),
    ("hires.mp4", AudioSpec(), "192000 Hz, more than data.max_audio_sample_rate=96000"),
    ("pcm48k.mp4", AudioSpec(max_seconds=0.25), "0.5 s of audio, more than data.max_audio_seconds=0.25"),
    ("odd_rate.mp4", AudioSpec(), "47999 Hz has no small ratio to 16000 Hz"),
    ("fifo.mp4", AudioSpec(), "not a regular file but a FIFO"),
])
def test_a_bad_soundtrack_fails_in_one_line(clips, name, spec, reason):
    if name == "fifo.mp4" and not (clips / name).exists():
        os.mkfifo(clips / name)
    with pytest.raises(AudioReadError) as caught:
        clip_audio(clips / name, list(range(12)), spec)
    assert reason in caught.value.reason and "\n" not in str(caught.value)
    if name == "fifo.mp4":
        with pytest.raises(AudioReadError, match="FIFO"):
            probe_audio(clips / name)


def test_the_metadata_refuses_a_soundtrack_beyond_the_bounds_before_opening_it(tmp_path):
    missing = tmp_path / "never_opened.mp4"
    with pytest.raises(AudioReadError, match="192000 Hz by the metadata"):
        clip_audio(missing, [0, 1], AudioSpec(), known={"audio_sample_rate": 192000})


def test_a_window_deep_in_an_hours_long_soundtrack_decodes_only_the_window(tmp_path):
    # Three hours between two 1 s parts (sparse packets): reading the late window seeks, it never decodes
    # (or holds) what lies before it.
    rate, hours, wave = 16000, 3 * 3600, tone_burst(1.0, 16000, 2, 0.5, 0.05)
    with av.open(str(tmp_path / "long.mp4"), "w", format="mp4") as container:
        video = container.add_stream("libx264", rate=8)
        video.width = video.height = 16
        video.pix_fmt, video.options = "yuv420p", {"x264-params": "bframes=0"}
        audio = container.add_stream("aac", rate=rate, layout="stereo")
        for part, offset in enumerate((0, hours)):
            for t, rgb in enumerate(moving_frames(8, 16, 16, seed=part)):
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
                frame.pts, frame.time_base = offset * 8 + t, Fraction(1, 8)
                container.mux(video.encode(frame))
        container.mux(video.encode(None))
        for offset in (0, hours):
            for start in range(0, rate, 1024):
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, start : start + 1024].T).reshape(1, -1),
                                                   format="flt", layout="stereo")
                frame.sample_rate, frame.pts, frame.time_base = rate, offset * rate + start, Fraction(1, rate)
                container.mux(audio.encode(frame))
        container.mux(audio.encode(None))
    assert probe_audio(tmp_path / "long.mp4") == {"has_audio": True, "audio_sample_rate": rate, "audio_channels": 2}
    began = time.perf_counter()
    late = clip_audio(tmp_path / "long.mp4", [12, 13, 14], WAVE)   # [hours + 0.5 s, hours + 0.875 s)
    assert time.perf_counter() - began < 1.0 and late.audio.shape == (2, 6000) and late.audio.abs().max() > 0.4
    with pytest.raises(AudioReadError, match="more than data.max_audio_seconds=60"):   # frames 7 and 8: 3 hours
        clip_audio(tmp_path / "long.mp4", [7, 8], WAVE)


# --------------------------------------------------------------------------- metadata and the dataset


def test_scan_writes_the_audio_columns(clips, tmp_path):
    from videodit.data.video_write import write_video

    write_video(tmp_path / "still.png", moving_frames(1, 16, 16), fps=8)
    for name in ("aac44k.mp4", "silent_film.mp4", "surround71.mp4"):
        (tmp_path / name).write_bytes((clips / name).read_bytes())
    scan([str(tmp_path)], str(tmp_path / "meta.csv"), workers=1, progress=False)
    meta = read_metadata(tmp_path / "meta.csv")
    got = {Path(p).name: tuple(meta.columns[c][i] for c in ("has_audio", "audio_sample_rate", "audio_channels"))
           for i, p in enumerate(meta.paths)}
    assert got == {"aac44k.mp4": ("True", "44100", "2"), "silent_film.mp4": ("False", "", ""),
                   "surround71.mp4": ("True", "48000", "8"), "still.png": ("False", "", "")}


def _dataset(clips, names, spec, **columns):
    """A VideoDataset of ``names`` (48 frames at 24 fps) in one 12-frame 16x16 bucket; ``columns``: extra CSV
    columns, a list of cells each."""
    lines = [",".join(["path,text,num_frames,height,width,aspect_ratio,fps", *columns])]
    for i, name in enumerate(names):
        lines.append(",".join([f"{clips / name},{name},48,16,16,1.0,24", *(str(c[i]) for c in columns.values())]))
    (clips / "meta.csv").write_text("\n".join(lines) + "\n")
    cfg = load_config("tiny", [f"data.csv={clips / 'meta.csv'}", "data.num_frames=12", "data.height=16",
                               "data.width=16", "data.make_toy_if_missing=false"])
    meta = read_metadata(clips / "meta.csv")
    return VideoDataset(meta, BucketPlan(meta, cfg.data, len(names), 0), seed=0, audio=spec)


def test_the_dataset_carries_audio_and_a_mask_only_when_asked(clips):
    names = ["pcm48k.mp4", "silent_film.mp4", "aac44k.mp4"]
    keys = [(i, 0, 0) for i in range(3)]
    plain = collate(_dataset(clips, names, None).__getitems__(keys))
    assert plain.audio is None and plain.audio_mask is None and plain.audio_lengths is None
    dataset = _dataset(clips, names, AudioSpec())
    batch = collate(dataset.__getitems__(keys))
    assert torch.equal(batch.video, plain.video)   # nothing of the video changes
    assert batch.audio.shape == (3, 2, 51, 64) and batch.audio_mask.tolist() == [True, False, True]
    assert batch.audio_lengths.tolist() == [51, 51, 51] and not batch.failed   # 12 frames at 24 fps: 0.5 s
    picks = [dataset._frame_indices(i, 0, 12, 48) for i in range(3)]   # the frames the samples hold
    for row, name, picked in zip(batch.audio, names, picks):
        assert torch.equal(row, clip_audio(clips / name, picked, AudioSpec()).audio)


def test_a_bad_soundtrack_is_replaced_and_counted_like_a_bad_video(clips):
    dataset = _dataset(clips, ["damaged.mp4", "pcm48k.mp4", "hires.mp4"], AudioSpec())
    batch = collate(dataset.__getitems__([(i, 0, 0) for i in range(3)]))
    reasons = dict(batch.failed)
    assert set(reasons) == {str(clips / "damaged.mp4"), str(clips / "hires.mp4")}
    assert "does not decode" in reasons[str(clips / "damaged.mp4")] and batch.audio_mask.all()
    # By the metadata: refused before the file is opened.
    dataset = _dataset(clips, ["pcm48k.mp4", "aac44k.mp4"], AudioSpec(), has_audio=[True, True],
                       audio_sample_rate=[192000, 44100])
    batch = collate(dataset.__getitems__([(0, 0, 0), (1, 0, 0)]))
    assert [reason for _, reason in batch.failed] == [
        "its soundtrack is 192000 Hz by the metadata, more than data.max_audio_sample_rate=96000; resample it "
        "(ffmpeg -i IN -c:v copy -ar 48000 OUT) or raise data.max_audio_sample_rate"]


def test_the_bounds_are_the_config_keys():
    data = DataConfig()
    assert (data.max_audio_seconds, data.max_audio_sample_rate, data.max_audio_channels) == (60.0, 96000, 8)
    assert AudioSpec() == AudioSpec.from_config(data)
    custom = load_config("tiny", ["data.max_audio_seconds=5", "data.max_audio_channels=2"]).data
    assert AudioSpec.from_config(custom, "waveform") == AudioSpec("waveform", 5.0, 96000, 2)
