"""Sequence parallelism for joint [text; image] attention (the MMDiT family), applied from outside
the model.

The blocks are ``block(img, txt, vec, rope[, text_mask]) -> (img, txt)``. As in
``full_attention.py`` (whose hooks this reuses), the image tokens are zero-padded to a multiple
of sp before the first block and every rank keeps its contiguous slice (of img and of every
per-token argument: the RoPE table); after the last block the image slices are gathered and the
padding dropped, so the embedders and the final layer run unchanged on the whole sequence. The
text stream is never sliced and never padded: every rank holds all caption tokens and runs the
text side of every block on them, so the text features never depend on the SP size (Open-Sora
cuts [text; image] into contiguous chunks instead, which needs (text + image) % sp == 0 and pads
the caption to get it).

Joint attention (``backend.joint``) gets q/k/v = [text; this rank's image slice]. With
sp = ulysses x ring:

- Ulysses: an all-to-all trades the image slice for a slice of the heads (the whole image);
  the text part, whole on every rank, is cut to the same heads locally; attention runs, the
  image output is traded back and the text output's heads are gathered over the Ulysses group.
- Ring: each rank's queries (all text, its image slice) attend to the text keys/values it holds
  and to the image keys/values travelling around the ring; the blocks merge by their
  log-sum-exp (``ring_attention.py``'s kernels and merge). Any sp.

Gradients: every collective's backward is its exact adjoint (the all-to-alls reverse, the text
heads' gather sums its gradient over the group and keeps this rank's heads), so the work every
rank repeats on the replicated text adds up over the SP ranks like any other part. With every SP
rank back-propagating the same loss, the image gather's backward passes sp x this rank's slice
and the data-parallel mean over the SP ranks gives the single-process gradient (as in
``sequence.py``). Padded image keys are never attended to; padded queries are dropped.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from videodit.models.layers import SDPA
from videodit.parallel.full_attention import FullAttentionBackend, FullAttentionSP, SequenceDim, _attention_modules
from videodit.parallel.ring_attention import (accumulation_dtype, block_backward, block_forward, merge, pick_kernel,
                                              ring_backward, ring_forward)
from videodit.parallel.sequence import _AllToAll


# ---------------------------------------------------------------------------- text heads

class _GatherHeads(torch.autograd.Function):
    """All-gather along the head dim (1) in group order; backward: the gradient summed over the
    group (each rank's copy feeds its own downstream work), this rank's heads kept."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        moved = x.movedim(1, 0).contiguous()
        out = moved.new_empty((dist.get_world_size(group) * moved.shape[0], *moved.shape[1:]))
        dist.all_gather_into_tensor(out, moved, group=group)
        return out.movedim(0, 1)

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        send = torch.stack([piece.contiguous() for piece in grad.chunk(size, dim=1)])
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=ctx.group)   # a reduce-scatter gloo can run
        return received.sum(0), None


# ---------------------------------------------------------------------------- the ring

