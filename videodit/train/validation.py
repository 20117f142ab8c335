"""Validation loss on a held-out metadata CSV: the number keep-best ranks checkpoints by.

The rectified-flow loss is noisy because t and the noise are random. Here both are fixed:
every validation sample is scored at the same evenly spaced timesteps with the same noise
(seeded by the sample's index), so two evaluations differ only by the model's weights.
Losses are reported per bucket and overall.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils.data import DataLoader

from videodit.config import Config
from videodit.data.dataset import VideoDataset, collate
from videodit.data.loader import BucketPlan
from videodit.data.metadata import read_metadata
from videodit.diffusion.rectified_flow import RectifiedFlow


class Validator:
    def __init__(self, cfg: Config, csv: str, *, device: torch.device, num_timesteps: int = 10,
                 max_samples: int = 256):
        self.device = device
        self.timesteps = [(i + 0.5) / num_timesteps for i in range(num_timesteps)]
        meta = read_metadata(csv, bad_rows="skip", option="validation.csv")
        self.plan = BucketPlan(meta, cfg.data, cfg.train.batch_size, seed=cfg.train.seed)
        dataset = VideoDataset(meta, self.plan, cfg.data.frame_interval, seed=cfg.train.seed)
        # Epoch 0's assignment, with every bucket's samples in order: the same set every time.
        buckets = self.plan.assign(0)
        keys = [(int(i), 0, int(buckets[i])) for i in range(len(buckets)) if buckets[i] >= 0][:max_samples]
        by_bucket = defaultdict(list)
        for key in keys:
            by_bucket[key[2]].append(key)
        batches = [group[i : i + cfg.train.batch_size] for group in by_bucket.values()
                   for i in range(0, len(group), cfg.train.batch_size)]
        self.loader = DataLoader(dataset, batch_sampler=batches, collate_fn=collate, num_workers=0)
        self.size = len(keys)

    @torch.no_grad()
    def evaluate(self, model, vae, text, flow: RectifiedFlow, autocast) -> dict:
        """``{"val_loss": overall, "val_loss/<resolution>x<frames>": per bucket}``."""
        was_training = model.training
        model.eval()
        totals, counts = defaultdict(float), defaultdict(int)
        for index, batch in enumerate(self.loader):
            video = batch["video"].to(self.device)
            x0 = vae.encode(video)
            y, y_mask = text.encode(batch["text"])
            n = x0.shape[0]
            ratio = flow.shift_ratio(video.shape[-2], video.shape[-1], x0.shape[2])
            generator = torch.Generator().manual_seed(index)   # the same noise at every evaluation
            noise = torch.randn(x0.shape, generator=generator).to(self.device)
            keep = torch.zeros(n, dtype=torch.bool, device=self.device)
            loss = 0.0
            for t_value in self.timesteps:
                t = flow.shift(torch.full((n,), t_value), ratio).to(self.device)
                x_t = flow.interpolate(x0, noise, t)
                with autocast():
                    out = model(x_t, t, y, y_mask, batch["fps"].to(self.device), keep)
                loss += flow.loss(out, x_t, t, flow.velocity_target(x0, noise)).item()
            shape = tuple(video.shape[2:])
            name = f"val_loss/{shape[0]}x{shape[1]}x{shape[2]}"
            totals[name] += loss / len(self.timesteps) * n
            counts[name] += n
        if was_training:
            model.train()
        result = {name: totals[name] / counts[name] for name in totals}
        result["val_loss"] = sum(totals.values()) / max(sum(counts.values()), 1)
        return result
