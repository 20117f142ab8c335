"""Video and still-image I/O built on PyAV.

Frames are always ``uint8`` numpy arrays shaped ``[T, H, W, 3]`` in RGB order.

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

    Every write goes to a temporary file in the destination folder and is moved into
    place with ``os.replace``, so a crash never leaves a half-written file behind.

Reading
    ``read_video`` decodes every frame; ``probe_video`` reads container metadata only.
    Still images read as one-frame clips with ``fps == IMAGE_FPS``. Anything that
    cannot be read raises ``VideoReadError`` naming the path and the reason.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Iterator

import av
import numpy as np
from PIL import Image

from videodit.errors import UserError

__all__ = [
    "IMAGE_FPS",
    "IMAGE_SUFFIXES",
    "VIDEO_SUFFIXES",
    "VideoReadError",
    "atomic_output",
    "is_image_path",
    "probe_video",
    "read_video",
    "write_video",
]

# Open-Sora gives still images this nominal frame rate (``IMG_FPS`` in its datasets).
IMAGE_FPS = 120.0

VIDEO_SUFFIXES = (".mp4", ".gif")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")

# CRF 12 is visually lossless for flat synthetic colours; the files stay tiny anyway.
# Reproducibility: with macroblock-tree rate control libx264 gave different bytes
# (and decoded pixels off by up to ~12) for the same input in ~3% of 32x32 toy clips,
# even single-threaded, so mbtree is off. One thread makes the output independent of
# the machine's core count; toy-sized clips encode in milliseconds either way.
_H264_OPTIONS = {"crf": "12", "preset": "medium", "threads": "1", "x264-params": "mbtree=0"}

# Below this many pixels per frame a single-threaded colour conversion is fastest.
_SMALL_FRAME_PIXELS = 256 * 256

# AVColorSpace/AVColorPrimaries/AVColorTransferCharacteristic value for BT.601 (525).
_AV_SMPTE170M = 6
_AV_RANGE_MPEG = 1


class VideoReadError(Exception):
    """A file could not be read as a video or image (missing, empty, corrupt, ...)."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot read video {self.path!r}: {reason}")


# --------------------------------------------------------------------------- helpers


def is_image_path(path: str | os.PathLike) -> bool:
    """True if ``path`` has a still-image suffix (``.png``, ``.jpg``, ...)."""
    return Path(path).suffix.lower() in IMAGE_SUFFIXES


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


def _sws_threads(frame: av.VideoFrame) -> int:
    """Threads for a pixel-format conversion: 1 for small frames, else automatic.

    Each conversion builds a fresh swscale context; with automatic threading that
    means a thread pool per frame, which made 32x32 clips ~5x slower to read.
    """
    return 1 if frame.width * frame.height <= _SMALL_FRAME_PIXELS else 0


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


def write_video(path: str | os.PathLike, frames: np.ndarray, fps: float) -> None:
    """Write ``frames`` (uint8 ``[T, H, W, 3]`` RGB) to ``path`` atomically.

    The format follows the suffix: ``.mp4`` (H.264, even sizes only), ``.gif``, or a
    still-image suffix such as ``.png`` when ``T == 1``. Any other suffix, odd sizes for
    ``.mp4``, or ``T > 1`` for an image raise ``UserError``.
    """
    path = Path(path)
    frames = _check_frames(frames)
    suffix = path.suffix.lower()
    rate = _check_fps(fps)
    # Validate everything before creating a temporary file.
    if suffix == ".mp4":
        _check_even_size(path, frames)
        writer = functools.partial(_write_mp4, frames=frames, rate=rate)
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


def _write_mp4(tmp: Path, frames: np.ndarray, rate: Fraction) -> None:
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
        for rgb in frames:
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame = frame.reformat(
                format="yuv420p",
                dst_colorspace=av.video.reformatter.Colorspace.ITU601,
                dst_color_range=av.video.reformatter.ColorRange.MPEG,
                threads=_sws_threads(frame),
            )
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))  # flush the encoder's delayed frames


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


