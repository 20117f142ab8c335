"""Where a run's metrics and sample videos go (``train.loggers``): metrics.jsonl (always),
TensorBoard, Weights & Biases (``train/wandb_logger.py``).

Each logger is one small class with ``log(step, values)``, ``log_videos(step, videos)`` and
``close()``; ``MetricsLogger`` (``train/metrics.py``) opens the ones asked for on rank 0 and
turns a failed write (an ``OSError`` or ``LoggerFailed``) into its one-line ``error``."""

from __future__ import annotations

import io
import json
import tempfile
import time
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from videodit.data.video_write import write_video
from videodit.errors import UserError


class LoggerFailed(Exception):
    """A logger could not record something (its message says why); logging stops as on a full disk."""


@dataclass(frozen=True)
class SampleVideo:
    """One sample clip as logged: its prompt, frames (uint8 [T, H, W, 3]), the mp4 in the run folder
    and, from an audio-trained run, the soundtrack that mp4 carries: (waveform float [channels,
    samples], sample rate), else None."""
    prompt: str
    frames: np.ndarray
    path: Path
    fps: float
    audio: tuple[np.ndarray, int] | None = None

    @property
    def tag(self) -> str:
        """``samples/00-a_red_circle_moving_right``: the file's name, so logs and files match."""
        return f"samples/{self.path.stem}"


def check_loggers(names: list[str]) -> None:
    """Refuse ``wandb`` when its package is missing, or its folder or server cannot be used
    (``wandb_checks.check_wandb``), before anything is built."""
    if "wandb" in names:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UserError("train.loggers lists wandb, but the wandb package is not installed: "
                            "pip install videodit[wandb] (or remove wandb from train.loggers)") from None
        from videodit.train.wandb_checks import check_wandb
        check_wandb()


def scalars(values: dict) -> dict[str, float]:
    """The values plotted as curves: numbers other than the epoch, as ``train/<name>``."""
    return {f"train/{key}": value for key, value in values.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "epoch"}


class JsonlLogger:
    """metrics.jsonl: one JSON object per logged step (sample videos are the files in samples/)."""

    def __init__(self, run_dir: Path):
        self._file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")

    def log(self, step: int, values: dict) -> None:
        self._file.write(json.dumps({"step": step, **values, "time": round(time.time(), 3)}) + "\n")
        self._file.flush()

    def log_videos(self, step: int, videos: list[SampleVideo]) -> None:
        pass

    def close(self) -> None:
        self._file.close()


class TensorBoardLogger:
    """tensorboard/: the scalars, each sample clip as an animated GIF image summary and its
    soundtrack (a GIF has none) as an audio summary, ``<tag>/audio``.

    ``SummaryWriter.add_video`` writes exactly such a summary but needs moviepy to encode the
    GIF; PyAV (a dependency) encodes it here instead. TensorBoard's Images tab plays it; the
    prompts go in a text summary beside it (an image summary has no caption)."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter
        self._writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, values: dict) -> None:
        for tag, value in scalars(values).items():
            self._writer.add_scalar(tag, value, step)

    def log_videos(self, step: int, videos: list[SampleVideo]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        events = self._writer._get_file_writer()   # add_video's own route for a ready summary
        for video in videos:
            _, height, width, channels = video.frames.shape
            image = Summary.Image(height=height, width=width, colorspace=channels,
                                  encoded_image_string=gif_bytes(video.frames, video.fps))
            events.add_summary(Summary(value=[Summary.Value(tag=video.tag, image=image)]), step)
            if video.audio is not None:   # a tag of its own: one tag holds one kind of summary
                sound = audio_summary(*video.audio)
                events.add_summary(Summary(value=[Summary.Value(tag=f"{video.tag}/audio", audio=sound)]), step)
        self._writer.add_text("samples/prompts", "\n\n".join(f"`{v.path.stem}`: {v.prompt}" for v in videos), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def gif_bytes(frames: np.ndarray, fps: float) -> bytes:
    """uint8 [T, H, W, 3] frames as a looping GIF, by the encoder of ``videodit sample --gif``
    (every frame kept; Pillow's would merge identical ones)."""
    with tempfile.TemporaryDirectory(prefix="videodit-gif-") as folder:
        path = Path(folder) / "clip.gif"
        write_video(path, frames, fps)
        return path.read_bytes()


def audio_summary(waveform: np.ndarray, rate: int):
    """A soundtrack (float [channels, samples] or [samples], clipped to [-1, 1]) as TensorBoard's
    audio summary: 16-bit PCM WAV, as ``SummaryWriter.add_audio`` writes it, but keeping both
    channels of a stereo one (add_audio takes mono only); its Audio tab plays it."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    samples = np.atleast_2d(np.asarray(waveform, dtype=np.float32))
    pcm = (np.clip(samples, -1.0, 1.0) * 32767).round().astype("<i2")
    data = io.BytesIO()
    with wave.open(data, "wb") as out:
        out.setnchannels(pcm.shape[0])
        out.setsampwidth(2)
        out.setframerate(int(rate))
        out.writeframes(pcm.T.tobytes())   # a frame per sample: its channels interleaved
    return Summary.Audio(sample_rate=float(rate), num_channels=pcm.shape[0], length_frames=pcm.shape[1],
                         encoded_audio_string=data.getvalue(), content_type="audio/wav")
