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


def tone_burst(seconds: float, rate: int, channels: int, at: float, length: float, hz: float = 1000.0,
               level: float = 0.5) -> np.ndarray:
    """float32 [channels, seconds * rate]: silence with a sine burst of ``length`` s starting at ``at`` s
    (channel c at ``level / (c + 1)``, so channels differ)."""
    t = np.arange(round(seconds * rate)) / rate
    inside = (t >= at) & (t < at + length)
    wave = np.zeros((channels, len(t)), np.float32)
    for c in range(channels):
        wave[c, inside] = level / (c + 1) * np.sin(2 * np.pi * hz * (t[inside] - at))
    return wave


def encode_with_audio(path, frames: np.ndarray | None, wave: np.ndarray | None, *, rate: int = 24,
                      sample_rate: int = 44100, layout: str = "stereo", codec: str = "aac",
                      audio_start: int = 0) -> None:
    """An mp4 of ``frames`` (H.264 at ``rate`` fps, no B-frames) and/or the soundtrack ``wave``
    (float32 [channels, samples] at ``sample_rate``, ``layout``, encoded with ``codec``: aac, flac or
    pcm_s16le; its first sample at ``audio_start`` samples). Either may be None (a silent film, a
    file with no video)."""
    with av.open(str(path), "w", format="mp4") as container:
        if frames is not None:
            video = container.add_stream("libx264", rate=rate)
            video.width, video.height, video.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
            video.options = {"threads": "1", "x264-params": "bframes=0"}
        if wave is not None:
            audio = container.add_stream(codec, rate=sample_rate, layout=layout)
        if frames is not None:
            for t, rgb in enumerate(frames):
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
                frame.pts, frame.time_base = t, Fraction(1, rate)
                container.mux(video.encode(frame))
            container.mux(video.encode(None))
        if wave is not None:
            channels = wave.shape[0]
            for start in range(0, wave.shape[1], 1024):   # packed float: PyAV's planar path stops at 8 planes
                chunk = np.ascontiguousarray(wave[:, start : start + 1024].T).reshape(1, -1)
                frame = av.AudioFrame.from_ndarray(chunk, format="flt", layout=layout)
                frame.sample_rate, frame.pts = sample_rate, audio_start + start
                frame.time_base = Fraction(1, sample_rate)
                assert frame.layout.nb_channels == channels
                container.mux(audio.encode(frame))
            container.mux(audio.encode(None))


def damage_audio(source, target, seed: int = 0) -> None:
    """Copy ``source`` to ``target`` with every audio packet's payload replaced by random bytes (the
    video packets kept): the video reads, the soundtrack does not decode."""
    rng = np.random.default_rng(seed)
    with av.open(str(source)) as src, av.open(str(target), "w", format="mp4") as dst:
        streams = {}
        for stream in (*src.streams.video, *src.streams.audio):
            streams[stream.index] = (dst.add_stream_from_template(stream) if hasattr(dst, "add_stream_from_template")
                                     else dst.add_stream(template=stream))   # PyAV < 13
        for packet in src.demux():
            if not packet.size or packet.stream.index not in streams:
                continue
            out = streams[packet.stream.index]
            if packet.stream.type == "audio":
                garbage = av.Packet(rng.integers(0, 256, packet.size, dtype=np.uint8).tobytes())
                garbage.pts, garbage.dts, garbage.duration = packet.pts, packet.dts, packet.duration
                garbage.time_base, garbage.is_keyframe = packet.time_base, packet.is_keyframe
                packet = garbage
            packet.stream = out
            dst.mux(packet)
