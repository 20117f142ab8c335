"""Reading video frames with torchcodec (``data.decoder=torchcodec``, or ``auto`` where it loads),
on the CPU or with NVDEC (``data.decode_device=cuda``).

torchcodec decodes straight into a uint8 tensor and seeks exactly: in its ``exact`` mode it
scans the file's packets once and numbers frames by timestamp, which is how ``video.py``'s packet
table numbers them, so ``read_window`` gives ``full_decode[indices]`` as PyAV's reader does, bit
for bit on the CPU (same decoder, same swscale conversion to RGB; measured equal on every test
clip, with FFmpeg 5.1 under torchcodec and 8.1 under PyAV). NVDEC converts colours on the GPU
(its own YUV -> RGB kernels), so its frames are close to, not equal to, the CPU's.

What torchcodec cannot number or size exactly is left to PyAV (``read_window`` returns None and
``video.read_video`` reads the file as before): codecs outside PyAV's table (GIF, ...), a frame
count that the header and the packets disagree on (a cut file), a stream whose frame size changes
mid-file (torchcodec refuses it; PyAV rescales it, or raises FrameTooLarge when it grew past
``max_pixels``), frames far larger than their bucket (PyAV shrinks them while converting
colours), a rotated stream, and any error while decoding (PyAV then decodes the file and says how
far it gets). ``READS`` counts which path each call took.

Bounds: the declared size is checked against ``max_pixels`` after torchcodec opens the file and
before any frame is decoded into memory of ours. torchcodec passes no decoder options, so unlike
PyAV's reader the FFmpeg decoder inside it is not bounded: its open probe decodes the first
frame(s) at the declared size (a crafted 16000x16000 header: ~620 MB, once) and a stream that
grows mid-file is decoded at its new size before torchcodec refuses it. ``dataset.py`` refuses
a clip whose CSV size exceeds ``max_pixels`` before either decoder opens it.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Callable

import numpy as np
import torch

# Which path each read_window call took: "torchcodec", or "pyav: <why>".
READS: Counter = Counter()

# What PyAV's reader decides about a file is handed in by ``video.py`` (this module does not
# import it: video.py imports this one): the frame numbers wanted of a frame count (raising its
# VideoReadError past the end), the size bound (raising its FrameTooLarge), and which frames it
# shrinks while reading.
Resolve = Callable[[int], np.ndarray]
SizeCheck = Callable[[int, int], None]
Shrinks = Callable[[int, int], bool]


class LeaveToPyAV(Exception):
    """torchcodec cannot give exactly PyAV's frames for this file; the reason says why."""


def read_window(path: str | os.PathLike, resolve: Resolve, *, codecs: frozenset[str], check_size: SizeCheck,
                shrinks: Shrinks, threaded: bool, device: str = "cpu") -> tuple[np.ndarray, float] | None:
    """``(full_decode[resolve(frame count)], fps)`` as uint8 ``[T, H, W, 3]`` numpy, decoded by
    torchcodec; None where PyAV must read the file (a codec outside ``codecs``, frames that
    ``shrinks``, ...). ``check_size`` and ``resolve`` raise as PyAV's reader does."""
    try:
        frames, fps = read_tensor(path, resolve, codecs=codecs, check_size=check_size, shrinks=shrinks,
                                  threaded=threaded, device=device)
    except LeaveToPyAV as why:
        READS[f"pyav: {why}"] += 1
        return None
    READS["torchcodec"] += 1
    return frames.cpu().numpy(), fps


def read_tensor(path: str | os.PathLike, resolve: Resolve, *, codecs: frozenset[str] | None = None,
                check_size: SizeCheck | None = None, shrinks: Shrinks | None = None, threaded: bool = True,
                device: str = "cpu") -> tuple[torch.Tensor, float]:
    """``read_window``'s frames as a uint8 ``[T, H, W, 3]`` tensor on ``device`` (NVDEC's stay on
    the GPU); raises ``LeaveToPyAV`` where ``read_window`` returns None. Without ``codecs``,
    ``check_size`` and ``shrinks``, any codec and size is read as it is."""
    from torchcodec.decoders import VideoDecoder

    try:
        decoder = VideoDecoder(str(path), dimension_order="NHWC", num_ffmpeg_threads=0 if threaded else 1,
                               device=device, seek_mode="exact")
        meta = decoder.metadata
    except (RuntimeError, ValueError, OSError) as exc:
        raise LeaveToPyAV("torchcodec cannot open it") from exc
    width, height = meta.width, meta.height
    if codecs is not None and meta.codec not in codecs:
        raise LeaveToPyAV(f"codec {meta.codec}")
    if not (width and height):
        raise LeaveToPyAV("no declared size")
    if check_size is not None:
        check_size(width, height)
    if shrinks is not None and shrinks(width, height):
        raise LeaveToPyAV("frames to shrink")
    if meta.rotation:
        raise LeaveToPyAV("rotated stream")
    total = meta.num_frames_from_content
    if total is None or (meta.num_frames_from_header and meta.num_frames_from_header != total):
        raise LeaveToPyAV("frame count of header and packets differ")
    if total == 0:
        raise LeaveToPyAV("no frames")
    wanted = np.asarray(resolve(total), dtype=np.int64)
    unique = np.unique(wanted)
    try:
        frames = decoder.get_frames_at(unique.tolist()).data if len(unique) else \
            torch.empty((0, height, width, 3), dtype=torch.uint8, device=device)
    except (RuntimeError, IndexError, ValueError) as exc:
        raise LeaveToPyAV("decoding failed") from exc
    if tuple(frames.shape[1:]) != (height, width, 3):
        raise LeaveToPyAV("frame size differs from the header")
    if len(unique) != len(wanted) or not np.array_equal(unique, wanted):
        frames = frames[torch.from_numpy(np.searchsorted(unique, wanted)).to(frames.device)]
    return frames, float(meta.average_fps_from_header or meta.average_fps or 0.0)
