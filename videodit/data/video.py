"""Reading video and still images with PyAV, or torchcodec where chosen (writing: ``video_write.py``).

Frames are always ``uint8`` numpy arrays shaped ``[T, H, W, 3]`` in RGB order.

Reading
    ``read_video`` decodes every frame, or only the frames asked for (``indices``):
    then H.264, HEVC, AV1, VP9, MPEG-4 and MJPEG streams are decoded from the keyframe
    before the first wanted frame up to the last one, giving exactly the frames a full
    decode has at those numbers (other codecs, e.g. GIF, are decoded whole and indexed).
    ``probe_video`` reads container metadata only. Still images read as one-frame clips
    with ``fps == IMAGE_FPS``. A stream whose frame size changes mid-file is read at its
    first (declared) size. Anything that cannot be read raises ``VideoReadError`` naming
    the path and the reason. With ``data.decoder`` torchcodec (``decoder_choice.py``) video
    files are decoded by ``decode_torchcodec.py``, to the same frames; what it cannot read
    exactly is read here as before.

Bounds
    Only regular files are opened (``user_files.check_regular_file``): a FIFO would block
    ``av.open`` or ``Image.open`` forever, a device stream without end. A stream or image
    whose declared (header) size, or a decoded frame's size, is more than ``max_pixels``
    (``data.max_pixels``, default ``MAX_PIXELS``) raises ``FrameTooLarge`` before its frames
    are decoded. Given ``fit`` (the size frames will be resized to cover and cropped to), frames
    more than 8x that size per side (``SHRINK_ABOVE``) are shrunk while they are read: by
    swscale in the colour conversion (no full-size RGB frame is made), by JPEG's DCT scaling
    (``Image.draft``) and Pillow's resize for images. They are shrunk to 4x the cover size
    (``SHRINK_TO``), so the last antialiased step stays the trainer's own
    (``dataset.clip_tensor``), as for any clip up to 8x its bucket's size.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import warnings
from pathlib import Path
from typing import Callable, Iterator, Sequence, Union

import av
import numpy as np
from PIL import Image

from videodit.config.schema import MAX_PIXELS   # data.max_pixels's default, re-exported
from videodit.data.decoder_choice import current_decoder
from videodit.user_files import NotRegularFile, check_regular_file, open_user_file

__all__ = [
    "FrameTooLarge",
    "IMAGE_FPS",
    "IMAGE_SUFFIXES",
    "MAX_PIXELS",
    "VIDEO_SUFFIXES",
    "VideoReadError",
    "is_image_path",
    "probe_video",
    "read_video",
]

# Open-Sora gives still images this nominal frame rate (``IMG_FPS`` in its datasets).
IMAGE_FPS = 120.0

VIDEO_SUFFIXES = (".mp4", ".gif")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


# Below this many pixels per frame a single-threaded colour conversion is fastest.
_SMALL_FRAME_PIXELS = 256 * 256



class VideoReadError(Exception):
    """A file could not be read as a video or image (missing, empty, corrupt, ...)."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot read video {self.path!r}: {reason}")


class FrameTooLarge(VideoReadError):
    """A clip's or image's frames (declared, or as decoded) have more pixels than allowed.

    ``width``/``height`` are None when only the pixel count is known (Pillow's own bound)."""

    def __init__(self, path: str | os.PathLike, width: int | None, height: int | None, limit: int,
                 where: str = "", pixels: int | None = None):
        self.width, self.height, self.limit = width, height, limit
        self.pixels = pixels if pixels is not None else width * height
        size = f"are {width}x{height} (width x height{where}), {self.pixels} pixels" if width else \
            f"have {self.pixels} pixels"
        super().__init__(path, f"its frames {size}, more than data.max_pixels={limit}; shrink the file "
                               "(e.g. ffmpeg -i IN -vf scale=1280:-2 OUT) or raise data.max_pixels")


