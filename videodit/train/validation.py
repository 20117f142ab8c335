"""Validation loss on a held-out metadata CSV: the number keep-best ranks checkpoints by.

The rectified-flow loss is noisy because t and the noise are random. Here both are fixed:
every validation sample is scored at the same evenly spaced timesteps with the same noise
(seeded by the sample's index), so two evaluations differ only by the model's weights.
Losses are reported per bucket and overall.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from videodit.components import first_frame_features, first_frame_given
from videodit.config import Config
from videodit.data.feature_cache import CachedBatch, build_cached_validation_data
from videodit.data.loader import build_validation_data
from videodit.data.pixels import to_model_input
from videodit.diffusion.rectified_flow import RectifiedFlow
from videodit.models.families import spec_of
from videodit.models.spec import Conditions


class Validator:
    def __init__(self, cfg: Config, csv: str, *, device: torch.device, num_timesteps: int = 10,
                 max_samples: int = 256, conditions: tuple[str, ...] = ()):
        """``conditions``: what an i2v model takes from a feature cache's validation set (its given
        frame's latents, image features; ``data/feature_cache/conditions.py``)."""
        self.device = device
        self.timesteps = [(i + 0.5) / num_timesteps for i in range(num_timesteps)]
        if cfg.data.cache:   # the cache's validation set: no encoder is built to encode the CSV
            self.loader, self.size = build_cached_validation_data(cfg, csv, batch_size=cfg.train.batch_size,
                                                                  max_samples=max_samples, needed=conditions)
        else:
            self.loader, self.size = build_validation_data(cfg.data, csv, batch_size=cfg.train.batch_size,
                                                           seed=cfg.train.seed, max_samples=max_samples)

    @staticmethod
    def _within_range(flow: RectifiedFlow, u: float, ratio: float, n: int) -> torch.Tensor:
        """The fixed unshifted time ``u`` in [0, 1], mapped into ``diffusion.timestep_range`` when one
        is set (an expert's validation loss is over its own timesteps)."""
        edges = flow.cfg.timestep_range
        if edges is not None:
            lo, hi = (float(flow.unshift(torch.tensor(float(e), dtype=torch.float64), ratio)) for e in edges)
            u = lo + (hi - lo) * u
        return torch.full((n,), u)

    @torch.no_grad()
    def evaluate(self, model, vae, text, flow: RectifiedFlow, autocast, image_encoder=None) -> dict:
        """``{"val_loss": overall, "val_loss/<resolution>x<frames>": per bucket}``; ``image_encoder``:
        the image features of the given frame, for a model that embeds them (Wan 2.1 I2V)."""
        was_training = model.training
        model.eval()
        totals, counts = defaultdict(float), defaultdict(int)
        for index, batch in enumerate(self.loader):
            if isinstance(batch, CachedBatch):
                x0, y, y_mask = batch.features(self.device)
                size = batch.pixels
                first, image = batch.conditions(self.device)   # an i2v model's, from the cache
                pooled = batch.pooled_on(self.device)
                given = None if first is None else spec_of(model).first_frame_condition(first)
            else:
                video = to_model_input(batch.video, self.device)
                x0 = vae.encode(video)
                y, y_mask = text.encode(batch.text)
                pooled = text.encode_pooled(batch.text)
                size = tuple(video.shape[2:])
                given = first_frame_given(model, vae, video)
                image = first_frame_features(image_encoder, video)
            n = x0.shape[0]
            ratio = flow.shift_ratio(size[-2], size[-1], x0.shape[2], x0.shape[-2:])
            generator = torch.Generator().manual_seed(index)   # the same noise at every evaluation
            noise = torch.randn(x0.shape, generator=generator).to(self.device)
            keep = torch.zeros(n, dtype=torch.bool, device=self.device)
            cond = Conditions(y, y_mask, keep, batch.fps.to(self.device), *size[-2:], image=image, given=given,
                              pooled=pooled)
            loss = 0.0
            for t_value in self.timesteps:
                t = flow.shift(self._within_range(flow, t_value, ratio, n), ratio).to(self.device)
                x_t = flow.interpolate(x0, noise, t, flow.cfg.sigma_min)
                with autocast():
                    out = model(*spec_of(model).model_inputs(x_t, t, cond))
                loss += flow.loss(out, x_t, t, flow.velocity_target(x0, noise, flow.cfg.sigma_min)).item()
            name = f"val_loss/{size[0]}x{size[1]}x{size[2]}"
            totals[name] += loss / len(self.timesteps) * n
            counts[name] += n
        if was_training:
            model.train()
        result = {name: totals[name] / counts[name] for name in totals}
        result["val_loss"] = sum(totals.values()) / max(sum(counts.values()), 1)
        return result
