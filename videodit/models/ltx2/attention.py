"""LTX-2's attention layer, one class for all six kinds in a block (ltx-core ``attention.py``).

Queries from ``x``, keys and values from ``context`` (``x`` itself for self-attention); q and k
are RMS-normalised across all heads (weights of the whole width, as Wan), then rotated by RoPE;
LTX-2.3 scales each head's output by 2 sigmoid(logit), the logits a projection of ``x``.
Module names are the release's (``to_q``, ``q_norm``, ``to_out.0``, ``to_gate_logits``).

``kind`` tells the swappable :class:`~videodit.models.layers.AttentionBackend` which attention
asks, so that sequence parallelism over the video tokens can treat each (``self``: video tokens
with video tokens; ``audio_self``; ``cross``: text keys; ``a2v``: video queries, audio keys;
``v2a``: audio queries, video keys).
"""

from __future__ import annotations

import torch
from torch import nn

from videodit.models.layers import SDPA, AttentionBackend, merge_heads, split_heads
from videodit.models.ltx2.rope import Table, rotate

KINDS = ("self", "audio_self", "cross", "a2v", "v2a")


class AcrossHeadsRMSNorm(nn.Module):
    """ltx-core's q/k ``torch.nn.RMSNorm`` over the whole projection (all heads), computed in fp32
    and returned in the input's dtype, as plain tensor ops: under tensor parallelism the input
    and weight are DTensors sharded by heads and the mean of squares becomes one all-reduce
    (``parallel/tensor.py``'s ``sharded_norms``; DTensor has no sharded ``rms_norm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, query_dim: int, context_dim: int, heads: int, head_dim: int, eps: float, gated: bool,
                 kind: str):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.head_dim, self.kind = heads, head_dim, kind
        self.q_norm = AcrossHeadsRMSNorm(inner, eps)
        self.k_norm = AcrossHeadsRMSNorm(inner, eps)
        self.to_q = nn.Linear(query_dim, inner)
        self.to_k = nn.Linear(context_dim, inner)
        self.to_v = nn.Linear(context_dim, inner)
        self.to_gate_logits = nn.Linear(query_dim, heads) if gated else None
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim)])
        self.backend: AttentionBackend = SDPA

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                rope: Table | None = None, k_rope: Table | None = None) -> torch.Tensor:
        """x [B, T, query_dim], context [B, S, context_dim] (None: x), mask additive [B, 1, 1, S] or
        None, rope (cos, sin) for q (and k, unless ``k_rope``) -> [B, T, query_dim]."""
        context = x if context is None else context
        # The head count comes from the width (split_heads), so a tensor-parallel shard of the heads
        # runs the same code; the q/k norms then see this rank's columns only (parallel/ reduces them)
        # and parallel/ hands in this rank's heads of the RoPE tables (one frequency band per head).
        q = split_heads(self.q_norm(self.to_q(x)), self.head_dim)
        k = split_heads(self.k_norm(self.to_k(context)), self.head_dim)
        v = split_heads(self.to_v(context), self.head_dim)
        if rope is not None:
            q, k = rotate(q, rope), rotate(k, rope if k_rope is None else k_rope)
        out = self.backend(q, k, v, kind=self.kind, attn_mask=mask)       # [B, H, T, Dh]
        if self.to_gate_logits is not None:
            # 2 sigmoid: zero logits leave the heads as they are
            gates = 2.0 * torch.sigmoid(self.to_gate_logits(x))             # [B, T, H]
            out = out * gates.transpose(1, 2).unsqueeze(-1)
        return self.to_out[0](merge_heads(out))