def _check_pixels(path, width: int, height: int, limit: int | None, where: str = "") -> None:
    if limit is not None and int(width) * int(height) > limit:
        raise FrameTooLarge(path, int(width), int(height), limit, where)


# Frames more than SHRINK_ABOVE times their cover size (per side) are shrunk to SHRINK_TO times
# it as they are read; torch's antialiased resize does the rest. Measured on 1080p frames of
# fine texture against an area-averaged reference (levels of 255, mean absolute): at 64x64,
# resizing full frames 4.9, swscale to 4x then torch 4.7 (to 2x: 6.0); CPU per frame 20 ms vs
# 2.9 ms. Shrinking by less than 2x first saves nothing: 1080p -> 4x of 256x256 took 37 ms vs
# 28 ms for the full frame, hence SHRINK_ABOVE = 2 x SHRINK_TO.
SHRINK_TO = 4
SHRINK_ABOVE = 2 * SHRINK_TO

# swscale's default scaled yuv420p -> RGB path interpolates chroma poorly (10 levels of 255 off
# an area average at 1080p -> 228x128, against 1.9 with full chroma interpolation).
_SHRINK_INTERPOLATION = (av.video.reformatter.Interpolation.BICUBIC
                         | av.video.reformatter.Interpolation.FULL_CHR_H_INT)


def shrunk_size(width: int, height: int, fit: tuple[int, int] | None) -> tuple[int, int] | None:
    """``(width, height)`` to read a ``width`` x ``height`` frame at when it will be resized to
    cover ``fit`` = ``(height, width)`` and cropped: ``SHRINK_TO`` times the cover size when the
    frame is more than ``SHRINK_ABOVE`` times it per side, else None (read it as it is). Keeps
    the aspect ratio, as the cover resize does, so the crop takes the same part of the frame."""
    if fit is None or not (width and height):
        return None
    scale = max(fit[0] / height, fit[1] / width)
    if scale * SHRINK_ABOVE >= 1:
        return None
    return max(SHRINK_TO * fit[1], round(width * scale * SHRINK_TO)), \
        max(SHRINK_TO * fit[0], round(height * scale * SHRINK_TO))


# --------------------------------------------------------------------------- helpers


def is_image_path(path: str | os.PathLike) -> bool:
    """True if ``path`` has a still-image suffix (``.png``, ``.jpg``, ...)."""
    return Path(path).suffix.lower() in IMAGE_SUFFIXES


def sws_threads(frame: av.VideoFrame) -> int:
    """Threads for a pixel-format conversion: 1 for small frames, else automatic.

    Each conversion builds a fresh swscale context; with automatic threading that
    means a thread pool per frame, which made 32x32 clips ~5x slower to read.
    """
    return 1 if frame.width * frame.height <= _SMALL_FRAME_PIXELS else 0


# --------------------------------------------------------------------------- reading

# Codecs whose packets each decode to exactly one shown frame, so a table of packet
# timestamps numbers frames the way a full decode does. Others (GIF, VP8 with hidden
# frames, ...) are always decoded whole.
_TABLE_CODECS = frozenset({"h264", "hevc", "av1", "vp9", "mpeg4", "mjpeg"})

# Packets of files up to this size are kept from the table pass and decoded from memory;
# larger files are read again from the keyframe after a seek.
_KEEP_PACKET_BYTES = 32 * 2**20

Indices = Union[Sequence[int], np.ndarray, Callable[[int], Sequence[int]]]


class _Mismatch(Exception):
    """The packet table or a seek disagreed with the decoder: decode the file whole."""


