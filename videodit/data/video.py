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
    ``read_video`` decodes every frame, or only the frames asked for (``indices``):
    then H.264, HEVC, AV1, VP9, MPEG-4 and MJPEG streams are decoded from the keyframe
    before the first wanted frame up to the last one, giving exactly the frames a full
    decode has at those numbers (other codecs, e.g. GIF, are decoded whole and indexed).
    ``probe_video`` reads container metadata only. Still images read as one-frame clips
    with ``fps == IMAGE_FPS``. A stream whose frame size changes mid-file is read at its
    first (declared) size. Anything that cannot be read raises ``VideoReadError`` naming
    the path and the reason.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Callable, Iterator, Sequence, Union

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


def read_video(path: str | os.PathLike, *, indices: Indices | None = None,
               threaded: bool = True) -> tuple[np.ndarray, float]:
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
    decodable video/image, or shorter than an index asks for.
    """
    _check_readable(path)
    if is_image_path(path):
        return _select(path, _read_image(path)[None], indices), IMAGE_FPS
    if indices is not None:
        window = _read_window(path, indices, threaded)
        if window is not None:
            return window
    frames, fps = _read_all(path, threaded)
    return _select(path, frames, indices), fps


def _read_all(path: str | os.PathLike, threaded: bool) -> tuple[np.ndarray, float]:
    """Decode every frame, in order, at the stream's declared size."""
    frames = []
    with _open_video(path) as (container, stream):
        if threaded:
            stream.thread_type = "AUTO"
        convert = _FrameConverter(stream)
        try:
            for frame in container.decode(stream):
                frames.append(convert(frame))
        except av.FFmpegError as exc:
            reason = f"decoding failed after {len(frames)} frames: {exc}"
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
    """Decoded frame -> uint8 ``[H, W, 3]`` RGB at the stream's declared size.

    One reformatter per clip reuses its swscale context instead of building one per
    frame; the pixels are the same as ``frame.to_ndarray(format="rgb24")``.
    """

    def __init__(self, stream):
        self.size = (stream.codec_context.width, stream.codec_context.height)
        self.reformatter = av.video.reformatter.VideoReformatter()

    def __call__(self, frame: av.VideoFrame) -> np.ndarray:
        if not all(self.size):   # no declared size: the first frame sets it
            self.size = (frame.width, frame.height)
        width, height = self.size
        rgb = self.reformatter.reformat(frame, width=width, height=height, format="rgb24",
                                        threads=_sws_threads(frame))
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


def _read_window(path, indices: Indices, threaded: bool) -> tuple[np.ndarray, float] | None:
    """``full_decode[indices]`` decoding only from the keyframe before the first wanted frame
    to the last one; None when the stream cannot be read this way (decode it whole).

    The packet table gives the frame count and each frame's timestamp. Decoding starts
    at a clean keyframe (found by seeking, then skipping packets up to it) and every
    output frame must carry the timestamp of the next frame number; any disagreement
    (a dropped frame, a seek that lands past the keyframe) falls back to a full decode.
    """
    with _open_video(path) as (container, stream):
        if stream.codec_context.name not in _TABLE_CODECS:
            return None
        table = _packet_table(path, container, stream)
        if table is None:
            return None
        if table.num_frames == 0:
            raise VideoReadError(path, "the video stream has no decodable frames")
        wanted = _resolve_indices(path, indices, table.num_frames)
        if threaded:
            stream.thread_type = "AUTO"
        try:
            frames = _decode_frames(path, container, stream, table, wanted)
        except _Mismatch:
            return None
        return frames, _stream_fps(container, stream)


def _decode_frames(path, container, stream, table: _PacketTable, wanted: np.ndarray) -> np.ndarray:
    convert = _FrameConverter(stream)
    width, height = convert.size
    out = np.empty((len(wanted), height, width, 3), dtype=np.uint8)
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
