"""The interface every frozen text encoder adapter implements (``models/text.py``,
``models/wan/text.py``, the toy one): ``dim``, ``max_length`` and
``encode(captions) -> (embeddings float32 [B, max_length, dim], mask bool [B, max_length])``,
zero embeddings at padded positions, and, for encoders with a pooled caption vector beside the
tokens (Open-Sora 2.0's CLIP-L), ``pooled_dim`` and ``encode_pooled(captions) -> float32 [B,
pooled_dim]``. A leaf, so family folders can implement it without importing the factories that
load them."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class FrozenTextEncoder(nn.Module):
    """Shared freezing behaviour for text encoder adapters."""

    dim: int
    max_length: int
    pooled_dim: int | None = None   # the width of encode_pooled's vector; None: the encoder has none

    def _freeze(self) -> None:
        self.requires_grad_(False)
        self.eval()

    @property
    def device(self):
        """Where the weights are; adapters with weights only (the toy encoder has none)."""
        return next(self.parameters()).device

    def train(self, mode: bool = True) -> "FrozenTextEncoder":
        # A parent model calling .train() must not re-enable dropout in the frozen encoder.
        return super().train(False)

    def encode(self, captions: list[str]) -> tuple[Tensor, Tensor]:  # pragma: no cover
        raise NotImplementedError

    def encode_pooled(self, captions: list[str]) -> Tensor | None:
        """The pooled caption vectors [B, pooled_dim] (float32), or None for encoders without one."""
        return None


def drop_to_empty(y: Tensor, y_mask: Tensor, pooled: Tensor, drop: Tensor, drop_pooled: Tensor,
                  empty: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Caption dropout of an encoder with a pooled vector, as Open-Sora 2.0 drops T5 and CLIP
    (``utils/train.py`` ``dropout_condition``): the tokens of the samples in ``drop`` [B] and the
    pooled vectors of those in ``drop_pooled`` [B] (drawn independently) replaced by the encoding of
    the empty caption ``empty`` = (y, mask, pooled), each [1, ...]. Not zeros: the model learns the
    unconditional branch on what "" encodes to, which is what it samples it with."""
    empty_y, empty_mask, empty_pooled = (t.to(y.device) for t in empty)
    y = torch.where(drop[:, None, None], empty_y.to(y.dtype), y)
    y_mask = torch.where(drop[:, None], empty_mask, y_mask)
    pooled = torch.where(drop_pooled[:, None], empty_pooled.to(pooled.dtype), pooled)
    return y, y_mask, pooled


def as_caption_list(captions: list[str] | str) -> list[str]:
    # A bare string would otherwise be iterated character by character.
    return [captions] if isinstance(captions, str) else list(captions)