def read_video(path: str | os.PathLike, *, indices: Indices | None = None, threaded: bool = True,
               max_pixels: int | None = MAX_PIXELS, fit: tuple[int, int] | None = None,
               scratch: bool = False) -> tuple[np.ndarray, float]:
    """Decode a video (or a still image) at ``path``; all frames or only ``indices``.

    Returns ``(frames, fps)`` with ``frames`` uint8 ``[T, H, W, 3]`` RGB. Still images
    give ``T == 1`` and ``fps == IMAGE_FPS``. ``indices`` picks frames by their number
    in a full decode (any order, repeats allowed): a sequence, or a callable given the
    frame count that returns them (it may be called twice, so it must not draw fresh
    random numbers per call). The result is exactly ``full_decode[indices]``, but for
    H.264, HEVC, AV1, VP9, MPEG-4 and MJPEG streams only the frames from the keyframe
    before the first wanted frame to the last wanted one are decoded (``_read_window``).

    Every frame has the stream's declared size (the first frame's): frames of a stream
    whose size changes mid-file are rescaled to it, so a clip always stacks into one
    array (``data scan --verify`` reports such files). ``threaded`` lets FFmpeg decode
    with several threads. Raises ``VideoReadError`` if the file is missing, empty, not a
    regular file, not a decodable video/image, or shorter than an index asks for;
    ``FrameTooLarge`` (a ``VideoReadError``) if its frames have more than ``max_pixels``
    pixels (None: no bound). ``fit`` = ``(height, width)``: the frames will be resized to
    cover that size and centre-cropped (``dataset.clip_tensor``); frames more than 8x
    that per side are returned shrunk to 4x the cover size (``shrunk_size``), scaled as
    they are converted, never held at full size in RGB.

    ``scratch``: the frames may land in this thread's reused buffer (``_ScratchFrames``), valid
    until its next ``read_video(scratch=True)``; for a caller that copies them out at once.
    """
    _check_readable(path)
    if is_image_path(path):
        return _select(path, _read_image(path, max_pixels=max_pixels, fit=fit)[None], indices), IMAGE_FPS
    choice = current_decoder()
    if choice.decoder == "torchcodec":
        from videodit.data import decode_torchcodec   # imports torchcodec: only when it is chosen

        got = decode_torchcodec.read_window(
            path, lambda total: np.arange(total) if indices is None else _resolve_indices(path, indices, total),
            codecs=_TABLE_CODECS, check_size=lambda width, height: _check_pixels(path, width, height, max_pixels),
            shrinks=lambda width, height: shrunk_size(width, height, fit) is not None, threaded=threaded,
            device=choice.device)
        if got is not None:
            return got
    if indices is not None:
        window = _read_window(path, indices, threaded, max_pixels, fit, scratch)
        if window is not None:
            return window
    frames, fps = _read_all(path, threaded, max_pixels, fit)
    return _select(path, frames, indices), fps


def _read_all(path: str | os.PathLike, threaded: bool, max_pixels: int | None = MAX_PIXELS,
              fit: tuple[int, int] | None = None) -> tuple[np.ndarray, float]:
    """Decode every frame, in order, at the stream's declared size (or ``shrunk_size``)."""
    frames = []
    with _open_video(path, max_pixels) as (container, stream):
        if threaded:
            stream.thread_type = "AUTO"
        convert = _FrameConverter(stream, path, max_pixels, fit)
        try:
            for frame in container.decode(stream):
                frames.append(convert(frame))
        except av.FFmpegError as exc:
            reason = f"decoding failed after {len(frames)} frames: {exc}"
            if not frames and max_pixels is not None and not all(convert.size):
                reason = (f"no frame decodes within data.max_pixels={max_pixels} (its frames are larger, or it is "
                          f"damaged: {exc}); shrink or re-encode it, or raise data.max_pixels")
            raise VideoReadError(path, reason) from exc
        fps = _stream_fps(container, stream)
    if not frames:
        raise VideoReadError(path, "the video stream has no decodable frames")
    return np.stack(frames), fps


def _select(path, frames: np.ndarray, indices: Indices | None) -> np.ndarray:
    if indices is None:
        return frames
    return frames[_resolve_indices(path, indices, len(frames))]


