"""Build the model and its frozen encoders from a config: shared by train, sample and export."""

from __future__ import annotations

import torch

from videodit.config import Config
from videodit.errors import UserError
from videodit.models.dit import DiTGeometry, STDiT
from videodit.models.text import build_text_encoder
from videodit.models.vae import build_vae


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto``, ``cpu`` or ``cuda``; with CUDA, the GPU of this process's ``local_rank``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cuda":
        return torch.device(name)
    if not torch.cuda.is_available():
        raise UserError("train.device=cuda but no GPU is visible; use train.device=cpu or auto")
    if local_rank >= torch.cuda.device_count():
        raise UserError(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible; start "
                        "fewer processes per node (torchrun --nproc-per-node)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def build_encoders(cfg: Config, device: torch.device):
    """The frozen VAE and text encoder (no gradients, eval mode)."""
    vae = build_vae(cfg.vae.kind, path=cfg.vae.path, subfolder=cfg.vae.subfolder,
                    scaling_factor=cfg.vae.scaling_factor, micro_batch=cfg.vae.micro_batch)
    text = build_text_encoder(cfg.text.kind, path=cfg.text.path, max_length=cfg.text.max_length,
                              dim=cfg.text.dim)
    return vae.to(device), text.to(device)


def model_geometry(cfg: Config, latent_channels: int, caption_channels: int) -> DiTGeometry:
    m = cfg.model
    return DiTGeometry(in_channels=latent_channels, caption_channels=caption_channels,
                       caption_length=cfg.text.max_length, depth=m.depth, hidden_size=m.hidden_size,
                       num_heads=m.num_heads, mlp_ratio=m.mlp_ratio, patch_size=tuple(m.patch_size),
                       qk_norm=m.qk_norm, pos_base_grid=m.pos_base_grid,
                       temporal_pos_embed=m.temporal_pos_embed, pooled_caption=m.pooled_caption)


def build_model(cfg: Config, vae, text) -> STDiT:
    return STDiT(model_geometry(cfg, vae.latent_channels, text.dim))
