"""Inference: prompts in, videos out (Euler sampling with classifier-free guidance)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch

from videodit.data.video import write_video
from videodit.diffusion.rectified_flow import RectifiedFlow
from videodit.errors import UserError


@torch.no_grad()
def generate(model, vae, text, flow: RectifiedFlow, prompts: list[str], *, num_frames: int,
             height: int, width: int, steps: int, guidance: float, fps: float, seed: int,
             device: torch.device, batch_size: int = 16) -> np.ndarray:
    """Sample one clip per prompt: uint8 [N, T, H, W, 3]."""
    model.eval()
    clips = []
    generator = torch.Generator().manual_seed(seed)
    t_lat, h_lat, w_lat = vae.latent_size(num_frames, height, width)
    ratio = flow.shift_ratio(height, width, t_lat)
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        n = len(chunk)
        y, y_mask = text.encode(chunk)
        fps_t = torch.full((n,), float(fps), device=device)
        keep, drop = torch.zeros(n, dtype=torch.bool, device=device), torch.ones(n, dtype=torch.bool, device=device)
        noise = torch.randn((n, vae.latent_channels, t_lat, h_lat, w_lat), generator=generator).to(device)

        def cond(x, t):
            return flow.model_velocity(model(x, t, y, y_mask, fps_t, keep).float(), x, t)

        def uncond(x, t):
            return flow.model_velocity(model(x, t, y, y_mask, fps_t, drop).float(), x, t)

        latents = flow.sample(cond, noise, steps, ratio, guidance, uncond)
        video = vae.decode(latents)[:, :, :num_frames]               # [N, 3, T, H, W] in [-1, 1]
        frames = ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        clips.append(frames.permute(0, 2, 3, 4, 1).cpu().numpy())
    return np.concatenate(clips)


def slug(prompt: str, max_len: int = 48) -> str:
    return re.sub(r"[^a-z0-9]+", "_", prompt.lower()).strip("_")[:max_len] or "prompt"


def write_clips(out_dir: Path, prompts: list[str], clips: np.ndarray, fps: float, suffix: str = ".mp4") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (prompt, clip) in enumerate(zip(prompts, clips)):
        path = out_dir / f"{i:02d}-{slug(prompt)}{suffix}"
        write_video(path, clip, fps)
        paths.append(path)
    return paths


class Pipeline:
    """A trained model with its encoders and config, loaded from a checkpoint for sampling."""

    def __init__(self, ckpt_path: str | Path, device: str = "auto", use_ema: bool = True):
        from videodit.checkpoint import LoadedCheckpoint
        from videodit.components import build_encoders, build_model
        from videodit.config import from_yaml
        from videodit.models import load_pretrained
        from videodit.parallel.distributed import pick_device

        ckpt = LoadedCheckpoint(ckpt_path)
        self.cfg = from_yaml(ckpt.config_yaml(), f"the config of {ckpt.path}")
        self.device = pick_device(device)
        self.vae, self.text = build_encoders(self.cfg, self.device)
        stem = "ema" if use_ema and ckpt.has("ema") else "model"
        if ckpt.is_model_folder:   # an export: config.json (the model's arguments) + model.safetensors
            self.model = load_pretrained(ckpt.path, self.device)
        else:
            self.model = build_model(self.cfg, self.vae, self.text)
            self.model.load_state_dict(ckpt.tensors(stem))
        self.model.to(self.device).eval()
        self.flow = RectifiedFlow(self.cfg.diffusion)
        self.checkpoint = ckpt.path
        self.weights = stem

    def resolve(self, num_frames: int | None = None, height: int | None = None,
                width: int | None = None) -> dict[str, int]:
        """The clip size a call samples: what is given, else ``sample.*``, else ``data.*``."""
        data, sample = self.cfg.data, self.cfg.sample

        def pick(given, *defaults):
            return given if given is not None else next(d for d in defaults if d is not None)
        return {"num_frames": pick(num_frames, sample.num_frames, data.num_frames),
                "height": pick(height, sample.height, data.height), "width": pick(width, sample.width, data.width)}

    def __call__(self, prompts: list[str], *, num_frames: int | None = None, height: int | None = None,
                 width: int | None = None, steps: int | None = None, guidance: float | None = None,
                 fps: float | None = None, seed: int = 0) -> np.ndarray:
        sample = self.cfg.sample
        size = self.resolve(num_frames, height, width)
        steps = sample.steps if steps is None else steps
        guidance = sample.cfg if guidance is None else guidance
        if min(size.values()) < 1 or steps < 1 or not (math.isfinite(guidance) and guidance >= 0):
            raise UserError(f"cannot sample {size} with {steps} steps and guidance {guidance}: sizes and steps "
                            "must be 1 or more and guidance a finite number >= 0")
        return generate(self.model, self.vae, self.text, self.flow, prompts, **size, steps=steps,
                        guidance=guidance, fps=fps or sample.fps, seed=seed, device=self.device)
