"""Writing video and still images with PyAV and Pillow (reading: ``video.py``).

Frames are ``uint8`` numpy arrays shaped ``[T, H, W, 3]`` in RGB order.

Writing
    * ``.mp4``: H.264 (libx264, yuv420p, CRF 12) so saturated colours survive the
      round trip well enough for colour metrics. yuv420p stores chroma at half
      resolution, so H.264 needs even heights and widths: odd sizes raise
      ``UserError`` rather than being silently padded, because a padded clip would no
      longer match the size recorded in a dataset CSV.
    * ``.gif``: each frame is palettised with Pillow (up to 256 exact colours, no
      dithering) and muxed by FFmpeg's GIF encoder. Pillow's own GIF writer is not
      used because it merges identical consecutive frames, which changes ``T``.
    * ``.png`` / ``.jpg`` / ...: a single frame (``T == 1``) is written as a still image.
    * A soundtrack (``audio=(waveform [channels, samples] float, sample_rate)``) goes into
      the same ``.mp4`` as AAC (Opus where this PyAV build has no AAC encoder), trimmed
      or padded with silence to the video's duration ``T / fps``. A ``.gif`` or an image
      cannot hold one: asking for it is refused rather than dropping the sound unseen.

    Every write goes to a temporary file in the destination folder and is moved into
    place with ``os.replace``, so a crash never leaves a half-written file behind.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Iterator, NamedTuple

import av
import numpy as np
from PIL import Image

from videodit.data.video import IMAGE_SUFFIXES, VIDEO_SUFFIXES, sws_threads
from videodit.errors import UserError

__all__ = ["Audio", "atomic_output", "audio_codec", "write_video"]

# CRF 12 is visually lossless for flat synthetic colours; the files stay tiny anyway.
# Reproducibility: with macroblock-tree rate control libx264 gave different bytes
# (and decoded pixels off by up to ~12) for the same input in ~3% of 32x32 toy clips,
# even single-threaded, so mbtree is off. One thread makes the output independent of
# the machine's core count; toy-sized clips encode in milliseconds either way.
_H264_OPTIONS = {"crf": "12", "preset": "medium", "threads": "1", "x264-params": "mbtree=0"}

# AVColorSpace/AVColorPrimaries/AVColorTransferCharacteristic value for BT.601 (525).
_AV_SMPTE170M = 6
_AV_RANGE_MPEG = 1

# The soundtrack's encoders in order of preference, and the rate a waveform is resampled
# to when its own is not one the encoder takes.
_AUDIO_CODECS = ("aac", "libopus")
_AUDIO_FALLBACK_RATE = 48_000
_AUDIO_MAX_CHANNELS = 2
_AUDIO_BIT_RATE = 64_000  # per channel
# FFmpeg's AAC "fast" coder: per its documentation better than the default "twoloop" from
# 64 kb/s up, and ~5x faster (toy clips: 10 ms instead of 55 ms of 2 s stereo at 16 kHz).
_AUDIO_OPTIONS = {"aac": {"aac_coder": "fast"}}


class Audio(NamedTuple):
    """A soundtrack: ``waveform`` float ``[channels, samples]`` in [-1, 1] at ``sample_rate`` Hz."""

    waveform: np.ndarray
    sample_rate: int


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; move it onto ``path`` on success.

    The temporary file lives in the same folder so ``os.replace`` is an atomic rename
    (never a cross-device copy). On any exception the temporary file is removed and
    ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=f".tmp{path.suffix}"
    )
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        # mkstemp creates files as 0600; give the result ordinary permissions.
        os.chmod(tmp, 0o666 & ~_current_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _current_umask() -> int:
    # The only portable way to read the umask is to set it and put it back.
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _check_frames(frames: np.ndarray) -> np.ndarray:
    """Validate a ``[T, H, W, 3]`` uint8 array and return it C-contiguous."""
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8:
        raise ValueError(f"frames must be a uint8 numpy array, got {type(frames).__name__} "
                         f"{getattr(frames, 'dtype', '')}")
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise ValueError(f"frames must have shape [T>=1, H, W, 3], got {list(frames.shape)}")
    return np.ascontiguousarray(frames)


def _check_fps(fps: float) -> Fraction:
    if not np.isfinite(fps) or fps <= 0:
        raise UserError(f"fps={fps!r} is not a positive frame rate; use e.g. fps=8")
    # Containers want a rational rate; 1001 keeps NTSC rates such as 30000/1001 exact.
    return Fraction(fps).limit_denominator(1001)


# --------------------------------------------------------------------------- writing


def write_video(path: str | os.PathLike, frames: np.ndarray, fps: float,
                audio: tuple[np.ndarray, int] | None = None) -> None:
    """Write ``frames`` (uint8 ``[T, H, W, 3]`` RGB) to ``path`` atomically.

    The format follows the suffix: ``.mp4`` (H.264, even sizes only), ``.gif``, or a
    still-image suffix such as ``.png`` when ``T == 1``. Any other suffix, odd sizes for
    ``.mp4``, or ``T > 1`` for an image raise ``UserError``.

    ``audio`` is an optional soundtrack ``(waveform, sample_rate)`` with ``waveform``
    float ``[channels, samples]`` (1 or 2 channels; values beyond [-1, 1] are clipped),
    muxed into an ``.mp4`` as AAC (or Opus, see ``audio_codec``) and trimmed or padded
    with silence to ``T / fps`` seconds. Other suffixes refuse a soundtrack. Without
    ``audio`` the file is exactly what it was before soundtracks existed.
    """
    path = Path(path)
    frames = _check_frames(frames)
    suffix = path.suffix.lower()
    rate = _check_fps(fps)
    if audio is not None and suffix != ".mp4":
        raise UserError(f"{path}: a {suffix or 'file without a suffix'} cannot hold a soundtrack; "
                        "write .mp4 to keep the audio, or pass audio=None to drop it")
    # Validate everything before creating a temporary file.
    if suffix == ".mp4":
        _check_even_size(path, frames)
        if audio is None:
            writer = functools.partial(_write_mp4, frames=frames, rate=rate)
        else:
            sound = _fit_audio(path, audio, duration=frames.shape[0] / rate)
            audio_codec()  # a build without an audio encoder is refused before any file exists
            writer = functools.partial(_write_mp4, frames=frames, rate=rate, audio=sound)
    elif suffix == ".gif":
        writer = functools.partial(_write_gif, frames=frames, rate=rate)
    elif suffix in IMAGE_SUFFIXES:
        if frames.shape[0] != 1:
            raise UserError(f"{path}: a {suffix} image holds one frame but got "
                            f"{frames.shape[0]}; write the clip as .mp4 or .gif")
        writer = functools.partial(_write_image, rgb=frames[0], suffix=suffix)
    else:
        supported = ", ".join(VIDEO_SUFFIXES + IMAGE_SUFFIXES)
        raise UserError(f"{path}: cannot write {suffix or 'a file without a suffix'}; "
                        f"use one of: {supported}")
    with atomic_output(path) as tmp:
        writer(tmp)


def _check_even_size(path: Path, frames: np.ndarray) -> None:
    height, width = frames.shape[1:3]
    if height % 2 or width % 2:
        raise UserError(
            f"{path}: H.264 (yuv420p) needs an even height and width but the frames are "
            f"{height}x{width}; crop or pad them to even sizes, or write a .gif instead"
        )


def _write_mp4(tmp: Path, frames: np.ndarray, rate: Fraction, audio: Audio | None = None) -> None:
    height, width = frames.shape[1:3]
    with av.open(str(tmp), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = dict(_H264_OPTIONS)
        # Tag BT.601 limited range, the conversion used below, so other players and
        # our own reader invert exactly the matrix the encoder saw.
        ctx = stream.codec_context
        ctx.colorspace = ctx.color_primaries = ctx.color_trc = _AV_SMPTE170M
        ctx.color_range = _AV_RANGE_MPEG
        # Every stream must exist before the first packet writes the header.
        sound = _add_audio_stream(container, audio) if audio is not None else None
        for rgb in frames:
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame = frame.reformat(
                format="yuv420p",
                dst_colorspace=av.video.reformatter.Colorspace.ITU601,
                dst_color_range=av.video.reformatter.ColorRange.MPEG,
                threads=sws_threads(frame),
            )
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))  # flush the encoder's delayed frames
        if sound is not None:
            _mux_audio(container, sound, audio)


# --------------------------------------------------------------------------- soundtrack


@functools.cache
def audio_codec() -> str:
    """The encoder of mp4 soundtracks: ``"aac"``, else ``"libopus"`` where this PyAV build
    lacks AAC. Raises ``UserError`` when it has neither."""
    for name in _AUDIO_CODECS:
        try:
            av.codec.Codec(name, "w")
        except (av.codec.codec.UnknownCodecError, ValueError):
            continue
        return name
    raise UserError(f"this PyAV build (av {av.__version__}) has no AAC or Opus encoder for soundtracks; "
                    "install the PyPI wheel (pip install --force-reinstall av) or pass audio=None")


def _fit_audio(path: Path, audio: tuple[np.ndarray, int], duration: Fraction) -> Audio:
    """Check a ``(waveform, sample_rate)`` soundtrack and trim or pad it to ``duration`` seconds."""
    if not isinstance(audio, (tuple, list)) or len(audio) != 2:
        raise UserError(f"{path}: audio must be a pair (waveform [channels, samples], sample_rate), "
                        f"got {type(audio).__name__}; pass audio=(waveform, 16000)")
    waveform, sample_rate = audio
    waveform = np.asarray(waveform)
    if waveform.ndim == 1:
        waveform = waveform[None]
    if (waveform.ndim != 2 or not 1 <= waveform.shape[0] <= _AUDIO_MAX_CHANNELS
            or not np.issubdtype(waveform.dtype, np.floating)):
        raise UserError(f"{path}: the audio waveform must be float [channels, samples] with 1 or 2 channels, "
                        f"got {waveform.dtype} {list(waveform.shape)}; pass e.g. a float32 [2, N] array")
    if not np.isfinite(waveform).all():
        raise UserError(f"{path}: the audio waveform holds NaN or infinite samples; replace them "
                        "(e.g. np.nan_to_num) before writing")
    if isinstance(sample_rate, bool) or not (isinstance(sample_rate, (int, np.integer)) and sample_rate > 0):
        raise UserError(f"{path}: audio sample_rate={str(sample_rate)[:40]} is not a positive whole number "
                        "of Hz; use e.g. 16000")
    samples = round(duration * int(sample_rate))
    fitted = np.zeros((waveform.shape[0], samples), dtype=np.float32)
    kept = min(samples, waveform.shape[1])
    fitted[:, :kept] = np.clip(waveform[:, :kept], -1.0, 1.0)
    return Audio(fitted, int(sample_rate))


def _add_audio_stream(container, audio: Audio):
    codec = av.codec.Codec(audio_codec(), "w")
    rates = codec.audio_rates or ()
    rate = audio.sample_rate if not rates or audio.sample_rate in rates else _AUDIO_FALLBACK_RATE
    layout = "mono" if audio.waveform.shape[0] == 1 else "stereo"
    stream = container.add_stream(codec.name, rate=rate, layout=layout)
    stream.bit_rate = _AUDIO_BIT_RATE * audio.waveform.shape[0]
    stream.options = dict(_AUDIO_OPTIONS.get(codec.name, {}))
    return stream


def _mux_audio(container, stream, audio: Audio) -> None:
    """Encode ``audio`` into ``stream``: one planar frame, cut by the resampler into the
    encoder's frame size (and converted to its rate and sample format). The encoder is
    open by now (the video's first packet wrote the header), so its frame size is known;
    the muxer interleaves the audio packets with the video's by time."""
    ctx = stream.codec_context
    resampler = av.AudioResampler(format=ctx.format, layout=ctx.layout, rate=ctx.sample_rate,
                                  frame_size=ctx.frame_size or None)
    frame = av.AudioFrame.from_ndarray(audio.waveform, format="fltp", layout=ctx.layout.name)
    frame.sample_rate = audio.sample_rate
    frame.pts, frame.time_base = 0, Fraction(1, audio.sample_rate)
    for piece in [*resampler.resample(frame), *resampler.resample(None)]:
        container.mux(stream.encode(piece))
    container.mux(stream.encode(None))


def _write_gif(tmp: Path, frames: np.ndarray, rate: Fraction) -> None:
    height, width = frames.shape[1:3]
    with av.open(str(tmp), mode="w", format="gif") as container:
        stream = container.add_stream("gif", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "pal8"
        for rgb in frames:
            frame = av.VideoFrame.from_ndarray(_palettise(rgb), format="pal8")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


def _palettise(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(indices [H, W], palette [256, 4] ARGB)`` for PyAV's pal8 frames.

    Frames with at most 256 colours (all toy clips) are stored exactly; richer frames
    are quantised by median cut without dithering (dither noise would read as motion).
    """
    quantised = Image.fromarray(rgb).quantize(256, dither=Image.Dither.NONE)
    indices = np.ascontiguousarray(np.asarray(quantised, dtype=np.uint8))
    colours = np.asarray(quantised.getpalette(), dtype=np.uint8).reshape(-1, 3)
    palette = np.zeros((256, 4), dtype=np.uint8)
    palette[:, 0] = 255  # opaque alpha
    palette[: len(colours), 1:] = colours
    return indices, palette


def _write_image(tmp: Path, rgb: np.ndarray, suffix: str) -> None:
    fmt = {".jpg": "JPEG", ".jpeg": "JPEG"}.get(suffix, suffix.lstrip(".").upper())
    options = {"quality": 95} if fmt == "JPEG" else {}
    Image.fromarray(rgb).save(tmp, format=fmt, **options)
