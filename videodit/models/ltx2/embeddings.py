"""The small layers around LTX-2's attentions, under the release's module names: the time
embedding with its modulation projection (``AdaLayerNormSingle``), the LTX-2.0 caption projection
and the GELU-tanh feed-forward, plus the weightless norms and the table lookups a block uses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from videodit.models.layers import sinusoidal_embedding

TIME_FREQ_DIM = 256   # the sinusoid of sigma * 1000 ([cos, sin], PixArt-alpha's)


class _TwoLinears(nn.Module):
    """linear_1 -> activation -> linear_2 (the timestep embedder; PixArt's caption projection)."""

    def __init__(self, in_dim: int, hidden: int, activation: nn.Module):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, hidden)
        self.act = activation
        self.linear_2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class _TimestepEmbedding(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.timestep_embedder = _TwoLinears(TIME_FREQ_DIM, dim, nn.SiLU())


class AdaLNSingle(nn.Module):
    """Time values -> (``rows`` x dim of modulation, the dim-wide embedding), for values of any
    shape [B, n] (n = 1, or one per token): the MLP runs on each value."""

    def __init__(self, dim: int, rows: int):
        super().__init__()
        self.emb = _TimestepEmbedding(dim)
        self.linear = nn.Linear(dim, rows * dim)

    def forward(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """values [B, n] (already scaled: sigma * 1000) -> modulation [B, n, rows*dim], embedding [B, n, dim]."""
        embedder = self.emb.timestep_embedder
        features = sinusoidal_embedding(values.flatten(), TIME_FREQ_DIM).to(embedder.linear_1.weight.dtype)
        embedded = embedder(features)
        modulation = self.linear(F.silu(embedded))
        return modulation.unflatten(0, values.shape), embedded.unflatten(0, values.shape)


class CaptionProjection(_TwoLinears):
    """LTX-2.0: the connector's 3840-wide text to a stream's width (GELU-tanh between)."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__(in_dim, dim, nn.GELU(approximate="tanh"))


class _Project(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    """dim -> 4 dim (GELU-tanh) -> dim, named ``net.0.proj`` and ``net.2`` as released."""

    def __init__(self, dim: int):
        super().__init__()
        self.net = nn.Sequential(_Project(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """The blocks' weightless RMSNorm."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


def rows(table: torch.Tensor, modulation: torch.Tensor, first: int, count: int) -> list[torch.Tensor]:
    """Rows ``first .. first+count`` of a block's table plus the same rows of the time modulation
    [B, n, table_rows * dim] -> ``count`` tensors [B, n, dim] (n = 1 or per token)."""
    mod = modulation.unflatten(-1, (table.shape[0], -1))[:, :, first:first + count]
    return list((table[first:first + count].to(mod.dtype) + mod).unbind(2))


def modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift
