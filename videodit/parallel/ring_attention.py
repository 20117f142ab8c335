"""Ring attention: full (non-causal) attention over a sequence split in contiguous blocks
over a process group (rank r holds queries, keys and values of tokens [r*m, (r+1)*m)).

Forward: each rank keeps its queries; the K/V blocks travel around the ring point to point
(rank r sends to r+1, receives from r-1; the next block is in flight while this one is
computed). Every block gives a partial output and its log-sum-exp (LSE); partials over
disjoint key sets merge exactly (:func:`merge`). Backward rings again: with the final output
and LSE each block's gradient is exact on its own (softmax uses the global LSE), so dQ adds up
locally while each block's dK/dV accumulator travels with the block and, after a full turn,
arrives home. Per rank the memory stays O(m): its own q/k/v/out/LSE plus two blocks in flight.

Padding: tokens at or past ``length`` are padding (the sequence was padded to split evenly).
Padding sits at the end, so a block's keys are cut to their valid prefix (a block that is
all padding is skipped); padded queries compute something finite that the caller drops.

Kernels (all return the LSE): ``_scaled_dot_product_flash_attention_for_cpu`` on CPU; on CUDA
flash attention for fp16/bf16, memory-efficient attention otherwise; a plain math version
anywhere else. None takes a mask, and none needs one: padded keys are sliced off.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

_aten = torch.ops.aten


# ---------------------------------------------------------------------------- block kernels

def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)   # fp32, or fp64 for fp64


def pick_kernel(q: torch.Tensor) -> str:
    head_dim = q.shape[-1]
    if q.device.type == "cpu":
        return "cpu_flash"
    if q.device.type == "cuda" and head_dim % 8 == 0:
        if q.dtype in (torch.float16, torch.bfloat16) and head_dim <= 256:
            return "flash"
        return "efficient"
    return "math"


def block_forward(q, k, v, scale: float, kernel: str):
    """Attention of ``q`` over one key block: (out, LSE [B, H, Lq] in fp32 or fp64, aux for backward)."""
    if kernel == "cpu_flash":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
        return out, lse, ()
    if kernel == "flash":
        out, lse, _, _, _, _, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, False, False, scale=scale)
        return out, lse, (seed, offset)
    if kernel == "efficient":
        out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, False, scale=scale)
        # CUDA pads the LSE to a multiple of 32 queries; its backward wants that length back.
        return out, lse[..., :q.shape[2]], (seed, offset, lse.shape[-1])
    qa, ka, va = (t.to(accumulation_dtype(q.dtype)) for t in (q, k, v))
    scores = torch.matmul(qa, ka.transpose(-2, -1)) * scale
    lse = scores.logsumexp(dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), va), lse, ()


def block_backward(dout, q, k, v, out, lse, scale: float, kernel: str, aux):
    """dq, dk, dv of one key block, given the FINAL ``out`` and ``lse`` over all keys."""
    if kernel == "cpu_flash":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, False, scale=scale)
    if kernel == "flash":   # dropout is 0: the rng state in aux is passed through, never read
        seed, offset = aux
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, False, seed, offset,
            scale=scale)
    if kernel == "efficient":
        seed, offset, lse_len = aux
        lse = F.pad(lse, (0, lse_len - lse.shape[-1])).contiguous()
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], False,
            scale=scale)
        return dq, dk, dv
    qa, ka, va, douta, outa = (t.to(accumulation_dtype(q.dtype)) for t in (q, k, v, dout, out))
    probs = torch.exp(torch.matmul(qa, ka.transpose(-2, -1)) * scale - lse.unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-2, -1), douta)
    dprobs = torch.matmul(douta, va.transpose(-2, -1))
    dscores = probs * (dprobs - (douta * outa).sum(-1, keepdim=True))
    dq = torch.matmul(dscores, ka) * scale
    dk = torch.matmul(dscores.transpose(-2, -1), qa) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge(out, lse, block_out, block_lse):
    """Merge two attentions of the same queries over disjoint keys, in fp32 at least
    (``out``/``lse`` None: the first block). out = (e^lse out + e^blse bout) / (e^lse + e^blse),
    written with sigmoids so that no exponential overflows."""
    dtype = accumulation_dtype(block_out.dtype)
    block_out, block_lse = block_out.to(dtype), block_lse.to(dtype)
    if out is None:
        return block_out, block_lse
    out = out - torch.sigmoid(block_lse - lse).unsqueeze(-1) * (out - block_out)
    return out, lse - F.logsigmoid(lse - block_lse)


def valid_keys(length: int, block: int, block_len: int) -> int:
    """How many of ``block``'s keys are real tokens (not padding)."""
    return max(0, min(block_len, length - block * block_len))