def _resolve_indices(path, indices: Indices, total: int) -> np.ndarray:
    """``indices`` (or ``indices(total)``) as int64, checked against ``total`` frames."""
    wanted = np.asarray(indices(total) if callable(indices) else indices, dtype=np.int64).reshape(-1)
    bad = wanted[(wanted < 0) | (wanted >= total)]
    if bad.size:
        raise VideoReadError(path, f"frame {int(bad[0])} was asked for but the video has {total} frames")
    return wanted


class _FrameConverter:
    """Decoded frame -> uint8 ``[H, W, 3]`` RGB at the stream's declared size, or at
    ``shrunk_size(declared, fit)``: swscale scales while it converts the colours.

    One reformatter per clip reuses its swscale context instead of building one per
    frame; without scaling the pixels are the same as ``frame.to_ndarray(format="rgb24")``.
    A decoded frame of more than ``max_pixels`` (a stream that grows mid-file, or one that
    declares no size) raises ``FrameTooLarge``.
    """

    def __init__(self, stream, path=None, max_pixels: int | None = None, fit: tuple[int, int] | None = None):
        self.path, self.max_pixels, self.fit = path, max_pixels, fit
        self.size = self._target(stream.codec_context.width, stream.codec_context.height)
        self.reformatter = av.video.reformatter.VideoReformatter()

    def _target(self, width: int, height: int) -> tuple[int, int]:
        return shrunk_size(width, height, self.fit) or (width, height)

    def __call__(self, frame: av.VideoFrame) -> np.ndarray:
        _check_pixels(self.path, frame.width, frame.height, self.max_pixels, ", as decoded")
        if not all(self.size):   # no declared size: the first frame sets it
            self.size = self._target(frame.width, frame.height)
        width, height = self.size
        # Only a bucket's shrink gets the shrink filter; a frame that grew mid-stream is scaled back
        # to the declared size with swscale's default, as before.
        shrink = self.fit is not None and (width < frame.width or height < frame.height)
        rgb = self.reformatter.reformat(frame, width=width, height=height, format="rgb24",
                                        interpolation=_SHRINK_INTERPOLATION if shrink else None,
                                        threads=sws_threads(frame))
        return rgb.to_ndarray()


# ----------------------------------------------------------------- decoding a window


class _PacketTable:
    """Timestamps of a stream's packets, read by demuxing only (no decoding).

    ``pts``/``keyframe``/``shown`` are in decode order; ``shown`` is False for packets
    the demuxer marks as discarded (decoded for reference, never output). Frame ``i`` of
    a full decode is the shown packet with the ``i``-th smallest pts. ``packets`` keeps
    the packets themselves when they are small enough, so decoding needs no second read.
    """

    def __init__(self, pts: np.ndarray, keyframe: np.ndarray, shown: np.ndarray, packets: list | None):
        self.pts, self.keyframe, self.shown, self.packets = pts, keyframe, shown, packets
        self.frame_pts = np.sort(pts[shown])
        self.num_frames = len(self.frame_pts)

    def start(self, first: int) -> tuple[int, int]:
        """``(packet, frame)``: the packet to start decoding at for frame number ``first``,
        and the number of the first frame that decoding from it outputs.

        The packet is the last keyframe at or before ``first`` that no later packet
        displays before (no leading pictures that reference earlier packets), else the
        first packet, which is exactly a full decode.
        """
        later_min = np.minimum.accumulate(self.pts[::-1])[::-1]
        clean = self.keyframe & self.shown & (later_min == self.pts) & (self.pts <= self.frame_pts[first])
        candidates = np.flatnonzero(clean)
        packet = int(candidates[-1]) if len(candidates) else 0
        if packet == 0:
            return 0, 0
        return packet, int(np.searchsorted(self.frame_pts, self.pts[packet]))


