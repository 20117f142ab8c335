"""Soundtracks of training clips: the audio under a sample's frames, as LTX-2's audio VAE takes it.

The window
    A sample's frames are numbers in a full decode (``dataset.sample_frame_indices``). Its audio runs
    from the first picked frame's timestamp to the end of the last one (the next frame's timestamp;
    for a stream's final frame, its packet's duration, else 1/fps), timestamps read from the video
    packets (demuxed only up to the window, never decoded; streams without them fall back to frame
    number / fps). The window holds ``floor(seconds x rate)`` samples (LTX-2's trainer trims a clip's
    audio to ``int(duration x rate)``), the first one at or after the window's start; audio missing at
    either end (a soundtrack that starts late or stops early) is silence, as LTX-2's trainer pads it.
    Only the window is decoded: a seek to 0.2 s before it (AAC and Opus need the packets before a
    point to decode it exactly), then frames up to its end; ``test_audio.py`` checks the result
    equals a full decode's samples.

LTX-2's preprocessing (ltx-trainer ``scripts/process_videos.py`` ``_encode_audio`` + ltx-core
``model/audio_vae/ops.py`` ``AudioProcessor``, Lightricks/LTX-2 400fd31), reimplemented here
    Stereo first, at the source rate: mono is duplicated; 6 and 8 channels (5.1, 7.1: FFmpeg's order
    FL FR FC LFE then the back/side pairs) are downmixed with LTX's weights, which sum to 1 (front
    1/2.414 with centre and surround 0.707/2.414; 7.1: 1/3.121 and 0.707/3.121); any other count above
    two is averaged to mono and duplicated. Then resampled to 16 kHz (torchaudio's windowed sinc:
    Hann window, 6 zero crossings, roll-off 0.99) and made a log-mel spectrogram: STFT with n_fft =
    window = 1024 (the release's ``filter_length``), hop 160, periodic Hann, centred with reflect
    padding, magnitude; 64 Slaney-scale mel bins with Slaney (area) normalisation over 0-8 kHz;
    ``log(max(mel, 1e-5))``. The result is ``[2, 1 + samples // 160, 64]`` (100 frames a second).
    ``tests/fixtures/ltx2_audio`` holds LTX's own outputs (``scripts/make_ltx2_audio_fixtures.py``).

No soundtrack, and bad ones
    A clip without an audio stream (or whose metadata row says ``has_audio`` false) is silence of the
    window's length with ``present=False``: the batch's ``audio_mask`` is False for it, so an audio loss
    can leave it out. A soundtrack that cannot be read (damaged packets, a rate or channel count that
    changes mid-stream), or that is beyond the bounds (``data.max_audio_sample_rate``,
    ``data.max_audio_channels``, a window longer than ``data.max_audio_seconds``, a rate with no small
    ratio to 16 kHz), raises ``AudioReadError``, a ``VideoReadError``: the dataset replaces and counts it
    like an unreadable video (``data.max_bad_fraction``). Decoding holds only the window: a soundtrack
    hours long costs what its window costs.

torch is imported by the functions that compute, so ``videodit data scan`` probes headers without it.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import math
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Sequence

import av
import numpy as np

from videodit.config.schema import DataConfig
from videodit.data.video import VideoReadError, is_image_path
from videodit.user_files import NotRegularFile, check_regular_file

if TYPE_CHECKING:
    import torch

    from videodit.data.metadata import Metadata

__all__ = ["AUDIO_COLUMNS", "AudioReadError", "AudioSpec", "ClipAudio", "HOP_LENGTH", "MEL_BINS", "N_FFT",
           "SAMPLE_RATE", "clip_audio", "frame_window", "known_audio", "log_mel", "mel_centres", "pad_audio", "probe_audio",
           "resample", "to_stereo"]

# LTX-2's audio VAE: stereo log-mel at 16 kHz (its release config's audio_vae.preprocessing).
SAMPLE_RATE = 16_000
N_FFT = 1024
HOP_LENGTH = 160
MEL_BINS = 64
LOG_FLOOR = 1e-5
# Resampling (torchaudio.functional.resample's defaults, which ltx-core uses).
_ZERO_CROSSINGS = 6
_ROLLOFF = 0.99

# Metadata columns (``videodit data scan`` writes them; empty where unknown).
AUDIO_COLUMNS = ("has_audio", "audio_sample_rate", "audio_channels")

# Decoding starts this long before the window: AAC needs the previous frame (1024 samples), Opus 80 ms.
_PREROLL = Fraction(1, 5)
# Largest resampling filter (output phases x taps). Rates with a small ratio to 16 kHz need little
# (44.1 kHz: 160 x 475); a rate such as 47999 Hz would need 16000 x 48k taps (3 GB) and is refused.
_MAX_FILTER_TAPS = 1 << 22


class AudioReadError(VideoReadError):
    """A clip's soundtrack could not be read or is beyond a bound: a bad file, like unreadable video."""


