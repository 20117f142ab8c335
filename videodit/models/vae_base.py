"""The interface every frozen VAE adapter implements (``models/vae.py``, ``models/stdit/opensora_vae.py``).

* ``latent_channels``, ``spatial_compression`` (pixels per latent along H and W) and
  ``temporal_compression`` (frames per latent frame; 1 for per-frame VAEs);
* ``latent_size(num_frames, height, width) -> (T', H', W')``;
* ``encode(video [B,3,T,H,W] in [-1,1]) -> latents [B,C,T',H',W']``, deterministic (posterior
  mode) and already normalised (shift subtracted, scaling factor applied);
* ``decode(latents, num_frames=None) -> video [B,3,T,H,W]`` clamped to [-1,1]. ``num_frames``
  is the encoded clip's length: optional where ``latent_size`` can be inverted (per-frame and
  causal 3-D VAEs; given, it is checked and the output cut to it), required where it cannot
  (Open-Sora 1.2's chunked VAE maps 13 to 16 frames all to 4 latent frames).

Adapters are frozen: parameters never require grad, they stay in eval mode even when a
parent module calls ``.train()``, and encode/decode run under ``torch.no_grad()``.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from videodit.errors import UserError


# Open-Sora 1.2's VAE cuts clips into pieces of this many frames (models/stdit/opensora_vae.py);
# the rule lives here because the planner counts latent frames without building that VAE.
CHUNK_FRAMES = 17


def clip_pieces(num_frames: int, chunk: int | None = CHUNK_FRAMES) -> list[int]:
    """Frame counts of the pieces a clip is encoded in: ``chunk`` frames each, the last one
    possibly shorter (``chunk=None``: the whole clip is one piece)."""
    if num_frames < 1:
        raise ValueError(f"num_frames must be at least 1, got {num_frames}")
    if chunk is None or num_frames <= chunk:
        return [num_frames]
    full, rest = divmod(num_frames, chunk)
    return [chunk] * full + ([rest] if rest else [])


def latent_frames(num_frames: int, chunk: int | None = CHUNK_FRAMES, factor: int = 4) -> int:
    """Latent frames for ``num_frames`` pixel frames: each piece (:func:`clip_pieces`) is
    front-padded to a multiple of ``factor`` and compressed ``factor``x. With the released VAE:
    1->1, 16->4, 17->5, 20->6, 51->15, 102->30. The planner uses this function too: one rule."""
    return sum(math.ceil(n / factor) for n in clip_pieces(num_frames, chunk))


def load_strict(module: nn.Module, tensors: dict[str, Tensor], *, where: str, fix: str, prefix: str = "",
                stranger: str = "is not in the architecture") -> None:
    """Load ``module`` (built on the meta device) from its ``prefix``ed ``tensors``, strictly: a
    missing, unexpected (``stranger`` says how) or mis-shaped tensor is a one-line error naming
    it and ``fix``."""
    expected = module.state_dict()
    given = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    wrong = sorted(k for k in set(expected) & set(given) if expected[k].shape != given[k].shape)
    if missing or unexpected or wrong:
        name = (missing or unexpected or wrong)[0]
        problem = "is missing" if missing else stranger if unexpected else \
            f"has shape {tuple(given[name].shape)}, the architecture wants {tuple(expected[name].shape)}"
        count = len(missing) + len(unexpected) + len(wrong)
        raise UserError(f"{where}: tensor {prefix}{name} {problem} ({count} such tensors); {fix}")
    module.load_state_dict(given, strict=True, assign=True)


class FrozenVAE(nn.Module):
    """Shared plumbing for all adapters: freezing, the per-frame size rule, input checks."""

    latent_channels: int
    spatial_compression: int
    temporal_compression: int
    # Most VAEs need H and W divisible by the compression; the SD-VAE floors other sizes.
    any_frame_size: bool = False

    def _freeze(self) -> None:
        self.requires_grad_(False)
        self.eval()

    @property
    def dtype(self):
        """The dtype of the weights (``vae.dtype``); adapters with weights only."""
        return next(self.parameters()).dtype

    @property
    def device(self):
        return next(self.parameters()).device

    def train(self, mode: bool = True) -> "FrozenVAE":
        # A parent model calling .train() must not flip dropout/norm layers of the frozen VAE.
        return super().train(False)

    def latent_size(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """Per-frame rule: T' = T, H' = H // s, W' = W // s."""
        s = self.spatial_compression
        return num_frames, height // s, width // s

    def _check_input(self, video: Tensor) -> None:
        if video.ndim != 5 or video.shape[1] != 3:
            raise ValueError(f"expected video [B,3,T,H,W], got shape {tuple(video.shape)}")
        s = self.spatial_compression
        h, w = video.shape[-2:]
        if self.any_frame_size and min(h, w) < s:
            raise UserError(f"frame size {h}x{w} is smaller than the VAE's spatial compression {s}")
        if not self.any_frame_size and (h % s or w % s):
            raise UserError(
                f"frame size {h}x{w} is not divisible by the VAE's spatial compression {s}; "
                f"use a height and width that are multiples of {s}"
            )

    def _check_num_frames(self, latents: Tensor, num_frames: int | None) -> None:
        """``num_frames`` (when given) must encode to the latents' frame count."""
        s = self.spatial_compression
        if num_frames is not None and self.latent_size(num_frames, s, s)[0] != latents.shape[2]:
            raise ValueError(f"{num_frames} frames do not encode to {latents.shape[2]} latent frames "
                             f"(they give {self.latent_size(num_frames, s, s)[0]})")

    def encode(self, video: Tensor) -> Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def decode(self, latents: Tensor, num_frames: int | None = None) -> Tensor:  # pragma: no cover
        raise NotImplementedError


__all__ = ["CHUNK_FRAMES", "FrozenVAE", "clip_pieces", "latent_frames", "load_strict"]
