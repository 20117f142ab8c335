"""Training samples: decode a clip at its bucket's shape, replacing unreadable files.

The dataset is indexed by ``(index, epoch, bucket)`` keys from the bucket sampler. A file
that fails to decode (truncated, zero-byte, not a video, vanished) is replaced by another
sample of the same bucket, so the batch keeps its shape; the failure travels with the
sample (``failed``) so the trainer can count it, even from DataLoader workers. A clip whose
frames have more than ``max_pixels`` (``data.max_pixels``) pixels, by its CSV row or its
stream header, fails the same way before anything is decoded; frames more than 8x their
bucket's size are shrunk as they are decoded (``read_video(fit=...)``).

With ``audio`` (an ``audio.AudioSpec``; off by default) a sample also carries the soundtrack under its
frames (``audio``: LTX-2's log-mel or the waveform) and ``audio_mask`` (False for a clip without one:
silence); a damaged or out-of-bounds soundtrack fails the sample like an unreadable video (docs/audio.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, default_collate, get_worker_info

from videodit.data.audio import AudioSpec, clip_audio, known_audio, pad_audio
from videodit.data.caption_suffix import MOTION_COLUMN, training_caption
from videodit.data.metadata import Metadata
from videodit.data.pixels import clip_channels_last, cover_size, crop_resize_uint8
from videodit.data.shared_slots import Lease, SlotBoard, fresh_shared
from videodit.data.video import MAX_PIXELS, FrameTooLarge, VideoReadError, read_video
from videodit.errors import UserError

if TYPE_CHECKING:
    from videodit.data.buckets.plan import BucketPlan


# Frames up to this many pixels decode fastest on one thread.
_SMALL_FRAME = 256 * 256
# A dataset whose clips, decoded whole, take at most this many bytes (by its CSV's sizes) keeps
# them in memory once read (``VideoDataset(keep_decoded=True)``): the default toy set (540 clips
# of 16 frames at 16x16, 6.6 MB) is then decoded once, not once per epoch.
KEEP_DECODED_BYTES = 64 * 2**20


def decoded_bytes(meta: Metadata) -> float:
    """Bytes of every clip of ``meta`` decoded whole as uint8 RGB, by its CSV's sizes."""
    return float(np.sum(meta.num_frames.astype(np.float64) * meta.heights * meta.widths * 3))


def sample_frame_indices(total: int, num_frames: int, interval: int, rng: np.random.Generator) -> np.ndarray:
    """Open-Sora's temporal sampling: a random window of ``num_frames`` frames taken every
    ``interval`` frames. Clips shorter than the window repeat their last frame."""
    span = (num_frames - 1) * interval + 1
    start = int(rng.integers(0, total - span + 1)) if total >= span else 0
    return np.minimum(start + np.arange(num_frames) * interval, total - 1)


_cover_size = cover_size   # the one definition lives in pixels.py, with the uint8 path


