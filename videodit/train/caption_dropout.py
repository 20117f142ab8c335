"""Caption dropout for a text encoder with a pooled vector (Open-Sora 2.0's T5 + CLIP): the tokens
and the pooled vector are dropped on draws of their own, each to the encoding of the empty caption,
as Open-Sora drops them (``utils/train.py`` ``dropout_condition``). Other encoders keep the model's
own drop (``Conditions.drop``)."""

from __future__ import annotations

import torch

from videodit.models.text_base import drop_to_empty


class EmptyCaptionDropout:
    """``diffusion.caption_dropout`` drops the tokens (the draw every family makes), and
    ``diffusion.pooled_caption_dropout`` (default: the same p) the pooled vector. The empty caption
    is encoded once, on first use (from a feature cache: read from the cache's stored encoding)."""

    def __init__(self, text, diffusion, encoding):
        self.text, self.encoding = text, encoding   # encoding(): the context the trainer encodes in
        p = diffusion.pooled_caption_dropout
        self.p_pooled = diffusion.caption_dropout if p is None else p
        self.empty = None

    def __call__(self, y, y_mask, pooled, drop: torch.Tensor, generator: torch.Generator):
        """(y, y_mask, pooled) with the dropped rows replaced; ``drop`` [B] the tokens' draw."""
        drop_pooled = (torch.rand(len(drop), generator=generator) < self.p_pooled).to(drop.device)
        if self.empty is None:
            with torch.no_grad(), self.encoding():
                y0, mask0 = self.text.encode([""])
                self.empty = (y0.float(), mask0, self.text.encode_pooled([""]).float())
        return drop_to_empty(y, y_mask, pooled, drop, drop_pooled, self.empty)
