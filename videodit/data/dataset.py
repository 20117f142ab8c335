"""Training samples: decode a clip at its bucket's shape, replacing unreadable files.

The dataset is indexed by ``(index, epoch, bucket)`` keys from the bucket sampler. A file
that fails to decode (truncated, zero-byte, not a video, vanished) is replaced by another
sample of the same bucket, so the batch keeps its shape; the failure travels with the
sample (``failed``) so the trainer can count it, even from DataLoader workers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from videodit.data.metadata import Metadata
from videodit.data.video import VideoReadError, read_video
from videodit.errors import UserError

if TYPE_CHECKING:
    from videodit.data.buckets.plan import BucketPlan


def sample_frame_indices(total: int, num_frames: int, interval: int, rng: np.random.Generator) -> np.ndarray:
    """Open-Sora's temporal sampling: a random window of ``num_frames`` frames taken every
    ``interval`` frames. Clips shorter than the window repeat their last frame."""
    span = (num_frames - 1) * interval + 1
    start = int(rng.integers(0, total - span + 1)) if total >= span else 0
    return np.minimum(start + np.arange(num_frames) * interval, total - 1)


def resize_center_crop(video: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[T, C, h, w] float -> [T, C, height, width]: scale to cover, keep aspect, crop the centre."""
    h, w = video.shape[-2:]
    scale = max(height / h, width / w)
    new_h, new_w = max(height, round(h * scale)), max(width, round(w * scale))
    if (new_h, new_w) != (h, w):
        video = F.interpolate(video, size=(new_h, new_w), mode="bilinear", align_corners=False,
                              antialias=scale < 1)
    top, left = (new_h - height) // 2, (new_w - width) // 2
    return video[..., top : top + height, left : left + width]


class VideoDataset(Dataset):
    def __init__(self, meta: Metadata, plan: "BucketPlan", frame_interval: int = 1, seed: int = 0,
                 max_replacements: int = 8):
        self.meta = meta
        self.plan = plan
        self.frame_interval = frame_interval
        self.seed = seed
        self.max_replacements = max_replacements

    def __len__(self) -> int:
        return len(self.meta)

    def __getitem__(self, key: tuple[int, int, int]) -> dict:
        index, epoch, bucket = key
        failed = []
        for attempt in range(self.max_replacements + 1):
            try:
                sample = self.load(index, epoch, bucket)
                sample["failed"] = failed
                return sample
            except VideoReadError as exc:
                failed.append((self.meta.paths[index], exc.reason))
                index = self._replacement(index, epoch, bucket, attempt)
        # Every try failed: a black clip keeps the batch shape; the trainer's bad-file
        # guard stops the run long before such samples matter.
        shape = self.plan.buckets[bucket]
        return {"video": torch.full((3, shape.num_frames, shape.height, shape.width), -1.0),
                "text": "", "fps": 1.0, "failed": failed}

    def load(self, index: int, epoch: int, bucket: int) -> dict:
        shape = self.plan.buckets[bucket]
        rng = np.random.default_rng([self.seed, epoch, index])
        frames, fps = read_video(self.meta.paths[index])
        picked = frames[sample_frame_indices(len(frames), shape.num_frames, self.frame_interval, rng)]
        video = torch.from_numpy(np.ascontiguousarray(picked)).permute(0, 3, 1, 2).float()
        video = resize_center_crop(video, shape.height, shape.width)
        video = (video / 127.5 - 1.0).clamp(-1, 1).permute(1, 0, 2, 3)   # [C, T, H, W] in [-1, 1]
        return {
            "video": video.contiguous(),
            "text": self.meta.texts[index],
            "fps": self.meta.fps[index] / (self.frame_interval if shape.num_frames > 1 else 1),
        }

    def _replacement(self, index: int, epoch: int, bucket: int, attempt: int) -> int:
        """Another sample of the same bucket this epoch, chosen deterministically."""
        members = np.flatnonzero(self.plan.assign(epoch) == bucket)
        rng = np.random.default_rng([self.seed, epoch, index, attempt, 1])
        return int(members[rng.integers(len(members))])


@dataclass
class Batch:
    """One collated batch of training samples."""

    video: torch.Tensor          # [B, C, T, H, W] in [-1, 1]
    text: list[str]
    fps: torch.Tensor            # [B] frames per second the model is told
    failed: list[tuple[str, str]] = field(default_factory=list)   # (path, reason) of reads replaced
    noise_seed: int = 0          # seeds the noise, timesteps and caption dropout (the trainer sets it)

    def __len__(self) -> int:
        return len(self.text)


def collate(samples: list[dict]) -> Batch:
    return Batch(video=torch.stack([s["video"] for s in samples]), text=[s["text"] for s in samples],
                 fps=torch.tensor([s["fps"] for s in samples], dtype=torch.float32),
                 failed=[f for s in samples for f in s["failed"]])


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
