"""``memory.offload`` for checkpointed blocks: the token input a checkpointed block keeps for its
recompute waits in pinned host memory between forward and backward, as Open-Sora 2.0 keeps the
inputs of its checkpointed blocks in a pinned host buffer (``opensora/acceleration/checkpoint.py``,
``grad_ckpt_buffer_size``).

A checkpointed block keeps only its inputs. Of those, only the token stream (its first argument:
[B, T, S, D] or [B, L, D], the previous block's output) is its own; the caption, the modulation and
the RoPE tables are the same tensors for every block, so copying them would free no GPU memory.
Non-reentrant checkpointing saves its inputs through the saved-tensor hooks active around it, so
hooks around the checkpointed block see exactly them (and, with ``train.compile``, the inputs the
compiled region saves).

* Forward: the token input is copied to pinned host memory on a side CUDA stream once the block
  has been launched; its GPU memory is free as soon as the next block has read it.
* Backward: when block i's output gradient is ready (its recompute is about to start), block
  i-1's input starts its way back on the side stream, hidden behind block i's recompute and
  backward; block i waits for its own, sent back one block earlier. So at most two offloaded inputs
  are on the GPU at once.

The copies are exact: losses and gradients are bitwise those without. On CPU the inputs already
live in host memory and this does nothing, unless ``stand_in=True`` (tests, benchmarks): the "host"
copy is then a second tensor made outside every ``TorchDispatchMode``, so ``LiveMemory`` counts what
a GPU would no longer hold, and the same pack, prefetch and unpack path runs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from videodit.parallel.saved_tensors import MIN_BYTES

@dataclass
class InputOffloadStats:
    offloaded: int = 0          # token inputs sent to the host
    bytes_offloaded: int = 0
    prefetched: int = 0         # brought back ahead of their block's recompute
    unprefetched: int = 0       # brought back only when the recompute asked (compute waited)


def host_like(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor for ``t``'s values, with ``t``'s strides where its memory is
    dense (a permuted view of a block's input, say): the recompute must see the layout the forward
    saw, since ops pick their kernels by it and with them the order they save tensors in (a
    contiguous copy of a transposed input made a linear save its two operands the other way round:
    checkpoint's "recomputed values have different metadata", seen on an H100)."""
    if _dense(t):
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, pin_memory=pin)
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill their memory without gaps or overlaps (some permutation of a
    contiguous tensor)."""
    expected = 1
    for dim in sorted(range(t.dim()), key=t.stride):
        if t.size(dim) != 1 and t.stride(dim) != expected:
            return False
        expected *= t.size(dim)
    return True


class _HostCopy:
    """One offloaded input: the host copy, and once sent back, the device copy."""

    __slots__ = ("__weakref__", "back", "back_ready", "device", "host", "host_ready", "index")

    def __init__(self, index: int, host: torch.Tensor, device: torch.device, host_ready=None):
        self.index, self.host, self.device, self.host_ready = index, host, device, host_ready
        self.back: torch.Tensor | None = None
        self.back_ready: torch.cuda.Event | None = None


class InputOffloader:
    """The offloaded inputs of one model part's checkpointed blocks, by block index."""

    def __init__(self, device: torch.device, stand_in: bool = False):
        self.device, self.stand_in = device, stand_in
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.stats = InputOffloadStats()
        # Autograd owns the copies (through the checkpoint's saved inputs); a graph that is never
        # run backward must not leave its host copies behind here.
        self._waiting: dict[int, weakref.WeakSet] = {}

    def takes(self, t: torch.Tensor) -> bool:
        return (type(t) is torch.Tensor and t.is_floating_point() and t.numel() * t.element_size() >= MIN_BYTES
                and (t.is_cuda or self.stand_in))

    def pack(self, index: int, t: torch.Tensor) -> _HostCopy:
        if t.is_cuda:
            # The copy must start after the kernels that produce ``t``; ``t`` may be freed by the
            # compute stream before it is read, so its memory waits for the side stream too.
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                host = host_like(t, pin=True)
                host.copy_(t, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.stream)
            t.record_stream(self.stream)
        else:
            with _disable_current_modes():   # host memory: not what the device allocator holds
                host, ready = host_like(t, pin=False).copy_(t.detach()), None
        copy = _HostCopy(index, host, t.device, ready)
        self._waiting.setdefault(index, weakref.WeakSet()).add(copy)
        self.stats.offloaded += 1
        self.stats.bytes_offloaded += t.numel() * t.element_size()
        return copy

    def _send_back(self, copy: _HostCopy) -> None:
        if copy.back is not None:
            return
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(copy.host_ready)   # the host copy is complete
                copy.back = copy.host.to(copy.device, non_blocking=True)
                copy.back_ready = torch.cuda.Event()
                copy.back_ready.record(self.stream)
        else:
            copy.back = copy.host.clone()
        self._waiting.get(copy.index, weakref.WeakSet()).discard(copy)

    def prefetch(self, index: int) -> None:
        for copy in list(self._waiting.get(index, ())):
            self._send_back(copy)
            self.stats.prefetched += 1

    def unpack(self, copy: _HostCopy) -> torch.Tensor:
        if copy.back is None:
            self.stats.unprefetched += 1
            self._send_back(copy)
        back, copy.back = copy.back, None   # the recompute holds it from here (and frees it)
        if copy.back_ready is not None:
            compute = torch.cuda.current_stream(copy.device)
            compute.wait_event(copy.back_ready)
            back.record_stream(compute)
            copy.back_ready = None
        return back


