"""Building blocks of the spatial-temporal DiT: attention, MLP, adaLN, embedders, RoPE.

Attention goes through an :class:`AttentionBackend`. The model never asks whether it runs
in parallel; ``videodit.parallel`` swaps the backend of every attention module instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class AttentionBackend:
    """Computes attention over ``q, k, v`` of shape [batch, heads, tokens, head_dim].

    ``kind`` says which attention of the block is asking ("spatial", "temporal" or
    "cross"), so a sequence-parallel backend can decide how to exchange tokens.
    """

    def __call__(self, q, k, v, *, kind: str, attn_mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

    def joint(self, q, k, v, *, text_tokens: int, text_mask=None):
        """Attention over one sequence of ``text_tokens`` caption tokens followed by image tokens
        (the MMDiT's [text; image]); ``text_mask`` [B, text_tokens] bool (True: attended) masks
        caption keys, every image key is attended. A sequence-parallel backend keeps the text
        whole on every rank and shards the image tokens."""
        mask = None
        if text_mask is not None:
            image = text_mask.new_ones(text_mask.shape[0], k.shape[2] - text_tokens)
            mask = torch.cat([text_mask.bool(), image.bool()], dim=1)[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


SDPA = AttentionBackend()


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class RotaryEmbedding(nn.Module):
    """Rotary position embedding over one axis (the temporal one in this model)."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [len(positions), head_dim] for :func:`apply_rotary`."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [..., tokens, head_dim] by the angles of each token (half-split convention)."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[n, tokens, heads * head_dim] -> [n, heads, tokens, head_dim].

    The head count comes from the width, so a tensor-parallel shard (a slice of the
    heads) goes through the same code as the whole projection.
    """
    n, length, _ = x.shape
    return x.view(n, length, -1, head_dim).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[n, heads, tokens, head_dim] -> [n, tokens, heads * head_dim]."""
    n, heads, length, head_dim = x.shape
    return x.transpose(1, 2).reshape(n, length, heads * head_dim)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qk_norm: bool, kind: str):
        super().__init__()
        self.head_dim = dim // num_heads
        self.kind = kind
        # Separate projections (not one fused qkv) so that tensor parallelism can shard
        # each by heads: a column split of a fused weight would mix q, k and v.
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(self.head_dim, eps=1e-6) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)
        self.backend: AttentionBackend = SDPA

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x: [sequences, tokens, dim]; attention runs within each sequence."""
        n, length, _ = x.shape
        q, k, v = (split_heads(proj(x), self.head_dim) for proj in (self.q, self.k, self.v))
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = self.backend(q, k, v, kind=self.kind)
        return self.proj(merge_heads(out))


class CrossAttention(nn.Module):
    """Video tokens attend to caption tokens; padded caption tokens are masked out."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.head_dim = dim // num_heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.backend: AttentionBackend = SDPA

    def forward(self, x: torch.Tensor, y: torch.Tensor, y_mask: torch.Tensor):
        """x: [B, N, dim] video tokens; y: [B, L, dim] caption tokens; y_mask: [B, L] bool."""
        q = split_heads(self.q(x), self.head_dim)
        k, v = split_heads(self.k(y), self.head_dim), split_heads(self.v(y), self.head_dim)
        out = self.backend(q, k, v, kind="cross", attn_mask=y_mask[:, None, None, :])
        return self.proj(merge_heads(out))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, out: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, out or dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def sinusoidal_embedding(values: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """[N] scalars -> [N, dim] sin/cos features (the DiT timestep embedding)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32,
                                                          device=values.device) / half)
    args = values.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ScalarEmbedder(nn.Module):
    """Embeds a scalar per sample (diffusion time, fps) with sin/cos features and an MLP.

    ``round_to``: round ``values * scale`` to this dtype first. Open-Sora casts t*1000 to the
    model's dtype before embedding, so in bf16 its models were trained on rounded timesteps
    (870 -> 872)."""

    def __init__(self, dim: int, freq_dim: int = 256, scale: float = 1.0, round_to: torch.dtype | None = None):
        super().__init__()
        self.freq_dim = freq_dim
        self.scale = scale
        self.round_to = round_to
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        values = values * self.scale
        if self.round_to is not None:
            values = values.to(self.round_to)
        features = sinusoidal_embedding(values, self.freq_dim)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


def sincos_2d(height: int, width: int, dim: int, base_grid: int, device=None) -> torch.Tensor:
    """[H*W, dim] 2D sin/cos positions for any grid size and aspect ratio.

    Coordinates are scaled so that a grid of ``base_grid`` x ``base_grid`` patches spans
    [0, base_grid) on both axes and other sizes stretch proportionally to their area
    (Open-Sora's interpolated positions): the model sees the same range of positions at
    every resolution, and the aspect ratio is kept.
    """
    scale = base_grid / math.sqrt(height * width)
    rows = torch.arange(height, dtype=torch.float32, device=device) * scale
    cols = torch.arange(width, dtype=torch.float32, device=device) * scale
    grid_r, grid_c = torch.meshgrid(rows, cols, indexing="ij")
    emb_r = sinusoidal_embedding(grid_r.flatten(), dim // 2)
    emb_c = sinusoidal_embedding(grid_c.flatten(), dim // 2)
    return torch.cat([emb_r, emb_c], dim=-1)


OPENSORA_BASE_PIXELS = 512   # STDiT3's input_sq_size: the clip side at which positions are unscaled


def opensora_sincos_2d(height: int, width: int, dim: int, pixel_height: float, pixel_width: float,
                       device=None) -> torch.Tensor:
    """[H*W, dim] positions of Open-Sora 1.2's ``PositionEmbedding2D``, op for op.

    Both axes span ``round(sqrt(H*W))`` grid units divided by ``sqrt(pixel_height*pixel_width)/512``,
    so the table depends on the clip's pixel size, not only on the latent grid (which may be
    padded to the patch). Features are ``[sin(col), cos(col), sin(row), cos(row)]``.
    """
    scale = (pixel_height * pixel_width) ** 0.5 / OPENSORA_BASE_PIXELS
    base_size = round((height * width) ** 0.5)
    half = dim // 2
    inv_freq = 1.0 / (10000 ** (torch.arange(0, half, 2, device=device).float() / half))
    rows = torch.arange(height, device=device) / scale
    cols = torch.arange(width, device=device) / scale
    rows *= base_size / height
    cols *= base_size / width

    def sin_cos(values):
        angles = values[:, None] * inv_freq[None]
        return torch.cat([angles.sin(), angles.cos()], dim=-1)

    return torch.cat([sin_cos(cols.repeat(height)), sin_cos(rows.repeat_interleave(width))], dim=-1)