@dataclass(frozen=True)
class AudioSpec:
    """What a sample's soundtrack becomes (``VideoDataset(audio=...)``): ``output="mel"`` LTX-2's log-mel
    ``[2, frames, 64]``, or ``"waveform"`` stereo 16 kHz ``[2, samples]``; and the bounds (``data.*``)."""

    output: str = "mel"
    max_seconds: float = DataConfig.max_audio_seconds
    max_sample_rate: int = DataConfig.max_audio_sample_rate
    max_channels: int = DataConfig.max_audio_channels

    def __post_init__(self):
        if self.output not in ("mel", "waveform"):
            raise ValueError(f"AudioSpec output={self.output!r}: use 'mel' or 'waveform'")

    @classmethod
    def from_config(cls, data: DataConfig, output: str = "mel") -> "AudioSpec":
        return cls(output, data.max_audio_seconds, data.max_audio_sample_rate, data.max_audio_channels)

    def silence(self, samples: int) -> "torch.Tensor":
        """What ``samples`` samples (at 16 kHz) of silence become: zeros, or their log-mel (all ``log(1e-5)``)."""
        import torch

        if self.output == "waveform":
            return torch.zeros(2, samples)
        return torch.full((2, 1 + samples // HOP_LENGTH, MEL_BINS), _silence_value())

    def encode(self, wave: np.ndarray, rate: int) -> "torch.Tensor":
        """float32 ``[channels, samples]`` at ``rate`` -> this spec's output (LTX-2's steps, in its order)."""
        import torch

        stereo = resample(to_stereo(torch.from_numpy(wave)), rate, SAMPLE_RATE)
        return stereo if self.output == "waveform" else log_mel(stereo)


@dataclass
class ClipAudio:
    """A sample's soundtrack: ``audio`` as its ``AudioSpec`` says; ``present``: False for a clip without one
    (``audio`` is then silence of the window's length)."""

    audio: "torch.Tensor"
    present: bool


# --------------------------------------------------------------------------- probing and metadata


def probe_audio(path: str | os.PathLike) -> dict:
    """``{"has_audio", "audio_sample_rate", "audio_channels"}`` of the first audio stream, from the
    container's header (nothing decoded); rate and channels None without one. Images have none and are
    not opened. Raises ``AudioReadError`` when the file cannot be opened."""
    none = {"has_audio": False, "audio_sample_rate": None, "audio_channels": None}
    if is_image_path(path):
        return none
    for options in (_HEADER_ONLY, None):   # what the header declares; where it declares less, probed
        with _open(path, options) as container:
            stream = next(iter(container.streams.audio), None)
            got = none if stream is None else {"has_audio": True, "audio_sample_rate": int(stream.rate or 0) or None,
                                               "audio_channels": _channels(stream) or None}
            declared = _HEADER_FORMATS.intersection(container.format.name.split(","))
            if (stream is None and declared) or (stream is not None and got["audio_sample_rate"]
                                                  and got["audio_channels"]):
                return got
    return got


def known_audio(meta: "Metadata", index: int) -> dict:
    """What row ``index`` of ``meta`` says of its soundtrack (``AUDIO_COLUMNS``): each value, or None
    where the column is missing or its cell empty or not understood."""
    got = {}
    for name in AUDIO_COLUMNS:
        column = meta.columns.get(name)
        value = None if column is None else column[index]
        got[name] = _flag(value) if name == "has_audio" else _whole(value)
    return got


def _flag(value) -> bool | None:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    text = str(value).strip().lower() if value is not None else ""
    return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text)


def _whole(value) -> int | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if math.isfinite(number) and number > 0 and number == int(number) else None


# --------------------------------------------------------------------------- a clip's soundtrack


def clip_audio(path: str | os.PathLike, indices: Sequence[int], spec: AudioSpec, *, known: dict | None = None,
               fps: float | None = None) -> ClipAudio:
    """The soundtrack under frames ``indices`` (numbers in a full decode) of the video at ``path``.

    ``known``: what the metadata says (``known_audio``): no soundtrack means silence without opening
    the file (its length from ``fps``, the row's frame rate), a rate or channel count beyond the bounds
    a refusal before opening it. Raises ``AudioReadError`` (see the module doc)."""
    known = known or {}
    first, last = int(np.min(indices)), int(np.max(indices))
    if is_image_path(path):
        return ClipAudio(spec.silence(0), False)
    if known.get("has_audio") is False and fps:
        seconds = Fraction(last - first + 1) / Fraction(fps)
        _check_seconds(path, seconds, spec)
        return ClipAudio(spec.silence(math.floor(seconds * SAMPLE_RATE)), False)
    _check_bounds(path, known.get("audio_sample_rate"), known.get("audio_channels"), spec, " by the metadata")
    with _open(path, _SKIP_VIDEO) as container:
        if not container.streams.video:
            raise AudioReadError(path, "the file has no video stream to time its soundtrack by")
        start, end = frame_window(path, container, container.streams.video[0], first, last)
        _check_seconds(path, end - start, spec)
        stream = next(iter(container.streams.audio), None)
        if stream is None:
            return ClipAudio(spec.silence(math.floor((end - start) * SAMPLE_RATE)), False)
        rate = int(stream.rate or 0)
        _check_bounds(path, rate, _channels(stream), spec)
        wave = _read_window(path, container, stream, start, math.floor((end - start) * rate))
    return ClipAudio(spec.encode(wave, rate), True)


def _check_seconds(path, seconds: Fraction, spec: AudioSpec) -> None:
    if seconds > spec.max_seconds:
        raise AudioReadError(path, f"its clip window is {float(seconds):.3g} s of audio, more than "
                                   f"data.max_audio_seconds={spec.max_seconds:g}; take fewer frames "
                                   "(data.num_frames, data.frame_interval) or raise data.max_audio_seconds")


def _check_bounds(path, rate: int | None, channels: int | None, spec: AudioSpec, where: str = "") -> None:
    """Refuse a soundtrack beyond the bounds (``None``: not known yet, checked once the file is open)."""
    if rate is not None and rate > spec.max_sample_rate:
        raise AudioReadError(path, f"its soundtrack is {rate} Hz{where}, more than data.max_audio_sample_rate="
                                   f"{spec.max_sample_rate}; resample it (ffmpeg -i IN -c:v copy -ar 48000 OUT) "
                                   "or raise data.max_audio_sample_rate")
    if channels is not None and channels > spec.max_channels:
        raise AudioReadError(path, f"its soundtrack has {channels} channels{where}, more than "
                                   f"data.max_audio_channels={spec.max_channels}; downmix it (ffmpeg -i IN -c:v "
                                   "copy -ac 2 OUT) or raise data.max_audio_channels")
    if where:
        return
    if not rate or not channels:
        raise AudioReadError(path, f"its soundtrack declares {rate or 'no'} Hz and {channels or 'no'} channels; "
                                   "re-encode it (ffmpeg -i IN -c:v copy -c:a aac OUT)")
    if _filter_taps(rate) > _MAX_FILTER_TAPS:
        raise AudioReadError(path, f"its soundtrack's rate {rate} Hz has no small ratio to {SAMPLE_RATE} Hz "
                                   "(resampling it exactly needs a filter of "
                                   f"{_filter_taps(rate) * 4 / 2**20:,.0f} MiB); resample it "
                                   "(ffmpeg -i IN -c:v copy -ar 48000 OUT)")


def frame_window(path, container, stream, first: int, last: int) -> tuple[Fraction, Fraction]:
    """``(start, end)`` in seconds on the container's timeline: frame ``first``'s timestamp and the end of
    frame ``last`` (numbers in a full decode: shown packets ordered by timestamp, as ``video.py`` numbers
    them). Demuxes video packets only as far as needed: a packet shows no earlier than it decodes, so
    once a packet's decode time passes ``last + 2`` timestamps, those are final."""
    times, durations = [], {}
    for packet in container.demux(stream):
        if packet.size == 0:
            continue
        if packet.pts is None:
            times = None
            break
        if not packet.is_discard:
            bisect.insort(times, packet.pts)
            durations[packet.pts] = packet.duration
        if packet.dts is not None and bisect.bisect_left(times, packet.dts) >= last + 2:
            break
    base = stream.time_base
    if times is not None and last < len(times):
        if last + 1 < len(times):
            end = times[last + 1] * base
        else:   # the stream's final frame: its duration, else one frame period
            duration = durations[times[last]]
            end = times[last] * base + (duration * base if duration else _period(stream, path))
        return times[first] * base, end
    # No usable timestamps: frame numbers at the stream's rate from its start.
    origin = (stream.start_time or 0) * base
    period = _period(stream, path)
    return origin + first * period, origin + (last + 1) * period


def _period(stream, path) -> Fraction:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if not rate:
        raise AudioReadError(path, "its video stream has no timestamps or frame rate to time its soundtrack "
                                   "by; re-encode it (ffmpeg -i IN OUT.mp4)")
    return 1 / Fraction(rate)


def _read_window(path, container, stream, start: Fraction, count: int, from_origin: bool = False) -> np.ndarray:
    """float32 ``[channels, count]``: samples ``ceil(start x rate)`` onwards; silence where there are none."""
    rate, channels = int(stream.rate), _channels(stream)
    first = math.ceil(start * rate)
    out = np.zeros((channels, count), np.float32)
    if count == 0:
        return out
    base = stream.time_base
    origin = (stream.start_time or 0) * base
    target = origin if from_origin else max(origin, start - _PREROLL)
    position, first_at = None, None
    packed = None   # FFmpeg's conversion to packed float32: PyAV's to_ndarray crashes on planar 7.1 frames
    try:
        container.seek(math.floor(target / base), stream=stream, backward=True, any_frame=False)
        for frame in container.decode(stream):
            if frame.sample_rate != rate or frame.layout.nb_channels != channels:
                raise AudioReadError(path, f"its soundtrack changes from {rate} Hz x {channels} to "
                                           f"{frame.sample_rate} Hz x {frame.layout.nb_channels} mid-stream; "
                                           "re-encode it (ffmpeg -i IN -c:v copy -c:a aac OUT)")
            if frame.pts is not None:
                position = round(frame.pts * (frame.time_base or base) * rate)
            elif position is None:
                raise AudioReadError(path, "its soundtrack's frames carry no timestamps; re-encode it "
                                           "(ffmpeg -i IN -c:v copy -c:a aac OUT)")
            first_at = position if first_at is None else first_at
            if position >= first + count:
                break
            low, high = max(position, first), min(position + frame.samples, first + count)
            if high > low:
                packed = packed or av.AudioResampler(format="flt", layout=frame.layout, rate=rate)
                samples = np.concatenate([part.to_ndarray().reshape(-1, channels) for part in packed.resample(frame)])
                if len(samples) != frame.samples:
                    raise AudioReadError(path, f"its soundtrack's frame of {frame.samples} samples converts to "
                                               f"{len(samples)}; re-encode it (ffmpeg -i IN -c:v copy -c:a aac OUT)")
                out[:, low - first : high - first] = samples[low - position : high - position].T
            position += frame.samples
            if position >= first + count:
                break
    except av.FFmpegError as exc:
        raise AudioReadError(path, f"its soundtrack does not decode ({' '.join(str(exc).split())}); re-encode "
                                   "it (ffmpeg -i IN -c:v copy -c:a aac OUT) or remove the file") from exc
    if first_at is not None and first_at > first and target > origin and not from_origin:
        # The seek landed after the window's start: decode from the stream's start instead.
        return _read_window(path, container, stream, start, count, from_origin=True)
    return out


def _channels(stream) -> int:
    layout = getattr(stream, "layout", None)
    return int(layout.nb_channels if layout is not None else stream.channels)


# Opening a file decodes a video frame or more to learn the streams' parameters (20 ms for 360p H.264):
# the video decoder skipping every frame (video decoders alone read skip_frame) leaves only the audio's
# probe, 1 ms. For the header alone (scan), FFmpeg also reads no packets beyond it: an mp4's header has
# the sample rate and channels (0.6 ms).
_SKIP_VIDEO = {"skip_frame": "all"}
_HEADER_ONLY = {"probesize": "32", "analyzeduration": "0", **_SKIP_VIDEO}
# Containers whose header lists every stream (others, e.g. MPEG-TS, find theirs in the packets).
_HEADER_FORMATS = frozenset({"mov", "mp4", "matroska", "webm", "avi"})


@contextlib.contextmanager
def _open(path, options: dict | None = None):
    """The container at ``path``; a FIFO, device, missing or unreadable file -> AudioReadError."""
    try:
        check_regular_file(path)   # PyAV opens by path: a FIFO would block it forever
    except NotRegularFile as exc:
        raise AudioReadError(path, exc.strerror) from None
    except OSError as exc:
        raise AudioReadError(path, " ".join((exc.strerror or str(exc)).split()).lower()) from None
    try:
        container = av.open(str(path), mode="r", options=options or {})
    except (av.FFmpegError, OSError, UnicodeDecodeError) as exc:
        raise AudioReadError(path, f"not a readable file ({' '.join(str(exc).split())})") from exc
    with container:
        yield container


# --------------------------------------------------------------------------- LTX-2's preprocessing


def to_stereo(wave: "torch.Tensor") -> "torch.Tensor":
    """``[channels, samples]`` -> ``[2, samples]`` by LTX-2's rule (module doc)."""
    count = wave.shape[0]
    if count == 2:
        return wave
    if count == 1:
        return wave.repeat(2, 1)
    if count == 6:   # 5.1: L R C LFE Ls Rs (the LFE is left out)
        main, other = 1.0 / 2.414, 0.707 / 2.414
        left = main * wave[0] + other * wave[2] + other * wave[4]
        right = main * wave[1] + other * wave[2] + other * wave[5]
        return _stack(left, right)
    if count == 8:   # 7.1: L R C LFE and two surround pairs
        main, other = 1.0 / 3.121, 0.707 / 3.121
        left = main * wave[0] + other * (wave[2] + wave[4] + wave[6])
        right = main * wave[1] + other * (wave[2] + wave[5] + wave[7])
        return _stack(left, right)
    return wave.mean(dim=0, keepdim=True).repeat(2, 1)


def _stack(left, right):
    import torch

    return torch.stack([left, right])


def resample(wave: "torch.Tensor", orig: int, new: int = SAMPLE_RATE) -> "torch.Tensor":
    """``[channels, samples]`` float32 from ``orig`` Hz to ``new`` Hz: a band-limited (windowed sinc)
    interpolation, ``ceil(samples x new / orig)`` samples long, as torchaudio's ``resample`` gives."""
    import torch.nn.functional as F

    if orig == new:
        return wave
    common = math.gcd(orig, new)
    orig, new = orig // common, new // common
    kernel, width = _sinc_kernel(orig, new)
    samples = wave.shape[-1]
    padded = F.pad(wave[:, None], (width, width + orig))
    phases = F.conv1d(padded, kernel.to(wave.dtype), stride=orig)   # [channels, new, steps]: output j*new + phase
    return phases.transpose(1, 2).reshape(wave.shape[0], -1)[:, : -(-new * samples // orig)]


def _filter_taps(rate: int) -> int:
    common = math.gcd(rate, SAMPLE_RATE)
    orig, new = rate // common, SAMPLE_RATE // common
    return 0 if orig == new else new * (orig + 2 * _half_width(orig, new))


def _half_width(orig: int, new: int) -> int:
    cutoff = min(orig, new) * _ROLLOFF   # the low-pass edge, in cycles per (reduced) period
    return math.ceil(_ZERO_CROSSINGS * orig / cutoff)


@functools.lru_cache(maxsize=8)
def _sinc_kernel(orig: int, new: int):
    """Filter ``[new, 1, 2 width + orig]`` (one row per output phase) and ``width``, for rates reduced by
    their gcd: a sinc low-passed at ``_ROLLOFF`` of the lower Nyquist rate, Hann-windowed over
    ``_ZERO_CROSSINGS`` zero crossings each side. Computed in float32, one operation at a time in
    torchaudio's order, so the filter is LTX's bit for bit: the log of near-silent mel bins magnifies a
    filter's last-bit differences (a float64 filter moved the 44.1 kHz log-mel by 1e-5 of its range)."""
    import torch

    cutoff = min(orig, new) * _ROLLOFF
    width = _half_width(orig, new)
    taps = torch.arange(-width, width + orig, dtype=torch.float32) / orig     # input times, in periods
    phases = torch.arange(new, dtype=torch.float32)[:, None] / new           # output times
    x = ((taps[None, :] - phases) * cutoff).clamp(-_ZERO_CROSSINGS, _ZERO_CROSSINGS)   # in zero crossings
    window = torch.cos(x * math.pi / _ZERO_CROSSINGS / 2) ** 2
    x = x * math.pi
    sinc = torch.where(x == 0, torch.tensor(1.0), torch.sin(x) / x)
    return (sinc * (window * (cutoff / orig)))[:, None, :], width


def log_mel(wave: "torch.Tensor") -> "torch.Tensor":
    """Stereo 16 kHz ``[2, samples]`` -> LTX-2's log-mel ``[2, 1 + samples // 160, 64]`` (module doc).

    A window shorter than half an FFT (512 samples: 32 ms, e.g. one frame at 60 fps) is padded with
    silence to one, since reflect padding needs it (LTX's own code fails there); its frame count stays
    ``1 + samples // 160``."""
    import torch
    import torch.nn.functional as F

    samples = wave.shape[-1]
    if samples <= N_FFT // 2:
        wave = F.pad(wave, (0, N_FFT // 2 + 1 - samples))
    spectrum = torch.stft(wave, N_FFT, HOP_LENGTH, N_FFT, window=torch.hann_window(N_FFT, dtype=wave.dtype),
                          center=True, pad_mode="reflect", normalized=False, onesided=True, return_complex=True)
    mel = torch.matmul(spectrum.abs().transpose(-1, -2), _mel_filters().to(wave.dtype))
    return torch.log(mel.clamp(min=LOG_FLOOR))[:, : 1 + samples // HOP_LENGTH].contiguous()


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear (3 mels per 200 Hz) to 1 kHz, logarithmic (27 mels per factor 6.4) above."""
    hz = np.asarray(hz, np.float64)
    step = math.log(6.4) / 27
    return np.where(hz < 1000, hz * 3 / 200, 15 + np.log(np.maximum(hz, 1e-10) / 1000) / step)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    step = math.log(6.4) / 27
    return np.where(mel < 15, mel * 200 / 3, 1000 * np.exp(step * (mel - 15)))


def _mel_edges() -> np.ndarray:
    """The 66 mel points over 0-8 kHz, in Hz: bin k rises from edge k, peaks at k + 1, falls to k + 2."""
    return _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(SAMPLE_RATE / 2), MEL_BINS + 2))


def mel_centres() -> np.ndarray:
    """Each of the 64 mel bins' centre frequency in Hz (where its filter peaks)."""
    return _mel_edges()[1:-1]


@functools.lru_cache(maxsize=1)
def _mel_filters():
    """``[513, 64]`` float32: triangular filters between consecutive mel points over 0-8 kHz, each scaled
    by 2 / its width in Hz (Slaney's normalisation: equal area)."""
    import torch

    freqs = np.linspace(0, SAMPLE_RATE // 2, N_FFT // 2 + 1)
    edges = _mel_edges()
    rising = (freqs[:, None] - edges[None, :-2]) / (edges[1:-1] - edges[:-2])
    falling = (edges[None, 2:] - freqs[:, None]) / (edges[2:] - edges[1:-1])
    filters = np.maximum(0.0, np.minimum(rising, falling)) * (2.0 / (edges[2:] - edges[:-2]))
    return torch.from_numpy(filters.astype(np.float32))


@functools.lru_cache(maxsize=1)
def _silence_value() -> float:
    import torch

    return float(torch.log(torch.tensor(LOG_FLOOR, dtype=torch.float32)))   # what log_mel gives for zeros


# --------------------------------------------------------------------------- batches


def pad_audio(clips: list["torch.Tensor"]) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Samples' audio (mel ``[2, T_i, 64]`` or waveform ``[2, N_i]``) stacked to the longest, padded
    with silence, and each one's own length (``[B]`` int64)."""
    import torch

    lengths = torch.tensor([clip.shape[1] for clip in clips], dtype=torch.int64)
    longest = int(lengths.max())
    fill = _silence_value() if clips[0].dim() == 3 else 0.0
    batch = torch.full((len(clips), 2, longest, *clips[0].shape[2:]), fill, dtype=clips[0].dtype)
    for row, clip in zip(batch, clips):
        row[:, : clip.shape[1]] = clip
    return batch, lengths