def _packet_table(path, container, stream) -> _PacketTable | None:
    """The stream's packet table, or None when timestamps cannot number its frames."""
    pts, keyframe, shown = [], [], []
    packets, kept_bytes = [], 0
    try:
        for packet in container.demux(stream):
            if packet.size == 0:   # the end-of-stream flush packet
                continue
            if packet.pts is None or packet.is_corrupt:
                return None
            pts.append(packet.pts)
            keyframe.append(packet.is_keyframe)
            shown.append(not packet.is_discard)
            if packets is not None:
                kept_bytes += packet.size
                if kept_bytes > _KEEP_PACKET_BYTES:
                    packets = None   # a big file: seek and read it again rather than hold it
                else:
                    packets.append(packet)
    except av.FFmpegError as exc:
        raise VideoReadError(path, f"reading packets failed after {len(pts)}: {exc}") from exc
    pts_array = np.asarray(pts, dtype=np.int64)
    # Fewer packets than the container's index lists: a cut file, whose frame count only
    # a full decode tells. Equal timestamps would make frame numbers ambiguous.
    if (stream.frames and stream.frames != len(pts)) or len(np.unique(pts_array)) != len(pts_array):
        return None
    return _PacketTable(pts_array, np.asarray(keyframe, dtype=bool), np.asarray(shown, dtype=bool), packets)


def _read_window(path, indices: Indices, threaded: bool, max_pixels: int | None = MAX_PIXELS,
                 fit: tuple[int, int] | None = None, scratch: bool = False) -> tuple[np.ndarray, float] | None:
    """``full_decode[indices]`` decoding only from the keyframe before the first wanted frame
    to the last one; None when the stream cannot be read this way (decode it whole).

    The packet table gives the frame count and each frame's timestamp. Decoding starts
    at a clean keyframe (found by seeking, then skipping packets up to it) and every
    output frame must carry the timestamp of the next frame number; any disagreement
    (a dropped frame, a seek that lands past the keyframe) falls back to a full decode.
    """
    with _open_video(path, max_pixels) as (container, stream):
        if stream.codec_context.name not in _TABLE_CODECS:
            return None
        table = _packet_table(path, container, stream)
        if table is None:
            return None
        if table.num_frames == 0:
            raise VideoReadError(path, "the video stream has no decodable frames")
        wanted = _resolve_indices(path, indices, table.num_frames)
        convert = _FrameConverter(stream, path, max_pixels, fit)
        if not all(convert.size):
            return None   # no declared size to allocate the frames at: a full decode finds it
        if threaded:
            stream.thread_type = "AUTO"
        try:
            frames = _decode_frames(path, container, stream, table, wanted, convert, scratch)
        except _Mismatch:
            return None
        return frames, _stream_fps(container, stream)


class _ScratchFrames(threading.local):
    """One frame buffer per thread, reused by ``read_video(scratch=True)``, grown to the largest clip:
    a fresh array of a clip's full-size frames (91 MB for 33 frames of 720p) is above malloc's mmap
    threshold, so every clip faulted its pages in anew (~30 CPU ms of a 720p window's read)."""
    buffer = np.empty(0, dtype=np.uint8)

    def take(self, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape))
        if self.buffer.size < size:
            self.buffer = np.empty(size, dtype=np.uint8)
        return self.buffer[:size].reshape(shape)


_SCRATCH = _ScratchFrames()