def resize_center_crop(video: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[T, C, h, w] float -> [T, C, height, width]: scale to cover, keep aspect, crop the centre."""
    h, w = video.shape[-2:]
    new_h, new_w, scale = _cover_size(h, w, height, width)
    if (new_h, new_w) != (h, w):
        video = F.interpolate(video, size=(new_h, new_w), mode="bilinear", align_corners=False,
                              antialias=scale < 1)
    top, left = (new_h - height) // 2, (new_w - width) // 2
    return video[..., top : top + height, left : left + width]


def clip_tensor(frames: np.ndarray, height: int, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [T, h, w, 3] -> float [3, T, height, width] in [-1, 1]: resize_center_crop, then
    ``x / 127.5 - 1``; written into ``out`` when given. Training batches are uint8
    (``pixels.crop_resize_uint8``, normalised on the device); this float path reads sampling
    references and is what the uint8 path is checked against.

    Without a resize (crop only) NumPy does the work: bit-identical values (the map is per
    uint8 value), with no OpenMP threads to wait on and no intermediate float tensors.
    """
    h, w = frames.shape[1:3]
    if out is None:
        out = torch.from_numpy(np.empty((3, frames.shape[0], height, width), dtype=np.float32))
    if _cover_size(h, w, height, width)[:2] == (h, w):
        top, left = (h - height) // 2, (w - width) // 2
        planar = np.ascontiguousarray(frames[:, top : top + height, left : left + width].transpose(3, 0, 1, 2))
        target = out.numpy()
        np.divide(planar, np.float32(127.5), out=target, dtype=np.float32)
        np.subtract(target, np.float32(1.0), out=target)
        return out
    video = torch.from_numpy(frames).permute(0, 3, 1, 2).float()
    video = resize_center_crop(video, height, width)
    return out.copy_((video / 127.5 - 1.0).clamp(-1, 1).permute(1, 0, 2, 3))


class _Recorded:
    """A frame picker that remembers the frames it last picked."""

    def __init__(self, pick):
        self.pick, self.indices = pick, None

    def __call__(self, total: int) -> np.ndarray:
        self.indices = self.pick(total)
        return self.indices


def _in_worker() -> bool:
    return get_worker_info() is not None


@contextlib.contextmanager
def _one_torch_thread():
    """Run torch ops on the calling thread only, as DataLoader workers do.

    Per-clip ops are small: on cores kept busy by FFmpeg's threads or other processes,
    OpenMP's spin-waiting made them 4-5x slower with two threads than with one.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _refs(array: np.ndarray) -> int:
    return sys.getrefcount(array)


class _BufferPool:
    """Reuses the memory of batches this process has finished with.

    Writing a fresh 50 MB batch page-faults it in, which on a VM costs about as much as
    decoding the clips in it. Every tensor, view or storage still using a buffer holds a
    reference to its NumPy array, so the reference count says when it is free again.
    At most ``keep`` buffers of up to ``max_bytes`` each are kept.
    """

    def __init__(self, keep: int = 2, max_bytes: int = 256 * 2**20):
        self.keep, self.max_bytes = keep, max_bytes
        self.buffers: list[np.ndarray] = []   # flat uint8, most recently allocated first
        self.lock = threading.Lock()
        probe = [np.empty(0)]
        self.free_refs = _refs(probe[0])     # measured the way take() counts them

    def take(self, dims: tuple[int, ...]) -> torch.Tensor:
        size = math.prod(dims)
        with self.lock:   # hand a buffer out before another thread can see it free
            for i in range(len(self.buffers)):
                if self.buffers[i].size >= size and _refs(self.buffers[i]) == self.free_refs:
                    return torch.from_numpy(self.buffers[i][:size].reshape(dims))
            buffer = np.empty(size, dtype=np.uint8)
            if buffer.nbytes <= self.max_bytes:
                self.buffers = [buffer, *self.buffers][: self.keep]
            return torch.from_numpy(buffer.reshape(dims))


_BUFFERS = _BufferPool()


def _batch_tensor(size: int, shape, slots: SlotBoard | None = None) -> tuple[torch.Tensor, Lease | None]:
    """Uninitialised uint8 [size, 3, T, H, W] (over [size, T, H, W, 3] memory, see pixels.py)
    that a batch's samples are written into, and the lease of its worker slot if it has one.

    In a DataLoader worker it lives in shared memory, so sending it to the main process copies
    nothing: a slot of ``slots`` that the worker reuses (shared_slots.py), else fresh (as
    default_collate allocates it). Elsewhere it comes from _BUFFERS.
    """
    dims = (size, shape.num_frames, shape.height, shape.width, 3)
    if not _in_worker():
        return _BUFFERS.take(dims).permute(0, 4, 1, 2, 3), None
    batch, lease = (fresh_shared(dims), None) if slots is None else slots.take(get_worker_info().id, dims)
    return batch.permute(0, 4, 1, 2, 3), lease


class VideoDataset(Dataset):
    """Samples by ``(index, epoch, bucket)`` key: ``{"video": uint8 [3, T, H, W] (``[T, H, W, 3]``
    memory; ``pixels.to_model_input`` makes it float in [-1, 1] on the device), "text", "fps",
    "failed": [(path, reason), ...]}``.

    A DataLoader fetches a batch through ``__getitems__``: the batch's videos are views into
    one ``[B, 3, T, H, W]`` tensor, which ``collate`` hands over without copying.
    """

    def __init__(self, meta: Metadata, plan: "BucketPlan", frame_interval: int = 1, seed: int = 0,
                 max_replacements: int = 8, max_pixels: int = MAX_PIXELS, caption_suffix: str = "none",
                 keep_decoded: bool = False, audio: AudioSpec | None = None):
        """``caption_suffix``: ``data.caption_suffix`` (``opensora2``: Open-Sora 2.0's fps and motion score).
        ``keep_decoded``: keep every clip read, decoded whole, in this process's memory (each worker its
        own), so later epochs only pick frames; for small datasets (``KEEP_DECODED_BYTES``). The frames
        are the same: a read of some frames is exactly the whole decode indexed.
        ``audio``: also give each sample its soundtrack (``"audio"``, ``"audio_mask"``; None: none, as before)."""
        self.meta = meta
        self.caption_suffix = caption_suffix
        self.plan = plan
        self.frame_interval = frame_interval
        self.seed = seed
        self.max_replacements = max_replacements
        self.max_pixels = max_pixels
        self.slots: SlotBoard | None = None   # reused worker batch buffers (loader.py sets them)
        self.kept: dict | None = {} if keep_decoded else None   # (index, height, width) -> whole clip
        self.kept_bytes = 0
        self.audio = audio

    def __len__(self) -> int:
        return len(self.meta)

    def __getitem__(self, key: tuple[int, int, int]) -> dict:
        with _one_torch_thread():
            return self._sample(key, None)

    def __getitems__(self, keys: list[tuple[int, int, int]]) -> list[dict]:
        buckets = {bucket for _, _, bucket in keys}
        with _one_torch_thread():
            if len(buckets) != 1:
                return [self._sample(key, None) for key in keys]
            videos, lease = _batch_tensor(len(keys), self.plan.buckets[buckets.pop()], self.slots)
            samples = [self._sample(key, video) for key, video in zip(keys, videos)]
            samples[0]["lease"] = lease   # collate puts it on the Batch
            return samples

    def _sample(self, key: tuple[int, int, int], out: torch.Tensor | None) -> dict:
        index, epoch, bucket = key
        failed = []
        for attempt in range(self.max_replacements + 1):
            try:
                sample = self.load(index, epoch, bucket, out)
                sample["failed"] = failed
                return sample
            except VideoReadError as exc:
                failed.append((self.meta.paths[index], exc.reason))
                index = self._replacement(index, epoch, bucket, attempt)
        # Every try failed: a black clip keeps the batch shape; the trainer's bad-file
        # guard stops the run long before such samples matter.
        shape = self.plan.buckets[bucket]
        black = (clip_channels_last(shape.num_frames, shape.height, shape.width) if out is None else out).fill_(0)
        sample = {"video": black, "text": "", "fps": 1.0, "failed": failed}
        if self.audio is not None:
            sample.update(audio=self.audio.silence(0), audio_mask=False)
        return sample

    def load(self, index: int, epoch: int, bucket: int, out: torch.Tensor | None = None) -> dict:
        shape = self.plan.buckets[bucket]
        # Only the sampled frames are decoded; the reader asks for them once it knows the
        # frame count, so the draw is the one a full decode would have made.
        pick = functools.partial(self._frame_indices, index, epoch, shape.num_frames)
        if self.audio is not None:
            pick = _Recorded(pick)   # the soundtrack's window is these frames'
        path, height, width = self.meta.paths[index], int(self.meta.heights[index]), int(self.meta.widths[index])
        if height * width > self.max_pixels:   # the CSV's size: not even opened
            raise FrameTooLarge(path, width, height, self.max_pixels, where=", by the CSV")
        if self.kept is None:
            frames, _ = read_video(path, indices=pick, threaded=self._threaded(index), max_pixels=self.max_pixels,
                                   fit=(shape.height, shape.width), scratch=True)   # resized into ``out`` at once
        else:
            frames = self._whole_clip(index, path, shape.height, shape.width)
            frames = frames[pick(len(frames))]   # in range: sample_frame_indices clamps to the clip
        fps = self.meta.fps[index] / (self.frame_interval if shape.num_frames > 1 else 1)
        sample = {"video": crop_resize_uint8(frames, shape.height, shape.width, out), "text": self.caption(index, fps),
                  "fps": fps}
        if self.audio is not None:
            got = clip_audio(path, pick.indices, self.audio, known=known_audio(self.meta, index),
                             fps=float(self.meta.fps[index]))
            sample.update(audio=got.audio, audio_mask=got.present)
        return sample

    def _whole_clip(self, index: int, path: str, height: int, width: int) -> np.ndarray:
        """Every frame of clip ``index`` as read for a ``height`` x ``width`` bucket, decoded once."""
        key = (index, height, width)
        frames = self.kept.get(key)
        if frames is None:   # a failed read raises here and is tried again next time
            frames, _ = read_video(path, threaded=self._threaded(index), max_pixels=self.max_pixels,
                                   fit=(height, width))
            if self.kept_bytes + frames.nbytes <= 2 * KEEP_DECODED_BYTES:   # a CSV that understates sizes
                self.kept[key] = frames
                self.kept_bytes += frames.nbytes
        return frames

    def caption(self, index: int, fps: float) -> str:
        """The row's caption, with ``caption_suffix`` (``fps``: of the frames the model is given)."""
        if self.caption_suffix == "none":
            return self.meta.texts[index]
        motion = self.meta.columns.get(MOTION_COLUMN)
        return training_caption(self.meta.texts[index], fps, None if motion is None else motion[index])

    def _threaded(self, index: int) -> bool:
        # Workers already keep the cores busy, and for small frames starting FFmpeg's
        # frame threads costs more than they save (1.4x slower at 128x128 on 2 cores).
        return not _in_worker() and self.meta.heights[index] * self.meta.widths[index] > _SMALL_FRAME

    def _frame_indices(self, index: int, epoch: int, num_frames: int, total: int) -> np.ndarray:
        # A fresh generator per call: the reader may call this twice (when it falls back
        # to a full decode) and must get the same frames.
        rng = np.random.default_rng([self.seed, epoch, index])
        return sample_frame_indices(total, num_frames, self.frame_interval, rng)

    def _replacement(self, index: int, epoch: int, bucket: int, attempt: int) -> int:
        """Another sample of the same bucket this epoch, chosen deterministically."""
        members = np.flatnonzero(self.plan.assign(epoch) == bucket)
        rng = np.random.default_rng([self.seed, epoch, index, attempt, 1])
        return int(members[rng.integers(len(members))])


@dataclass
class Batch:
    """One collated batch of training samples."""

    video: torch.Tensor          # uint8 [B, C, T, H, W]; pixels.to_model_input: float in [-1, 1]
    text: list[str]
    fps: torch.Tensor            # [B] frames per second the model is told
    failed: list[tuple[str, str]] = field(default_factory=list)   # (path, reason) of reads replaced
    noise_seed: int = 0          # seeds the noise, timesteps and caption dropout (the trainer sets it)
    lease: Lease | None = field(default=None, repr=False, compare=False)   # the worker slot ``video`` is in
    # With VideoDataset(audio=...): each clip's soundtrack padded with silence to the batch's longest
    # (log-mel [B, 2, T, 64] or waveform [B, 2, N]), whether it has one ([B] bool; False: silence, leave
    # it out of an audio loss), and its own length in T or N ([B] int64).
    audio: torch.Tensor | None = None
    audio_mask: torch.Tensor | None = None
    audio_lengths: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.text)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.lease is not None:   # arrived from a worker: its slot is reused once unused here
            self.lease.arrived(self.video)

    def pin_memory(self) -> "Batch":
        """The batch in page-locked memory (what ``DataLoader(pin_memory=True)`` calls); the
        worker's buffer is free again once this copy is made."""
        audio = {} if self.audio is None else {name: getattr(self, name).pin_memory()
                                               for name in ("audio", "audio_mask", "audio_lengths")}
        return dataclasses.replace(self, video=self.video.pin_memory(), fps=self.fps.pin_memory(), lease=None, **audio)


