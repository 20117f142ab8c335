"""Sequence parallelism for DiTs whose self-attention spans all tokens (Wan-style), applied
from outside the model.

The blocks are ``block(x, e0, context, rope)`` with x [B, L, D]. Before the first block the
token sequence is zero-padded to a multiple of sp and every rank keeps its contiguous slice
(of x and of every per-token argument, ``sequence_args``); after the last block the slices
are gathered and the padding dropped, so the embedders and the output layer run unchanged on
the whole sequence. Everything per token (norms, modulation, MLP, cross-attention to the
replicated text) runs on the slice. Self-attention needs every token; with
sp = ulysses x ring it runs as:

- Ulysses (ring=1): an all-to-all trades the sequence slice for a slice of the heads,
  attention runs over the whole sequence, a second all-to-all trades back. Needs
  heads % sp == 0; the volume per rank falls with sp.
- Ring (ring=sp): keys and values travel around the ring (``parallel/ring_attention.py``);
  any sp, memory O(L/sp), point-to-point traffic that overlaps the compute.
- USP (both): Ulysses inside groups of ``sp / ring`` neighbouring ranks, then a ring over the
  groups, each holding a contiguous run of ``sp / ring`` slices (rank = ring_index * ulysses
  + ulysses_index). On GPUs the neighbours share a node, where all-to-all is cheap.

Padded keys are never attended to (the backends get the true length); padded queries are
dropped at the end.

Blocks with more than the sharded sequence (LTX-2's: ``block(vx, ax, video, audio) -> (vx, ax)``):
an argument may be a dataclass whose per-token fields ``sequence_args`` names ({field: dim}) or a
tuple of per-token tensors (a (cos, sin) table); a tensor of one row where the tokens go is shared
by all of them and left whole; a block that returns a tuple has its first element gathered and
the rest (a stream kept whole on every rank) handed on. Attention kinds whose queries are whole
on every rank and whose keys/values are the sharded tokens (``whole_query_kinds``: LTX-2's audio
queries over the video) run as ring attention over the whole SP group: its backward sends each
key block's gradient home summed over the ranks (the exact adjoint of gathering the keys). Gradients: every SP rank back-propagates the same loss, so the gather's
backward scales this rank's slice by sp and the data-parallel mean over the SP ranks gives
the single-process gradient (as in ``parallel/sequence.py``).

Why not torch's ``context_parallel`` (``torch.distributed.tensor.experimental``): it patches
``F.scaled_dot_product_attention`` globally, so cross-attention would ring the replicated text
too; its ring handles only the CUDA flash/efficient/cuDNN ops (not CPU), takes no key padding
(every length must split evenly), and has no Ulysses. We keep its LSE merge formula.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from videodit.models.layers import AttentionBackend
from videodit.parallel.ring_attention import ring_attention
from videodit.parallel.sequence import _AllToAll, _GatherForIdenticalLoss

# Where an argument's tokens are: a dim, or (dim, ndim) for an argument that is per token only
# in its ndim-dimensional form (e0: [B, L, 6, D] per token, [B, 6, D] shared), or for a dataclass
# argument {field name: its SequenceDim}.
SequenceDim = int | tuple[int, int] | dict


# ---------------------------------------------------------------------------- groups

def _rank_lists(sp_ranks: list[int], ring_degree: int) -> tuple[list[list[int]], list[list[int]]]:
    """Ulysses groups (runs of neighbouring ranks) and ring groups (strided) of one SP group."""
    ulysses = len(sp_ranks) // ring_degree
    return ([sp_ranks[i:i + ulysses] for i in range(0, len(sp_ranks), ulysses)],
            [sp_ranks[j::ulysses] for j in range(ulysses)])


def usp_groups(sp, ring_degree: int):
    """(Ulysses group, ring group) of this rank, None where that degree is 1.

    ``sp``: the SP ProcessGroup or its 1-D DeviceMesh. Creating groups is collective over the
    whole world, in one order on every rank: a DeviceMesh is unflattened into
    (``sp_ring``, ``sp_ulysses``), which creates the sub-groups of every SP group at once;
    for a bare ProcessGroup every rank learns every SP group's ranks (one all-gather) and
    all ranks create all sub-groups in sorted order."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = sp if isinstance(sp, DeviceMesh) else None
    group = mesh.get_group() if mesh is not None else sp
    size = dist.get_world_size(group)
    if ring_degree == 1 or ring_degree == size:
        return (group, None) if ring_degree == 1 else (None, group)
    if mesh is not None and hasattr(mesh, "_unflatten"):
        sub = mesh._unflatten(0, (ring_degree, size // ring_degree), ("sp_ring", "sp_ulysses"))
        return sub["sp_ulysses"].get_group(), sub["sp_ring"].get_group()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, dist.get_process_group_ranks(group))
    ulysses_lists, ring_lists = [], []
    for ranks in sorted({tuple(r) for r in every}):
        ulysses, ring = _rank_lists(list(ranks), ring_degree)
        ulysses_lists += ulysses
        ring_lists += ring
    ulysses_group, _ = dist.new_subgroups_by_enumeration(ulysses_lists)
    ring_group, _ = dist.new_subgroups_by_enumeration(ring_lists)
    # new_group orders a group's ranks by global rank; the layout needs SP-rank order.
    rank, ulysses_size = dist.get_rank(group), size // ring_degree
    if (dist.get_rank(ulysses_group), dist.get_rank(ring_group)) != (rank % ulysses_size, rank // ulysses_size):
        raise ValueError("the SP group's ranks must ascend with the global ranks to split it into Ulysses x ring")
    return ulysses_group, ring_group


# ---------------------------------------------------------------------------- attention

class FullAttentionBackend(AttentionBackend):
    """Self-attention over the whole sharded sequence; any other kind (cross) stays local."""

    def __init__(self, plan: "FullAttentionSP"):
        self.plan = plan

    def __call__(self, q, k, v, *, kind: str, attn_mask=None):
        if kind in self.plan.whole_query_kinds:
            if attn_mask is not None:
                raise NotImplementedError("sequence-parallel attention over sharded keys takes no attn_mask")
            return ring_attention(q, k, v, self.plan.group, self.plan.length)
        if kind != "self":
            return super().__call__(q, k, v, kind=kind, attn_mask=attn_mask)
        if attn_mask is not None:
            raise NotImplementedError("sequence-parallel self-attention takes no attn_mask")
        return self.plan.attention(q, k, v)


def _attention_modules(block: nn.Module) -> list[nn.Module]:
    return [module for module in block.modules() if hasattr(module, "backend")]


class FullAttentionSP:
    """The SP plan: groups, the true length of the current sequence, and the hooks."""

    def __init__(self, sp, *, ring_degree: int = 1):
        from torch.distributed.device_mesh import DeviceMesh

        self.group = sp.get_group() if isinstance(sp, DeviceMesh) else sp
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if self.size % ring_degree:
            raise ValueError(f"ring_degree={ring_degree} does not divide the SP size {self.size}")
        self.ring_degree, self.ulysses_degree = ring_degree, self.size // ring_degree
        self.ulysses_group, self.ring_group = usp_groups(sp, ring_degree)
        self.sequence_args: dict[int | str, SequenceDim] = {0: 1}
        self.whole_query_kinds: tuple[str, ...] = ()
        # Set by the first block of each forward and kept until the next one, so that
        # activation checkpointing recomputes the blocks under the same plan in backward.
        self.length = 0
        self._slices: dict = {}

    # ------------------------------------------------------------------ attention

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: [B, heads, L_padded/sp, head_dim], this rank's slice -> its output slice."""
        ulysses = self.ulysses_group
        if ulysses is not None:
            if q.shape[1] % self.ulysses_degree:
                raise ValueError(f"{q.shape[1]} heads do not split over {self.ulysses_degree} Ulysses ranks")
            # [B, heads, n, hd] -> [B, heads/u, u*n, hd]: the u slices of this Ulysses group, in order.
            q, k, v = (_AllToAll.apply(t, 1, 2, ulysses) for t in (q, k, v))
        if self.ring_group is not None:
            out = ring_attention(q, k, v, self.ring_group, self.length)
        else:   # Ulysses alone: the whole padded sequence is here; padded keys are left out
            out = F.scaled_dot_product_attention(q, k[:, :, :self.length], v[:, :, :self.length])
        return _AllToAll.apply(out, 2, 1, ulysses) if ulysses is not None else out

    # ------------------------------------------------------------------ hooks

    def apply(self, blocks, sequence_args: Mapping[int | str, SequenceDim],
              attention_modules: Callable[[nn.Module], Iterable[nn.Module]] | None = None,
              whole_query_kinds: Iterable[str] = ()) -> None:
        if not isinstance(sequence_args.get(0), int):
            raise ValueError("sequence_args must name the token sequence x: argument 0 -> its token dim")
        self.sequence_args = dict(sequence_args)
        self.whole_query_kinds = tuple(whole_query_kinds)
        backend = FullAttentionBackend(self)
        for block in blocks:
            for module in (attention_modules or _attention_modules)(block):
                module.backend = backend
            # Every block gets the model's whole per-token arguments (rope, e0); x arrives sliced.
            block.register_forward_pre_hook(self._shard, with_kwargs=True)
        blocks[0].register_forward_pre_hook(self._start, with_kwargs=True, prepend=True)
        blocks[-1].register_forward_hook(self._gather)

    def _start(self, block, args, kwargs):
        self.length = args[0].shape[self.sequence_args[0]]
        self._slices = {}   # id(argument) -> (argument, its slice): one pad and slice per forward
        args = (self._slice(args[0], self.sequence_args[0]), *args[1:])
        return args, kwargs

    def _shard(self, block, args, kwargs):
        args = args[:1] + tuple(self._slice(arg, self.sequence_args.get(i)) for i, arg in enumerate(args) if i)
        kwargs = {name: self._slice(arg, self.sequence_args.get(name)) for name, arg in kwargs.items()}
        return args, kwargs

    def _slice(self, value, where: SequenceDim | None):
        """This rank's slice of a per-token argument (see :func:`apply_full_attention_sp`)."""
        if where is None or value is None:
            return value
        if isinstance(where, dict):   # a dataclass: its per-token fields
            cached = self._slices.get(id(value))
            if cached is not None and cached[0] is value:
                return cached[1]
            sliced = dataclasses.replace(value, **{name: self._slice(getattr(value, name), dim)
                                                   for name, dim in where.items()})
            self._slices[id(value)] = value, sliced
            return sliced
        if isinstance(value, tuple):   # a table of several tensors: each alike
            return tuple(self._slice(part, where) for part in value)
        if not torch.is_tensor(value):
            return value
        dim, ndim = where if isinstance(where, tuple) else (where, value.dim())
        if value.dim() != ndim:   # the form shared by all tokens (e0 [B, 6, D]): left whole
            return value
        if value.shape[dim] == 1 and self.length != 1:   # one row for every token: shared
            return value
        if value.shape[dim] != self.length:
            raise ValueError(f"a per-token argument of shape {tuple(value.shape)} has {value.shape[dim]} "
                             f"tokens at dim {dim}, the sequence {self.length}")
        cached = self._slices.get(id(value))
        if cached is not None and cached[0] is value:
            return cached[1]
        dim, extra = dim % value.dim(), -self.length % self.size
        padded = F.pad(value, [0, 0] * (value.dim() - 1 - dim) + [0, extra]) if extra else value
        piece = (self.length + extra) // self.size
        self._slices[id(value)] = value, padded.narrow(dim, self.rank * piece, piece)
        return self._slices[id(value)][1]

    def _gather(self, block, args, out):
        self._slices = {}   # held no longer than the forward (a per-token e0 is as large as x)
        if isinstance(out, tuple):   # (the sharded stream, streams whole on every rank)
            return (self._gather(block, args, out[0]), *out[1:])
        dim = self.sequence_args[0]
        return _GatherForIdenticalLoss.apply(out, dim, self.group).narrow(dim, 0, self.length)


def apply_full_attention_sp(blocks, sp, *, ring_degree: int, sequence_args: Mapping[int | str, SequenceDim],
                            attention_modules: Callable[[nn.Module], Iterable[nn.Module]] | None = None,
                            whole_query_kinds: Iterable[str] = ()) -> FullAttentionSP:
    """Shard the sequence over ``sp`` (ProcessGroup or 1-D DeviceMesh) around ``blocks`` and swap
    their attention backends: Ulysses over ``sp / ring_degree`` ranks, ring over ``ring_degree``.

    ``sequence_args``: argument (position, or keyword name) -> its token dim, or (dim, ndim) for
    an argument sliced only when it has ndim dims; must include 0, the sequence x. For
    ``block(x, e0, context, rope)``: ``{0: 1, 1: (1, 4), 3: 0}``: x [B, L, D], e0 only in its
    per-token form [B, L, 6, D] ([B, 6, D] is shared), rope [L, ...]. ``attention_modules(block)``: the
    modules whose ``backend`` to swap (default: every one that has a ``backend``; kinds other
    than "self" run locally, but ``whole_query_kinds``: queries whole on every rank over the sharded
    tokens' keys, by ring attention over the SP group). Every rank of the world must call this (it
    may create groups)."""
    plan = FullAttentionSP(sp, ring_degree=ring_degree)
    plan.apply(blocks, sequence_args, attention_modules, whole_query_kinds)
    return plan