def _text_bias(text_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """[B, 1, 1, Lt]: 0 where a caption key is attended, -inf where masked."""
    if text_mask is None:
        return None
    bias = torch.zeros(text_mask.shape, dtype=accumulation_dtype(dtype), device=text_mask.device)
    return bias.masked_fill(~text_mask.bool(), float("-inf"))[:, None, None, :]


def _text_forward(q, k, v, bias, scale: float, kernel: str):
    """The caption keys' block. The kernels take no mask: with one, it runs as plain maths (the
    caption is short); a query whose every caption key is masked gets 0 and LSE -inf."""
    if bias is None:
        return block_forward(q, k, v, scale, kernel)
    qa, ka, va = (t.to(bias.dtype) for t in (q, k, v))
    scores = torch.matmul(qa, ka.transpose(-2, -1)) * scale + bias
    lse = scores.logsumexp(dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(probs, va), lse, ()


def _text_backward(dout, q, k, v, out, lse, bias, scale: float, kernel: str, aux):
    if bias is None:
        return block_backward(dout, q, k, v, out, lse, scale, kernel, aux)
    qa, ka, va, douta, outa = (t.to(bias.dtype) for t in (q, k, v, dout, out))
    probs = torch.exp(torch.matmul(qa, ka.transpose(-2, -1)) * scale + bias - lse.unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-2, -1), douta)
    dscores = probs * (torch.matmul(douta, va.transpose(-2, -1)) - (douta * outa).sum(-1, keepdim=True))
    dq = torch.matmul(dscores, ka) * scale
    dk = torch.matmul(dscores.transpose(-2, -1), qa) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _JointRingAttention(torch.autograd.Function):
    """Queries [text; image slice] over the local caption keys and the ring's image keys."""

    @staticmethod
    def forward(ctx, q, text_k, text_v, image_k, image_v, bias, group, length: int, scale: float):
        kernel = pick_kernel(q)
        out, lse, aux = ring_forward(q, image_k, image_v, group, length, scale, kernel)
        # The caption last: the image keys always hold a real token, so the LSE is finite even
        # where every caption key is masked.
        text_out, text_lse, text_aux = _text_forward(q, text_k, text_v, bias, scale, kernel)
        out, lse = merge(out, lse, text_out, text_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, text_k, text_v, image_k, image_v, out, lse, bias)
        ctx.group, ctx.length, ctx.scale, ctx.kernel = group, length, scale, kernel
        ctx.aux, ctx.text_aux = aux, text_aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, text_k, text_v, image_k, image_v, out, lse, bias = ctx.saved_tensors
        dout = dout.contiguous()
        dq, text_dk, text_dv = _text_backward(dout, q, text_k, text_v, out, lse, bias, ctx.scale, ctx.kernel,
                                              ctx.text_aux or ctx.aux)
        dq = dq.to(accumulation_dtype(q.dtype))
        image_dk, image_dv = ring_backward(dout, q, image_k, image_v, out, lse, dq, ctx.group, ctx.length,
                                           ctx.scale, ctx.kernel, ctx.aux)
        return dq.to(q.dtype), text_dk, text_dv, image_dk, image_dv, None, None, None, None


def joint_ring_attention(q, text_k, text_v, image_k, image_v, group, length: int,
                         text_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of this rank's queries q [B, H, Lq, Dh] over the caption keys/values it holds
    (text_k/v [B, H, Lt, Dh], whole on every rank; ``text_mask`` [B, Lt], True: attended) and the
    image keys/values of every rank of ``group`` (image_k/v [B, H, m, Dh], this rank's contiguous
    block; tokens past ``length`` are padding). Returns [B, H, Lq, Dh]."""
    if length <= 0:
        raise ValueError(f"joint ring attention needs at least one image token, got length={length}")
    scale = 1.0 / math.sqrt(q.shape[-1])
    return _JointRingAttention.apply(q, text_k, text_v, image_k, image_v, _text_bias(text_mask, q.dtype), group,
                                     length, scale)


# ---------------------------------------------------------------------------- the plan

class JointAttentionBackend(FullAttentionBackend):
    """Joint [text; image] attention over the sharded image tokens (``plan.joint``); self-attention
    over a sharded sequence as ``full_attention.py``'s; any other kind local."""

    def joint(self, q, k, v, *, text_tokens: int, text_mask=None):
        return self.plan.joint(q, k, v, text_tokens, text_mask)


class JointAttentionSP(FullAttentionSP):
    """The SP plan of :func:`apply_joint_attention_sp`: ``full_attention.py``'s hooks on the image
    stream (argument 0), the tuple (img, txt) gathered after the last block."""

    def apply(self, blocks, sequence_args: Mapping[int | str, SequenceDim],
              attention_modules: Callable[[nn.Module], Iterable[nn.Module]] | None = None) -> None:
        super().apply(blocks, sequence_args, attention_modules)
        backend = JointAttentionBackend(self)
        for block in blocks:
            for module in (attention_modules or _attention_modules)(block):
                module.backend = backend

    def _gather(self, block, args, out):
        # The text stream is whole on every rank and every rank back-propagates the same loss: it
        # leaves as it is (its gradient, identical on the ranks, adds up to sp x, like the image's).
        img, *rest = out
        return (super()._gather(block, args, img), *rest)

    def joint(self, q, k, v, text_tokens: int, text_mask=None) -> torch.Tensor:
        """q, k, v: [B, heads, text_tokens + image slice, Dh] -> the output, same shape."""
        (tq, iq), (tk, ik), (tv, iv) = ((t[:, :, :text_tokens], t[:, :, text_tokens:]) for t in (q, k, v))
        ulysses = self.ulysses_group
        if ulysses is not None:
            heads = q.shape[1]
            if heads % self.ulysses_degree:
                raise ValueError(f"{heads} heads do not split over {self.ulysses_degree} Ulysses ranks")
            # Image: [B, H, n, Dh] -> [B, H/u, u*n, Dh]; text: the same H/u heads, cut locally.
            iq, ik, iv = (_AllToAll.apply(t, 1, 2, ulysses) for t in (iq, ik, iv))
            part = heads // self.ulysses_degree
            first = dist.get_rank(ulysses) * part
            tq, tk, tv = (t.narrow(1, first, part) for t in (tq, tk, tv))
        query = torch.cat([tq, iq], dim=2)
        if self.ring_group is not None:
            out = joint_ring_attention(query, tk, tv, ik, iv, self.ring_group, self.length, text_mask)
        else:   # Ulysses alone: the whole padded image is here; padded keys are left out
            keys = torch.cat([tk, ik[:, :, :self.length]], dim=2)
            values = torch.cat([tv, iv[:, :, :self.length]], dim=2)
            out = SDPA.joint(query, keys, values, text_tokens=text_tokens, text_mask=text_mask)
        text_out, image_out = out[:, :, :text_tokens], out[:, :, text_tokens:]
        if ulysses is not None:
            image_out = _AllToAll.apply(image_out, 2, 1, ulysses)
            text_out = _GatherHeads.apply(text_out, ulysses)
        return torch.cat([text_out, image_out], dim=2)


def apply_joint_attention_sp(blocks, sp, *, ring_degree: int, sequence_args: Mapping[int | str, SequenceDim],
                             attention_modules: Callable[[nn.Module], Iterable[nn.Module]] | None = None
                             ) -> JointAttentionSP:
    """Shard the image tokens over ``sp`` (ProcessGroup or 1-D DeviceMesh) around ``blocks`` (each
    ``block(img, txt, ...) -> (img, txt)``) and swap their attention backends for joint attention
    over [whole text; sharded image]: Ulysses over ``sp / ring_degree`` ranks, ring over
    ``ring_degree``. ``sequence_args`` as :func:`videodit.parallel.full_attention.apply_full_attention_sp`
    (MMDiT: ``{0: 1, 3: 0}``, img [B, L, D] and rope [L, ...]). Every rank of the world must call this."""
    plan = JointAttentionSP(sp, ring_degree=ring_degree)
    plan.apply(blocks, sequence_args, attention_modules)
    return plan