def offload_checkpoint_inputs(block: nn.Module, index: int, offloader: InputOffloader, previous: int,
                              streams: int = 1) -> None:
    """Send the token inputs (the first ``streams`` arguments: the previous block's outputs; the
    MMDiT's image and text) that the checkpointed ``block`` (number ``index`` in its part) keeps for
    its recompute to host memory (module docstring); when its backward starts, bring back the
    inputs of block ``previous`` (the checkpointed block before it; -1: none). Replaces ``forward``
    on the instance, outside the checkpoint wrapper and compile."""
    inner = block.forward

    def forward(*args, **kwargs):
        if not (torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor)) or not offloader.takes(args[0]):
            return inner(*args, **kwargs)
        token_storages = {a.untyped_storage().data_ptr() for a in args[:streams] if isinstance(a, torch.Tensor)}

        def pack(t: torch.Tensor):
            if offloader.takes(t) and t.untyped_storage().data_ptr() in token_storages:
                return offloader.pack(index, t)
            return t

        def unpack(packed):
            return packed if isinstance(packed, torch.Tensor) else offloader.unpack(packed)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = inner(*args, **kwargs)
        outputs = (out,) if isinstance(out, torch.Tensor) else tuple(t for t in out if isinstance(t, torch.Tensor))
        for t in outputs:
            if t.requires_grad:   # its gradient is ready: this block's recompute is next, then previous's
                t.register_hook(lambda grad: offloader.prefetch(previous))
                break
        return out

    block.forward = forward
    block.input_offloader = offloader


def apply_checkpoint_input_offload(model: nn.Module, checkpointed: list[int], *,
                                   stand_in: bool = False, streams: int = 1) -> InputOffloader:
    """Offload the token inputs (the first ``streams`` arguments) of ``model.blocks[i]`` for each
    checkpointed ``i``; one offloader (and side stream) per model part. ``stand_in``: do it on CPU
    too (tests, benchmarks)."""
    device = next(model.parameters()).device
    offloader = InputOffloader(device, stand_in=stand_in)
    blocks = list(model.blocks)
    for previous, i in zip([-1, *checkpointed], checkpointed):
        offload_checkpoint_inputs(blocks[i], i, offloader, previous, streams)
    return offloader


def input_offload_stats(model: nn.Module) -> InputOffloadStats:
    """The stats of the offloaders inside ``model``, summed (one per part)."""
    total, seen = InputOffloadStats(), set()
    for module in model.modules():
        offloader = getattr(module, "input_offloader", None)
        if isinstance(offloader, InputOffloader) and id(offloader) not in seen:
            seen.add(id(offloader))
            for name in total.__dataclass_fields__:
                setattr(total, name, getattr(total, name) + getattr(offloader.stats, name))
    return total
