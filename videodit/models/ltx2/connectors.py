"""LTX-2's frozen text side after Gemma (ltx-core ``text_encoders/gemma``), our own code: the
normalisation of Gemma's stacked hidden states, the aggregate projection and the
``Embeddings1DConnector`` each stream's text goes through before the DiT reads it.

1. **Normalisation** of the hidden states [B, T, D, L] (every layer of Gemma, embeddings first):
   LTX-2.0 per sample and per layer, over the valid tokens and all D channels: 8 (x - mean) /
   (max - min + 1e-6) (mean over T x D, eps 1e-6 on the count too); LTX-2.3 per token and per layer:
   x / sqrt(mean(x^2 over D) + 1e-6). Both flatten to [B, T, D * L] (channel-major, layer-minor)
   and zero the padding.
2. **Projection** (``text_embedding_projection.*``): LTX-2.0 one ``aggregate_embed`` (no bias, to
   Gemma's width) feeding both connectors; LTX-2.3 ``video_aggregate_embed`` and
   ``audio_aggregate_embed`` (with bias, to each stream's width), their inputs scaled by
   sqrt(out / D).
3. **Connector** (``*_embeddings_connector.*``): the valid tokens move to the front in their order,
   the positions after them take the learnable registers (register ``i % R`` at position ``i``), so
   no token is padding any more and the mask becomes all ones; then blocks of RMSNorm ->
   self-attention (q/k RMS-normalised across heads, 1-D RoPE at positions ``i / max_pos``, LTX-2.3
   gated) and RMSNorm -> GELU-tanh FFN, each added back, and a final weightless RMSNorm.

The layers are the DiT's (``attention.py``, ``embeddings.py``, ``rope.py``): the same names, so a
release's tensors load as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from videodit.models.ltx2.attention import Attention
from videodit.models.ltx2.embeddings import FeedForward, rms
from videodit.models.ltx2.rope import rope_table

EPS = 1e-6           # the norms' epsilon (ltx-core's rms_norm default)
ROPE_THETA = 10000.0  # ltx-core builds the connectors with its default theta, whatever the release says


@dataclass(frozen=True)
class ConnectorShape:
    heads: int
    head_dim: int
    layers: int
    registers: int | None       # None: no registers, the padding stays masked
    gated: bool                 # LTX-2.3: per-head gates on the attention output
    max_pos: int                # positions are i / max_pos (the releases: 4096)
    double_precision: bool      # the frequency grid in fp64 (the releases)

    @property
    def width(self) -> int:
        return self.heads * self.head_dim


class _Block(nn.Module):
    def __init__(self, s: ConnectorShape):
        super().__init__()
        self.attn1 = Attention(s.width, s.width, s.heads, s.head_dim, EPS, s.gated, "text")
        self.ff = FeedForward(s.width)

    def forward(self, x: torch.Tensor, mask, rope) -> torch.Tensor:
        x = x + self.attn1(rms(x, EPS), mask=mask, rope=rope)
        return x + self.ff(rms(x, EPS))


class Connector(nn.Module):
    """One stream's ``Embeddings1DConnector``: [B, T, width] features of right-padded tokens and
    their mask [B, T] -> [B, T, width] (every position a token when it has registers)."""

    def __init__(self, s: ConnectorShape):
        super().__init__()
        self.shape = s
        self.transformer_1d_blocks = nn.ModuleList(_Block(s) for _ in range(s.layers))
        if s.registers:
            self.learnable_registers = nn.Parameter(torch.empty(s.registers, s.width))

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, (b, t, _) = self.shape, x.shape
        mask = None
        if s.registers:
            if t % s.registers:
                raise ValueError(f"{t} text tokens are not a multiple of the connector's {s.registers} registers")
            registers = self.learnable_registers.to(x.dtype).repeat(t // s.registers, 1)
            x = torch.where(valid[..., None], x, registers.expand(b, -1, -1))
            valid = torch.ones_like(valid)
        else:   # the padding stays out of the attention
            mask = torch.zeros(b, 1, 1, t, dtype=x.dtype, device=x.device).masked_fill(
                ~valid[:, None, None, :], torch.finfo(x.dtype).min)
        position = torch.arange(t, dtype=torch.float32, device=x.device).expand(b, 1, t)
        bounds = torch.stack([position, position], dim=-1)   # each token at i exactly
        rope = rope_table(bounds, (s.max_pos,), s.width, s.heads, ROPE_THETA, s.double_precision)
        for block in self.transformer_1d_blocks:
            x = block(x, mask, rope)
        return rms(x, EPS), valid


def valid_first(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The valid tokens of each sample moved to the front in their order ([B, T, C], [B, T] bool):
    Gemma's left padding becomes the connectors' right padding."""
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    return torch.gather(x, 1, order[..., None].expand_as(x)), torch.gather(valid, 1, order)