def collate(samples: list[dict]) -> Batch:
    video = _stack([s["video"] for s in samples])
    lease = samples[0].get("lease")
    if lease is not None and video.data_ptr() != samples[0]["video"].data_ptr():
        lease = None   # stacked into a copy: the slot is not what the batch holds
    audio = {}
    if "audio" in samples[0]:
        clips, lengths = pad_audio([s["audio"] for s in samples])
        audio = {"audio": clips, "audio_lengths": lengths,
                 "audio_mask": torch.tensor([s["audio_mask"] for s in samples], dtype=torch.bool)}
    return Batch(video=video, text=[s["text"] for s in samples],
                 fps=torch.tensor([s["fps"] for s in samples], dtype=torch.float32),
                 failed=[f for s in samples for f in s["failed"]], lease=lease, **audio)


def _stack(videos: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(videos)``; the batch tensor they are views of when they already are its rows
    (``VideoDataset.__getitems__``), so a batch is never copied."""
    base = videos[0]._base
    if base is not None and base.is_contiguous() and base.dim() == 5:
        batch = base.permute(0, 4, 1, 2, 3)   # _batch_tensor's layout
        if batch.shape == (len(videos), *videos[0].shape) and all(
                v._base is base and v.data_ptr() == row.data_ptr() and v.stride() == row.stride()
                for v, row in zip(videos, batch)):
            return batch
    if _in_worker():
        return default_collate(videos)   # stacks straight into shared memory
    return torch.from_numpy(np.stack([v.numpy() for v in videos]))


class BadFileGuard:
    """Counts unreadable files; stops the run when more than ``max_fraction`` of reads fail."""

    def __init__(self, max_fraction: float, min_reads: int = 32):
        self.max_fraction = max_fraction
        self.min_reads = min_reads
        self.reads = 0
        self.failures: Counter = Counter()
        self.reasons: dict[str, str] = {}

    def update(self, batch: Batch) -> None:
        self.reads += len(batch) + len(batch.failed)
        for path, reason in batch.failed:
            self.failures[path] += 1
            self.reasons[path] = reason
        failed = sum(self.failures.values())
        if self.reads >= self.min_reads and failed > self.max_fraction * self.reads:
            worst = ", ".join(f"{p} ({self.reasons[p]})" for p, _ in self.failures.most_common(3))
            raise UserError(f"{failed} of {self.reads} reads failed ({failed / self.reads:.0%} > "
                            f"data.max_bad_fraction={self.max_fraction}); worst: {worst}; fix or remove "
                            "these files (videodit data scan reports them) or raise data.max_bad_fraction")

    def summary(self) -> str | None:
        if not self.failures:
            return None
        return (f"skipped {len(self.failures)} unreadable file(s) ({sum(self.failures.values())} failed reads), "
                f"e.g. {next(iter(self.failures))}: {self.reasons[next(iter(self.failures))]}")
