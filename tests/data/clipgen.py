"""Test clips made with PyAV: a chosen GOP, variable frame rate, a size change mid-stream."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np


def moving_frames(num_frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """uint8 [T, H, W, 3]: a random coarse texture scrolling right, so every frame differs."""
    texture = np.random.default_rng(seed).integers(0, 4, (height, 2 * width, 3), dtype=np.uint8) * 80
    frames = np.empty((num_frames, height, width, 3), np.uint8)
    for t in range(num_frames):
        shift = (2 * t) % width
        frames[t] = texture[:, shift : shift + width]
    return frames


def encode_h264(path, frames: np.ndarray, *, keyint: int, bframes: int = 2, pts: list[int] | None = None,
                rate: int = 24) -> None:
    """Write ``frames`` as H.264 with a keyframe every ``keyint`` frames (no scene cuts).

    ``pts`` (in units of 1/rate s) gives each frame's timestamp, for variable frame rate.
    """
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.codec_context.time_base = Fraction(1, rate)
        stream.options = {"threads": "1", "preset": "veryfast",
                          "x264-params": f"keyint={keyint}:min-keyint={keyint}:scenecut=0:bframes={bframes}"}
        for t, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = t if pts is None else pts[t]
            frame.time_base = Fraction(1, rate)
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


def _annexb(frames: np.ndarray, rate: int) -> bytes:
    """Raw H.264 (Annex B, parameter sets in-band, no B-frames) of ``frames``."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="h264") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = {"threads": "1", "x264-params": "bframes=0"}
        for rgb in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def size_change_mp4(path, first: np.ndarray, second: np.ndarray, rate: int = 8) -> None:
    """One H.264 stream in an mp4 whose frame size changes from ``first``'s to ``second``'s,
    as when two differently sized clips are concatenated without re-encoding."""
    raw = io.BytesIO(_annexb(first, rate) + _annexb(second, rate))
    with av.open(raw, format="h264") as source, av.open(str(path), "w", format="mp4") as target:
        template = source.streams.video[0]
        stream = (target.add_stream_from_template(template) if hasattr(target, "add_stream_from_template")
                  else target.add_stream(template=template))   # PyAV < 13
        packets = (p for p in source.demux(source.streams.video[0]) if p.size)
        for number, packet in enumerate(packets):
            packet.pts = packet.dts = number
            packet.duration, packet.time_base, packet.stream = 1, Fraction(1, rate), stream
            target.mux(packet)


def damage_outside(source, target, keep: range, seed: int = 0) -> None:
    """Copy ``source`` to ``target`` with the payload of every packet outside ``keep``
    (packet numbers in decode order) replaced by random bytes: decoding those fails."""
    rng = np.random.default_rng(seed)
    with av.open(str(source)) as src, av.open(str(target), "w") as dst:
        template = src.streams.video[0]
        stream = (dst.add_stream_from_template(template) if hasattr(dst, "add_stream_from_template")
                  else dst.add_stream(template=template))   # PyAV < 13
        for number, packet in enumerate(p for p in src.demux(template) if p.size):
            if number not in keep:
                garbage = av.Packet(rng.integers(0, 256, packet.size, dtype=np.uint8).tobytes())
                garbage.pts, garbage.dts, garbage.duration = packet.pts, packet.dts, packet.duration
                garbage.time_base, garbage.is_keyframe = packet.time_base, packet.is_keyframe
                packet = garbage
            packet.stream = stream
            dst.mux(packet)
