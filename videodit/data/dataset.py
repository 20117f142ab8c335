"""Training samples: decode a clip, pick its frames, resize and crop to the training size."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from videodit.data.metadata import Metadata
from videodit.data.video import read_video


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
    """Indexed by ``(index, epoch)`` keys from the batch sampler (see ``data/sampler.py``)."""

    def __init__(self, meta: Metadata, num_frames: int, height: int, width: int,
                 frame_interval: int = 1, seed: int = 0):
        self.meta = meta
        self.num_frames = num_frames
        self.height = height
        self.width = width
        self.frame_interval = frame_interval
        self.seed = seed

    def __len__(self) -> int:
        return len(self.meta)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        index, epoch = key
        rng = np.random.default_rng([self.seed, epoch, index])
        frames, _ = read_video(self.meta.paths[index])
        picked = frames[sample_frame_indices(len(frames), self.num_frames, self.frame_interval, rng)]
        video = torch.from_numpy(np.ascontiguousarray(picked)).permute(0, 3, 1, 2).float()
        video = resize_center_crop(video, self.height, self.width)
        video = (video / 127.5 - 1.0).clamp(-1, 1).permute(1, 0, 2, 3)   # [C, T, H, W] in [-1, 1]
        return {
            "video": video.contiguous(),
            "text": self.meta.texts[index],
            "fps": self.meta.fps[index] / self.frame_interval,
        }


def collate(samples: list[dict]) -> dict:
    return {
        "video": torch.stack([s["video"] for s in samples]),
        "text": [s["text"] for s in samples],
        "fps": torch.tensor([s["fps"] for s in samples], dtype=torch.float32),
    }