def _decode_frames(path, container, stream, table: _PacketTable, wanted: np.ndarray,
                   convert: _FrameConverter, scratch: bool = False) -> np.ndarray:
    width, height = convert.size
    shape = (len(wanted), height, width, 3)
    out = _SCRATCH.take(shape) if scratch else np.empty(shape, dtype=np.uint8)
    if not len(wanted):
        return out
    slots: dict[int, list[int]] = {}
    for position, number in enumerate(wanted.tolist()):
        slots.setdefault(number, []).append(position)
    last = max(slots)
    start_packet, expected = table.start(min(slots))
    frame_number = {pts: i for i, pts in enumerate(table.frame_pts.tolist())}
    try:
        for frame in _decode_from(container, stream, table, start_packet):
            if frame_number.get(frame.pts) != expected:
                raise _Mismatch
            positions = slots.get(expected)
            if positions:
                out[positions[0]] = convert(frame)
                for position in positions[1:]:
                    out[position] = out[positions[0]]
                if expected == last:
                    return out   # stop: nothing later is needed
            expected += 1
    except av.FFmpegError as exc:
        raise _Mismatch from exc   # let a full decode say how far the file really decodes
    raise _Mismatch   # the stream ended before the last wanted frame


def _decode_from(container, stream, table: _PacketTable, start_packet: int) -> Iterator[av.VideoFrame]:
    """Frames decoded from the packet at decode position ``start_packet`` onwards."""
    if table.packets is not None:
        for packet in table.packets[start_packet:]:
            yield from stream.decode(packet)
        yield from stream.decode(None)   # flush the frames the decoder still holds
        return
    position = {pts: i for i, pts in enumerate(table.pts.tolist())}
    try:
        container.seek(int(table.pts[start_packet]), stream=stream, backward=True, any_frame=False)
    except av.FFmpegError as exc:
        raise _Mismatch from exc
    started = False
    for packet in container.demux(stream):
        if not started:
            here = position.get(packet.pts) if packet.size else None
            if here is None or here > start_packet:
                raise _Mismatch   # the seek landed past the keyframe, or somewhere unknown
            if here < start_packet:
                continue          # before the keyframe: not needed
            started = True
        yield from packet.decode()


def probe_video(path: str | os.PathLike) -> dict:
    """Return ``{num_frames, height, width, fps}`` from container metadata.

    Frames are counted by decoding only when the container does not record the count
    (``stream.frames == 0``), and then only if the header's frame size is within ``MAX_PIXELS``
    (else ``FrameTooLarge``: nothing is decoded). Still images report one frame at
    ``IMAGE_FPS``; they are decoded to check them, unless their header says they have more than
    ``MAX_PIXELS`` pixels (then, like videos, only the header is read; training skips them).
    """
    _check_readable(path)
    if is_image_path(path):
        width, height = _image_size(path)
        if width * height <= MAX_PIXELS:
            height, width = _read_image(path, max_pixels=None).shape[:2]
        return {"num_frames": 1, "height": height, "width": width, "fps": IMAGE_FPS}
    with _open_video(path, None) as (container, stream):
        num_frames = stream.frames
        if num_frames == 0:
            _check_pixels(path, stream.codec_context.width, stream.codec_context.height, MAX_PIXELS)
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
    _check_regular(path)
    if os.path.getsize(path) == 0:
        raise VideoReadError(path, "the file is empty (0 bytes)")


def _check_regular(path: str | os.PathLike) -> None:
    """``check_regular_file`` as a VideoReadError: a FIFO, socket or device is refused before
    a library that opens by path (PyAV) could block on it or read it without end."""
    try:
        check_regular_file(path)
    except NotRegularFile as exc:
        raise VideoReadError(path, exc.strerror) from None
    except OSError as exc:   # vanished since it was listed, or unreadable
        raise VideoReadError(path, " ".join((exc.strerror or str(exc)).split()).lower()) from None


# FFmpeg's own bound on a decoded picture (AVCodecContext.max_pixels) is an int.
_FFMPEG_MAX_PIXELS = 2**31 - 1


