"""Sequence parallelism for the spatial-temporal DiT, applied from outside the model.

The token grid ``[B, T, S, D]`` (T frames, S positions per frame) is split over the SP
group so that each attention stays local, as in DSP (dynamic sequence parallelism):

- spatial blocks see a slice of the frames (``frames`` layout, ``[B, T/sp, S, D]``):
  attention within a frame needs no communication;
- temporal blocks see a slice of the positions (``positions`` layout,
  ``[B, T, S/sp, D]``): attention across frames at one position is local too;
- one all-to-all switches the layout between a spatial and a temporal block.

Cross-attention and the MLP are per token, so they run in either layout. When the frame
count does not split (images, or T not divisible by sp) every block runs in the
``positions`` layout and spatial attention becomes head-parallel (Ulysses): an all-to-all
trades the position slice for a head slice, attention runs over all positions, and a
second all-to-all trades back. S is zero-padded to a multiple of sp; padded positions are
never attended to and are dropped at the end.

Everything hooks onto the blocks: the grid is split before the first block, switched
between blocks, and gathered after the last one, so the model's embedding, conditioning
and output layer run unchanged on the full grid (RoPE sees the true frame indices).

Gradients: every SP rank computes the same loss on the gathered output, but each block
parameter gets gradient only through that rank's tokens. The gather's backward therefore
passes ``sp x`` its slice, so the mean over the data-parallel group (which includes the SP
ranks, see ``parallel/dims.py``) is the single-process gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from videodit.models.layers import AttentionBackend

FRAMES, POSITIONS, FULL = "frames", "positions", "full"


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` into one piece per rank, send piece i to rank i, and
    concatenate the pieces received along ``gather_dim`` (in rank order)."""
    size = dist.get_world_size(group)
    send = torch.stack([piece.contiguous() for piece in x.chunk(size, dim=scatter_dim)])
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


class _GatherForIdenticalLoss(torch.autograd.Function):
    """All-gather along ``dim``; backward keeps this rank's slice, times the group size
    (every rank back-propagates the same loss, see the module docstring)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        # Gathered straight into the result (a view of one buffer, no concatenated copy): the
        # collective's buffers are what the caller keeps, never a second grid that the process
        # group may release later (it made the planner's sp=2 measurement flaky).
        moved = x.movedim(dim, 0).contiguous()
        out = moved.new_empty((dist.get_world_size(group) * moved.shape[0], *moved.shape[1:]))
        dist.all_gather_into_tensor(out, moved, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[rank] * size, None, None


class UlyssesBackend(AttentionBackend):
    """Head-parallel spatial attention for the ``positions`` layout; plain SDPA otherwise."""

    def __init__(self, sp: "SequenceParallel"):
        self.sp = sp

    def __call__(self, q, k, v, *, kind: str, attn_mask=None):
        if not self.sp.head_parallel_spatial:
            return super().__call__(q, k, v, kind=kind, attn_mask=attn_mask)
        group, true_len = self.sp.group, self.sp.positions
        # [n, heads, S/sp, hd] -> [n, heads/sp, S_padded, hd]; padded keys are left out.
        q, k, v = (_AllToAll.apply(t, 1, 2, group) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k[:, :, :true_len], v[:, :, :true_len])
        return _AllToAll.apply(out, 2, 1, group)


class SequenceParallel:
    """Installs the layout hooks on ``model.blocks`` and the Ulysses backend on spatial attention."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # Set by the first block of each forward and kept until the next one, so that
        # activation checkpointing recomputes under the same plan in backward.
        self.layout = FULL
        self.split_frames = True
        self.positions = 0           # S, the true positions per frame

    @property
    def head_parallel_spatial(self) -> bool:
        return not self.split_frames

    def apply(self, model: nn.Module) -> None:
        blocks = model.blocks
        for block in blocks:
            block.register_forward_pre_hook(self._before_block)
            if not block.temporal:
                block.attn.backend = UlyssesBackend(self)
        blocks[0].register_forward_pre_hook(self._plan, prepend=True)
        blocks[-1].register_forward_hook(self._after_last_block)

    # ------------------------------------------------------------------ hooks

    def _plan(self, block, args):
        x = args[0]
        frames, self.positions = x.shape[1], x.shape[2]
        self.split_frames = frames % self.size == 0
        self.layout = FULL

    def _before_block(self, block, args):
        x, y, y_mask, t_mod, *rest = args
        want = POSITIONS if block.temporal or not self.split_frames else FRAMES
        if want == FRAMES and t_mod.dim() == 4:   # a modulation per frame (x_mask): this rank's frames
            t_mod = t_mod.chunk(self.size, dim=1)[self.rank]
        return (self._switch(x, want), y, y_mask, t_mod, *rest)

    def _after_last_block(self, block, args, out):
        return self._switch(out, FULL)

    # ------------------------------------------------------------------ layouts

    def _switch(self, x: torch.Tensor, want: str) -> torch.Tensor:
        have, self.layout = self.layout, want
        if have == want:
            return x
        if have == FULL:   # every rank holds the whole grid: keep our slice
            if want == FRAMES:
                return x.chunk(self.size, dim=1)[self.rank]
            return self._pad_positions(x).chunk(self.size, dim=2)[self.rank]
        if want == FULL:
            dim = 1 if have == FRAMES else 2
            return _GatherForIdenticalLoss.apply(x, dim, self.group)[:, :, :self.positions]
        if want == POSITIONS:   # frames -> positions
            return _AllToAll.apply(self._pad_positions(x), 2, 1, self.group)
        return _AllToAll.apply(x, 1, 2, self.group)[:, :, :self.positions]   # positions -> frames

    def _pad_positions(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, 0, 0, -x.shape[2] % self.size))


def apply_sequence_parallel(model: nn.Module, group) -> SequenceParallel:
    sp = SequenceParallel(group)
    sp.apply(model)
    return sp