def normalise(hidden: torch.Tensor, valid: torch.Tensor, per_token: bool) -> torch.Tensor:
    """Gemma's hidden states [B, T, D, L] -> [B, T, D * L] (module docstring, step 1), pads zero."""
    b, t, d, n = hidden.shape
    keep = valid[:, :, None, None]
    if per_token:   # LTX-2.3
        normed = hidden * torch.rsqrt(hidden.pow(2).mean(dim=2, keepdim=True) + EPS)
    else:           # LTX-2.0
        count = (valid.sum(dim=1) * d).view(b, 1, 1, 1)
        mean = hidden.masked_fill(~keep, 0.0).sum(dim=(1, 2), keepdim=True) / (count + EPS)
        low = hidden.masked_fill(~keep, math.inf).amin(dim=(1, 2), keepdim=True)
        high = hidden.masked_fill(~keep, -math.inf).amax(dim=(1, 2), keepdim=True)
        normed = 8 * (hidden - mean) / (high - low + EPS)
    return normed.reshape(b, t, d * n).masked_fill(~valid[..., None], 0.0)


class TextProjection(nn.Module):
    """``text_embedding_projection``: LTX-2.0's ``aggregate_embed`` or LTX-2.3's per-stream pair."""

    def __init__(self, features: int, gemma_width: int, per_stream: tuple[int, int | None] | None):
        """``per_stream`` (LTX-2.3): the video and audio widths (audio None: no audio projection)."""
        super().__init__()
        self.gemma_width, self.per_stream = gemma_width, per_stream is not None
        if per_stream is None:
            self.aggregate_embed = nn.Linear(features, gemma_width, bias=False)
        else:
            self.video_aggregate_embed = nn.Linear(features, per_stream[0])
            if per_stream[1] is not None:
                self.audio_aggregate_embed = nn.Linear(features, per_stream[1])

    def forward(self, hidden: torch.Tensor, valid: torch.Tensor, audio: bool):
        """[B, T, D, L] hidden states -> (video features, audio features or None)."""
        normed = normalise(hidden, valid, self.per_stream).to(hidden.dtype)
        if not self.per_stream:
            video = self.aggregate_embed(normed)
            return video, video if audio else None

        def project(linear: nn.Linear) -> torch.Tensor:
            return linear(normed * math.sqrt(linear.out_features / self.gemma_width))

        return project(self.video_aggregate_embed), project(self.audio_aggregate_embed) if audio else None


class TextSide(nn.Module):
    """What a release holds after Gemma: the projection and the video (and audio) connector."""

    def __init__(self, projection: TextProjection, video: ConnectorShape, audio: ConnectorShape | None):
        super().__init__()
        self.text_embedding_projection = projection
        self.video_embeddings_connector = Connector(video)
        self.audio_embeddings_connector = Connector(audio) if audio is not None else None

    def forward(self, hidden: torch.Tensor, valid: torch.Tensor):
        """[B, T, D, L] hidden states of left-padded tokens, their mask [B, T] -> (video [B, T, Wv],
        audio [B, T, Wa] or None, mask [B, T]): the connectors' token order (valid first)."""
        audio = self.audio_embeddings_connector is not None
        video_x, audio_x = self.text_embedding_projection(hidden, valid, audio)
        video_x, ordered = valid_first(video_x, valid)
        video, mask = self.video_embeddings_connector(video_x, ordered)
        video = video * mask[..., None].to(video.dtype)
        audio_out = None
        if audio:
            audio_out = self.audio_embeddings_connector(valid_first(audio_x, valid)[0], ordered)[0]
        return video, audio_out, mask


__all__ = ["Connector", "ConnectorShape", "TextProjection", "TextSide", "normalise", "valid_first"]