# ---------------------------------------------------------------------------- the ring

def _block_keys(kv: torch.Tensor, valid: int):
    """k and v of a stacked [2, B, H, m, d] block, cut to their ``valid`` real tokens."""
    if valid == kv.shape[3]:
        return kv[0], kv[1]
    return kv[0, :, :, :valid].contiguous(), kv[1, :, :, :valid].contiguous()


def _pass_on(tensor: torch.Tensor, group):
    """Send ``tensor`` to the next rank and receive the previous rank's; returns what to wait on.
    Every rank posts its exchanges in the same order, so sends and receives pair up in order."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    send_to, receive_from = (dist.get_global_rank(group, (rank + step) % size) for step in (1, -1))
    received = torch.empty_like(tensor)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, send_to, group),
                                    dist.P2POp(dist.irecv, received, receive_from, group)])
    return works, tensor, received   # the sent tensor is kept alive until the wait


def _arrived(pending) -> torch.Tensor:
    works, _, received = pending
    for work in works:
        work.wait()
    return received


def ring_forward(q, k, v, group, length: int, scale: float, kernel: str):
    """The ring's forward: q [B, H, Lq, Dh] over this rank's key/value block k, v [B, H, block, Dh]
    and the others', which arrive around the ring (of ``length`` true keys in all); returns the
    merged output (accumulation dtype), its log-sum-exp and the kernel's auxiliary state."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    block_len, kv = k.shape[2], torch.stack((k, v))   # one message per step
    out = lse = None
    aux = ()
    for step in range(size):
        pending = _pass_on(kv, group) if step + 1 < size else None
        valid = valid_keys(length, (rank - step) % size, block_len)
        if valid:
            block_out, block_lse, block_aux = block_forward(q, *_block_keys(kv, valid), scale, kernel)
            aux = aux or block_aux
            out, lse = merge(out, lse, block_out, block_lse)
        if pending is not None:
            kv = _arrived(pending)
    return out, lse, aux


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, length: int, scale: float):
        kernel = pick_kernel(q)
        out, lse, aux = ring_forward(q, k, v, group, length, scale, kernel)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.length, ctx.scale, ctx.kernel, ctx.aux = group, length, scale, kernel, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq = torch.zeros_like(q, dtype=accumulation_dtype(q.dtype))
        dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, dq, ctx.group, ctx.length, ctx.scale,
                               ctx.kernel, ctx.aux)
        return dq.to(q.dtype), dk, dv, None, None, None


def ring_backward(dout, q, k, v, out, lse, dq, group, length: int, scale: float, kernel: str, aux):
    """The ring's backward over the key/value blocks k, v [B, H, block, Dh] (this rank's; the others
    arrive around the ring): adds each block's dQ into ``dq`` (accumulation dtype) and returns this
    rank's (dK, dV), whose accumulators travel with their blocks and come home after the last step."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    block_len, kv = k.shape[2], torch.stack((k, v))
    grads_pending = None   # dK/dV of the block we hold next, from the previous rank
    for step in range(size):
        kv_pending = _pass_on(kv, group) if step + 1 < size else None
        valid = valid_keys(length, (rank - step) % size, block_len)
        if valid:
            bq, bk, bv = block_backward(dout, q, *_block_keys(kv, valid), out, lse, scale, kernel, aux)
            dq += bq
        dkv = _arrived(grads_pending) if grads_pending is not None else \
            torch.zeros(kv.shape, dtype=dq.dtype, device=kv.device)
        if valid:
            dkv[0, :, :, :valid] += bk
            dkv[1, :, :, :valid] += bv
        # The accumulator follows its block to the next rank; after the last step it is home.
        grads_pending = _pass_on(dkv, group) if size > 1 else ([], dkv, dkv)
        if kv_pending is not None:
            kv = _arrived(kv_pending)
    dkv = _arrived(grads_pending)
    return dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, length: int,
                   scale: float | None = None) -> torch.Tensor:
    """Full attention of this rank's queries over the keys of every rank of ``group``.

    q, k, v: [B, heads, m, head_dim], this rank's contiguous block of the sequence (ranks in
    group order); ``length``: the true sequence length (tokens past it are padding and are
    never attended to). Returns [B, heads, m, head_dim]."""
    if length <= 0:
        raise ValueError(f"ring attention needs at least one real token, got length={length}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, group, length, scale)