# --------------------------------------------------------------------------- reading


def read_video(path: str | os.PathLike, *, threaded: bool = True) -> tuple[np.ndarray, float]:
    """Decode every frame of a video (or a still image) at ``path``.

    Returns ``(frames, fps)`` with ``frames`` uint8 ``[T, H, W, 3]`` RGB. Still images
    give ``T == 1`` and ``fps == IMAGE_FPS``. ``threaded`` lets FFmpeg decode with
    several threads. Raises ``VideoReadError`` if the file is missing, empty, or not a
    decodable video/image.
    """
    _check_readable(path)
    if is_image_path(path):
        return _read_image(path)[None], IMAGE_FPS
    frames = []
    with _open_video(path) as (container, stream):
        if threaded:
            stream.thread_type = "AUTO"
        try:
            for frame in container.decode(stream):
                frames.append(frame.to_ndarray(format="rgb24", threads=_sws_threads(frame)))
        except av.FFmpegError as exc:
            reason = f"decoding failed after {len(frames)} frames: {exc}"
            raise VideoReadError(path, reason) from exc
        fps = _stream_fps(container, stream)
    if not frames:
        raise VideoReadError(path, "the video stream has no decodable frames")
    return np.stack(frames), fps


def probe_video(path: str | os.PathLike) -> dict:
    """Return ``{num_frames, height, width, fps}`` from container metadata.

    Frames are counted by decoding only when the container does not record the count
    (``stream.frames == 0``). Still images report one frame at ``IMAGE_FPS``.
    """
    _check_readable(path)
    if is_image_path(path):
        height, width = _read_image(path).shape[:2]
        return {"num_frames": 1, "height": height, "width": width, "fps": IMAGE_FPS}
    with _open_video(path) as (container, stream):
        num_frames = stream.frames
        if num_frames == 0:
            num_frames = _count_frames(path, container, stream)
        return {
            "num_frames": int(num_frames),
            "height": int(stream.codec_context.height),
            "width": int(stream.codec_context.width),
            "fps": _stream_fps(container, stream),
        }


def _check_readable(path: str | os.PathLike) -> None:
    # Checked up front because FFmpeg's own messages for these cases are cryptic.
    if not os.path.exists(path):
        raise VideoReadError(path, "no such file")
    if os.path.isdir(path):
        raise VideoReadError(path, "it is a directory")
    if os.path.getsize(path) == 0:
        raise VideoReadError(path, "the file is empty (0 bytes)")


@contextlib.contextmanager
def _open_video(path: str | os.PathLike):
    """Open ``path`` and yield ``(container, first video stream)``; errors -> VideoReadError."""
    try:
        container = av.open(str(path), mode="r")
    except (av.FFmpegError, OSError, UnicodeDecodeError) as exc:
        raise VideoReadError(path, f"not a readable video ({exc})") from exc
    with container:
        if not container.streams.video:
            raise VideoReadError(path, "the file has no video stream")
        yield container, container.streams.video[0]


def _stream_fps(container, stream) -> float:
    # GIF delays are whole centiseconds, so the average rate of an 8 fps GIF reads
    # as 25/3; FFmpeg's guessed rate recovers the intended 8. Elsewhere the average
    # rate is the honest figure (it also handles variable frame rate).
    rate = stream.guessed_rate if container.format.name == "gif" else stream.average_rate
    rate = rate or stream.guessed_rate or stream.base_rate
    return float(rate) if rate else 0.0


def _count_frames(path, container, stream) -> int:
    # Decoding (not just counting packets) is exact for every codec; it only runs
    # for containers that do not record the frame count.
    stream.thread_type = "AUTO"
    try:
        return sum(1 for _frame in container.decode(stream))
    except av.FFmpegError as exc:
        raise VideoReadError(path, f"counting frames failed: {exc}") from exc


def _read_image(path: str | os.PathLike) -> np.ndarray:
    try:
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8).copy()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise VideoReadError(path, f"not a readable image ({exc})") from exc
