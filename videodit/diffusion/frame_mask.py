"""Frame masks for image and video conditioning, as Open-Sora 1.2 trains them.

A mask is bool [B, T'] over latent frames: True = generated (noised, in the loss), False =
given (kept clean, modulated as t=0, left out of the loss). ``mask_ratios`` names how often
each kind of mask is drawn, with Open-Sora's names (its spelling ``intepolate`` included, so
its stage configs can be pasted as written); whatever the ratios leave is ``identity`` (every
frame generated). Unlike Open-Sora's ``MaskGenerator``, draws come from a torch generator
seeded per batch, so a resumed run draws the same masks.
"""

from __future__ import annotations

import math

import torch

from videodit.errors import UserError

KINDS = ("identity", "quarter_random", "quarter_head", "quarter_tail", "quarter_head_tail", "image_random",
         "image_head", "image_tail", "image_head_tail", "random", "intepolate")


def check_mask_ratios(ratios: dict | None) -> dict[str, float] | None:
    """``ratios`` with ``identity`` filled in, or a UserError naming what is wrong."""
    if ratios is None:
        return None
    if not isinstance(ratios, dict):
        raise UserError(f"diffusion.mask_ratios must be a mapping of mask kind -> probability, got {ratios!r}")
    unknown = sorted(set(ratios) - set(KINDS))
    if unknown:
        raise UserError(f"diffusion.mask_ratios has unknown kind(s) {', '.join(unknown)}; "
                        f"choose from {', '.join(KINDS)}")
    if any(not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1 for v in ratios.values()):
        raise UserError(f"diffusion.mask_ratios values must be probabilities in [0, 1], got {ratios}")
    filled = {k: float(v) for k, v in ratios.items()}
    filled.setdefault("identity", 1.0 - sum(filled.values()))
    if filled["identity"] < -1e-6 or not math.isclose(sum(filled.values()), 1.0, abs_tol=1e-6):
        raise UserError(f"diffusion.mask_ratios must sum to at most 1 (identity takes the rest), got "
                        f"{sum(v for k, v in ratios.items())}")
    return filled


def _randint(low: int, high: int, generator: torch.Generator) -> int:
    """An integer in [low, high], both included (as Python's ``random.randint``)."""
    return int(torch.randint(low, high + 1, (1,), generator=generator))


def draw_mask(kind: str, frames: int, generator: torch.Generator) -> torch.Tensor:
    """One [frames] mask of ``kind``; conditions at most a quarter of the frames for the
    ``quarter_*`` kinds. A single frame is always generated."""
    mask = torch.ones(frames, dtype=torch.bool)
    if frames <= 1 or kind == "identity":
        return mask
    quarter = max(1, frames // 4)
    size = 1 if kind.startswith("image_") else _randint(1, quarter, generator) if kind.startswith("quarter_") else 0
    if kind.endswith("_random"):
        start = _randint(0, frames - size, generator)
        mask[start:start + size] = False
    if kind.endswith("_head") or kind.endswith("_head_tail"):
        mask[:size] = False
    if kind.endswith("_tail"):
        mask[-size:] = False
    if kind == "intepolate":   # every other frame given: interpolation
        mask[_randint(0, 1, generator)::2] = False
    if kind == "random":
        ratio = 0.1 + 0.8 * float(torch.rand(1, generator=generator))
        mask = torch.rand(frames, generator=generator) > ratio
        if not mask.any():
            mask[-1] = True
    return mask


def draw_masks(ratios: dict[str, float], batch: int, frames: int, generator: torch.Generator) -> torch.Tensor:
    """[batch, frames] masks, each of a kind drawn with ``ratios`` (from ``check_mask_ratios``)."""
    kinds = list(ratios)
    weights = torch.tensor([ratios[k] for k in kinds], dtype=torch.float64).clamp(min=0)
    picks = torch.multinomial(weights, batch, replacement=True, generator=generator)
    return torch.stack([draw_mask(kinds[i], frames, generator) for i in picks.tolist()])


class FrameConditioning:
    """Training with given frames (``diffusion.mask_ratios``): per batch, draw the masks over
    patched frames, keep the given latent frames clean, and leave them out of the loss."""

    def __init__(self, ratios: dict, frames_per_patch: int):
        self.ratios = check_mask_ratios(ratios)
        self.frames_per_patch = frames_per_patch

    def latent_mask(self, x_mask: torch.Tensor, latent_frames: int) -> torch.Tensor:
        """A mask over patched frames [B, T'] -> over latent frames [B, T]."""
        return x_mask.repeat_interleave(self.frames_per_patch, dim=1)[:, :latent_frames]

    def apply(self, x_t: torch.Tensor, x0: torch.Tensor,
              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_t with the given frames clean, the model's x_mask [B, T'])."""
        frames = x0.shape[2]
        patched = -(-frames // self.frames_per_patch)
        x_mask = draw_masks(self.ratios, x0.shape[0], patched, generator).to(x0.device)
        latent = self.latent_mask(x_mask, frames)[:, None, :, None, None]
        return torch.where(latent, x_t, x0), x_mask

    def loss(self, loss_fn):
        """``loss_fn(output, x_t, t, target, frame_mask)`` taking the model's x_mask instead."""
        def masked(output, x_t, t, target, x_mask=None):
            mask = None if x_mask is None else self.latent_mask(x_mask, output.shape[2])
            return loss_fn(output, x_t, t, target, mask)
        return masked
