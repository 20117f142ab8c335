"""The interface every frozen text encoder adapter implements (``models/text.py``,
``models/wan/text.py``, the toy one): ``dim``, ``max_length`` and
``encode(captions) -> (embeddings float32 [B, max_length, dim], mask bool [B, max_length])``,
zero embeddings at padded positions. A leaf, so family folders can implement it without
importing the factories that load them."""

from __future__ import annotations

from torch import Tensor, nn


class FrozenTextEncoder(nn.Module):
    """Shared freezing behaviour for text encoder adapters."""

    dim: int
    max_length: int

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


def as_caption_list(captions: list[str] | str) -> list[str]:
    # A bare string would otherwise be iterated character by character.
    return [captions] if isinstance(captions, str) else list(captions)