@contextlib.contextmanager
def _open_video(path: str | os.PathLike, max_pixels: int | None = MAX_PIXELS):
    """Open ``path`` and yield ``(container, first video stream)``; errors -> VideoReadError,
    a declared frame size of more than ``max_pixels`` -> FrameTooLarge.

    A bound also goes to FFmpeg's decoders (their ``max_pixels``): opening a file decodes its
    first frames to learn the stream's parameters (a 16000x16000 H.264 frame took 620 MB
    there), and a decoder so bounded allocates no picture larger, at open or later (a stream
    that grows mid-file, or declares no size). FFmpeg counts padded (coded) pictures, e.g. a
    48x32 H.264 frame as 64x32, so its bound is twice ours plus 1M pixels: the exact bound
    is ours, on the declared size here and on each decoded frame (``_FrameConverter``)."""
    _check_regular(path)
    options = {} if max_pixels is None else \
        {"max_pixels": str(min(2 * max_pixels + 2**20, _FFMPEG_MAX_PIXELS))}
    try:
        container = av.open(str(path), mode="r", options=options)
    except (av.FFmpegError, OSError, UnicodeDecodeError) as exc:
        raise VideoReadError(path, f"not a readable video ({exc})") from exc
    with container:
        if not container.streams.video:
            raise VideoReadError(path, "the file has no video stream")
        stream = container.streams.video[0]
        _check_pixels(path, stream.codec_context.width, stream.codec_context.height, max_pixels)
        if options:
            stream.codec_context.options = dict(options)
        yield container, stream


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


@contextlib.contextmanager
def _open_image(path: str | os.PathLike, max_pixels: int | None = MAX_PIXELS):
    """The image at ``path``, its header read, its pixels not yet decoded (Pillow is lazy);
    refused as ``FrameTooLarge`` when its header gives more than ``max_pixels`` pixels.

    Opened with ``open_user_file`` (a FIFO is refused, never waited on). Pillow's own
    decompression-bomb check (``Image.MAX_IMAGE_PIXELS``) warns from 89M pixels and refuses
    from 179M: the warning is silenced (``max_pixels`` is the bound that applies) and the
    refusal worded as ours, in one line."""
    try:
        with open_user_file(path) as handle:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(handle)
            with image:
                _check_pixels(path, *image.size, max_pixels)
                yield image
    except NotRegularFile as exc:
        raise VideoReadError(path, exc.strerror) from None
    except Image.DecompressionBombError as exc:
        pixels = re.search(r"\((\d+) pixels\)", str(exc))
        count = int(pixels.group(1)) if pixels else None
        if count is not None and max_pixels is not None and count > max_pixels:
            raise FrameTooLarge(path, None, None, max_pixels, pixels=count) from None
        raise VideoReadError(path, f"Pillow refuses images of more than {2 * Image.MAX_IMAGE_PIXELS} pixels "
                                   f"(Image.MAX_IMAGE_PIXELS x 2){f', this one has {count}' if count else ''}; "
                                   "shrink the image") from None
    except (OSError, ValueError) as exc:
        raise VideoReadError(path, f"not a readable image ({' '.join(str(exc).split())})") from exc


def _image_size(path: str | os.PathLike) -> tuple[int, int]:
    """``(width, height)`` from the image's header; nothing decoded."""
    with _open_image(path, None) as image:
        return image.size


def _read_image(path: str | os.PathLike, *, max_pixels: int | None = MAX_PIXELS,
                fit: tuple[int, int] | None = None) -> np.ndarray:
    """uint8 ``[H, W, 3]``; with ``fit``, shrunk as ``shrunk_size`` says: a JPEG is decoded at
    1/2, 1/4 or 1/8 scale (DCT scaling, ``Image.draft``) where that still covers it, the rest
    by Pillow's antialiased bicubic resize. Decoding errors become VideoReadError (``_open_image``)."""
    with _open_image(path, max_pixels) as image:
        target = shrunk_size(*image.size, fit)
        if target is not None:
            image.draft("RGB", target)   # JPEG only; the size stays at least ``target``
        rgb = image.convert("RGB")
        if target is not None and rgb.size != target:
            rgb = rgb.resize(target, Image.Resampling.BICUBIC)   # antialiased, as swscale's
        return np.asarray(rgb, dtype=np.uint8).copy()
