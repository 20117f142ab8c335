"""The FLOP model of an STDiT (``models/stdit/model.py``), part by part (see
``models/flop_count.py`` for what is counted). ``tests/models/test_flops.py`` holds it against
FlopCounterMode on real models."""

from __future__ import annotations

from videodit.models.flop_count import FlopCount
from videodit.models.stdit.model import DiTGeometry

# The sin/cos feature width of the time and fps embedders (layers.ScalarEmbedder's default).
SCALAR_FEATURES = 256


def patch_grid(geometry: DiTGeometry, frames: int, height: int, width: int) -> tuple[int, int, int]:
    """(T', H', W') of a latent (frames, height, width): padded up to the patch, as STDiT.embed does."""
    pt, ph, pw = geometry.patch_size
    return -(-frames // pt), -(-height // ph), -(-width // pw)


def grid_flops(geometry: DiTGeometry, frames: int, positions: int, caption_tokens: int,
               fps: bool = True) -> FlopCount:
    """Forward FLOPs of one sample on the patched grid, ``frames`` (T') x ``positions`` (S = H' W'),
    with captions padded to ``caption_tokens``; ``fps``: the fps embedder runs (the Trainer's steps)."""
    g, d = geometry, geometry.hidden_size
    tokens, length = frames * positions, caption_tokens
    patch = tokens * 2 * d * _patch_values(g)           # the Conv3d in, the final projection out
    scalar = 2 * (SCALAR_FEATURES * d + d * d)          # one ScalarEmbedder MLP
    data_fed = patch + 2 * SCALAR_FEATURES * d * (1 + fps)
    embed = (patch + scalar * (1 + fps) + 2 * d * 6 * d                 # t (and fps) embedders, t_block
             + length * 2 * (g.caption_channels * d + d * d)            # caption MLP
             + (4 * d * d if g.pooled_caption else 0))                  # pooled caption MLP
    attention = [_attention(g, frames, positions, length, temporal=i % 2 == 1) for i in range(2 * g.depth)]
    blocks = tuple(_block_linears(g, tokens, length) + a for a in attention)
    return FlopCount(float(embed), blocks, float(patch), tuple(float(a) for a in attention), float(data_fed))


def _patch_values(g: DiTGeometry) -> int:
    return g.in_channels * g.patch_size[0] * g.patch_size[1] * g.patch_size[2]


def _block_linears(g: DiTGeometry, tokens: int, length: int) -> float:
    """Every linear layer of one block. adaLN-single has none per block (a table added to t_mod)."""
    d, hidden = g.hidden_size, int(g.hidden_size * g.mlp_ratio)
    self_attention = 4 * tokens * 2 * d * d                # q, k, v, proj
    cross = 2 * tokens * 2 * d * d + 2 * length * 2 * d * d   # q, proj over the video; k, v over the caption
    mlp = tokens * 2 * 2 * d * hidden                      # fc1, fc2
    return float(self_attention + cross + mlp)


def _attention(g: DiTGeometry, frames: int, positions: int, length: int, temporal: bool) -> float:
    """QK^T and AV (2 x 2 x q_len x k_len x D per sequence) of self- and cross-attention."""
    d = g.hidden_size
    sequences, seq_len = (positions, frames) if temporal else (frames, positions)
    return float(4 * d * (sequences * seq_len * seq_len + frames * positions * length))
