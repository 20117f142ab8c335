"""Block swapping (``memory.swap_blocks: K``): the frozen weights of K of the model's repeated
blocks live in host memory and visit the compute device only around their block's forward and
backward, as musubi-tuner's ``--blocks_to_swap`` does for 14B video models on 24 GB GPUs.

**Which blocks: the first K of ``model.blocks``** (of each expert of a two-expert model). Between a
block's forward and its backward every later block runs forward and backward, so the first blocks
are the ones the GPU needs least often: they have the longest absence to hide their copies in, and
the last blocks, whose backward follows their forward at once, never travel. musubi-tuner's
offloader (``custom_offloading_utils.py``) ends every forward in this state too: it starts with
the last K blocks on the host and exchanges block i for block N-K+i after each of the first K
forwards, so during backward its host holds the first K.

**How.** Each swapped tensor keeps a host copy (pinned on CUDA, packed into slabs: ``PinnedArena``).
On the device its storage is resized to 0 bytes between uses and refilled from the host copy before
use. The tensor object stays the same, so everything that refers to it sees the refilled storage:
the module, autograd's saved tensors (a linear layer saves its weight), a compiled block's graph
inputs, checkpointing's recompute. FSDP1 frees gathered weights the same way. Parameter names,
``parameters()`` and the optimizer are untouched; ``state_dict`` gives the host copies of swapped
tensors. Between uses a swapped tensor has a 0-byte storage: read it through its block or
``state_dict``, never directly (``.clone()``, ``.to()`` or a kernel would read freed memory).

**When.** Hooks around each block's forward and on its output's gradient (the moment its backward,
and a checkpointed block's recompute, begins) keep at most ``IN_FLIGHT`` = 2 swapped blocks on the
device: the one that runs and the next one, whose copy runs on a side CUDA stream while the current
one computes:

* the part's forward starts: fetch block 0 (the embedders run meanwhile);
* block i's forward starts: wait for i's copy, fetch i+1; it ends: free i (the model's last block
  stays when a backward follows: its backward comes next);
* block i's backward starts: free the swapped blocks after i, wait for i, fetch i-1; when the
  whole backward ends, free every swapped block.

**What travels:** tensors autograd does not train: parameters with ``requires_grad=False`` (a LoRA
run's frozen base, in any dtype: bf16 or fp8 storage alike) and buffers (read-only in these blocks:
a write to one would be lost when it is freed). Trainable parameters (the LoRA adapters) stay on the
device, so their gradients, optimizer state and EMA stay where AdamW runs. A full fine-tune would
have to run its optimizer on host copies (ZeRO-Offload); that is refused
(``ParallelDims.check_block_swap``).

**Limits.** Freeing a weight's storage frees what autograd saved of the weight itself; a tensor
*computed* from a weight and saved for backward (autocast's bf16 copy of an fp32 frozen weight) is
an activation and stays until backward. LoRA under bf16 keeps its base in bf16 (nothing to copy),
the fp8 base (``fp8_base.py``) saves its fp8 bits, not their upcast, and checkpointed blocks save
nothing of their weights. On CPU host and device are the same memory: the host copy is a second
tensor and each fetch a memcpy, which is what the tests need to count residency and check exactness.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from videodit.errors import UserError
from videodit.models.lowmem import SWAP_IN_FLIGHT
from videodit.models.spec import model_parts

IN_FLIGHT = SWAP_IN_FLIGHT   # swapped blocks on the device at once: the one that runs and the prefetched one


@dataclass
class SwapStats:
    """What one swapper did, summed over steps."""

    fetches: int = 0               # copies of one block's weights to the device
    unprefetched: int = 0          # of those, issued only when the block had to run (compute waited)
    bytes_fetched: int = 0
    peak_resident_bytes: int = 0   # most bytes the swapped blocks held on the device at once


def frozen_tensors(block: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name in ``block``, tensor) of what swapping moves: frozen parameters and buffers."""
    found = [(name, p) for name, p in block.named_parameters() if not p.requires_grad]
    return found + list(block.named_buffers())


def _owns_resizable_storage(t: torch.Tensor, device: torch.device) -> bool:
    storage = t.untyped_storage()
    return (t.device == device and t.is_contiguous() and t.storage_offset() == 0 and storage.resizable()
            and storage.nbytes() == t.numel() * t.element_size())


class PinnedArena:
    """Host copies carved out of pinned slabs. torch's pinned allocator rounds every allocation up to
    a power of two (``CachingHostAllocator``): a 5120 x 13824 bf16 weight (141 MB) alone would pin
    256 MiB. Slabs of a power-of-two size, packed end to end, waste less than one tensor per slab.
    On CPU the slabs are plain memory (nothing to pin), carved the same way."""

    ALIGN = 512
    MAX_SLAB = 2**30

    def __init__(self, sizes: list[int], pin: bool):
        self.pin = pin
        total = sum(map(self._aligned, sizes))
        self.slab_bytes = min(self.MAX_SLAB, 1 << max(total - 1, 1).bit_length())
        self.slabs: list[torch.Tensor] = []
        self.used = 0

    def _aligned(self, nbytes: int) -> int:
        return -(-nbytes // self.ALIGN) * self.ALIGN

    @property
    def nbytes(self) -> int:
        return sum(slab.numel() for slab in self.slabs)

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        nbytes = shape.numel() * dtype.itemsize
        if nbytes > self.slab_bytes:   # its own slab (rare: a tensor over 1 GiB)
            self.slabs.insert(0, torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin))
            return self.slabs[0].view(dtype).view(shape)
        if not self.slabs or self.used + nbytes > self.slab_bytes:
            self.slabs.append(torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self.pin))
            self.used = 0
        start, self.used = self.used, self.used + self._aligned(nbytes)
        return self.slabs[-1][start:start + nbytes].view(dtype).view(shape)


class SwappedWeights:
    """The frozen tensors of one block, each with a host copy; on the device their storage holds
    data only while the block is resident."""

    def __init__(self, block: nn.Module, device: torch.device, where: str, arena: PinnedArena):
        self.tensors: list[torch.Tensor] = []
        self.hosts: dict[str, torch.Tensor] = {}   # name in the block -> host copy
        self.device = device
        self.ready: torch.cuda.Event | None = None   # the copy to the device is complete
        self.resident = True
        for name, t in frozen_tensors(block):
            if type(t) not in (torch.Tensor, nn.Parameter):
                raise UserError(f"memory.swap_blocks: {where}.{name} is a {type(t).__name__}, which cannot be "
                                "swapped (plain tensors of any dtype can); lower memory.swap_blocks or store it plain")
            if t.numel() == 0:
                continue
            host = arena.empty(t.shape, t.dtype)
            host.copy_(t.detach())
            if not _owns_resizable_storage(t, device):   # shared, strided, mapped or elsewhere: own one
                t.data = torch.empty(t.shape, dtype=t.dtype, device=device)
            self.tensors.append(t)
            self.hosts[name] = host
        if not self.tensors:
            raise UserError(f"memory.swap_blocks: {where} has no frozen weights to swap (every weight trains); "
                            "block swapping needs a frozen base: lora.rank > 0, or lower memory.swap_blocks")
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.release()

    def fetch(self, stream: torch.cuda.Stream | None) -> None:
        """Refill the device storage from the host copies (asynchronously on ``stream``, on CUDA)."""
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for t, host in zip(self.tensors, self.hosts.values()):
                t.untyped_storage().resize_(t.numel() * t.element_size())   # allocated on ``stream``
                # ``.data``: a view with its own version counter, so autograd's saved weights stay valid.
                t.data.copy_(host, non_blocking=stream is not None)
            if stream is not None:
                self.ready = torch.cuda.Event()
                self.ready.record(stream)
        self.resident = True

    def wait(self) -> None:
        """Make the compute stream wait for the copy (CUDA); nothing to wait for on CPU."""
        if self.ready is None:
            return
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(self.ready)
        for t in self.tensors:   # freed on the side stream: not reused before compute is done with it
            t.data.record_stream(compute)
        self.ready = None

    def release(self) -> None:
        for t in self.tensors:
            t.untyped_storage().resize_(0)
        self.resident, self.ready = False, None


class BlockSwapper:
    """Which swapped blocks of one model part are on the device, driven by the hooks that
    :func:`apply_block_swap` installs (module docstring)."""

    def __init__(self, blocks: list[nn.Module], count: int, device: torch.device):
        self.device = device
        self.last = len(blocks) - 1
        self.arena = PinnedArena([t.numel() * t.element_size() for block in blocks[:count]
                                  for _, t in frozen_tensors(block)], pin=device.type == "cuda")
        self.weights = {i: SwappedWeights(blocks[i], device, f"block {i}", self.arena) for i in range(count)}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.stats = SwapStats()
        self._end_queued = False

    @property
    def block_bytes(self) -> int:
        """The largest swapped block's frozen bytes."""
        return max(w.nbytes for w in self.weights.values())

    @property
    def host_bytes(self) -> int:
        """Host memory the copies take (their slabs)."""
        return self.arena.nbytes

    def resident_bytes(self) -> int:
        """Bytes the swapped blocks hold on the compute device now."""
        return sum(w.nbytes for w in self.weights.values() if w.resident)

    def _fetch(self, i: int) -> None:
        w = self.weights.get(i)
        if w is None or w.resident:
            return
        w.fetch(self.stream)
        self.stats.fetches += 1
        self.stats.bytes_fetched += w.nbytes
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, self.resident_bytes())

    def _need(self, i: int) -> None:
        w = self.weights.get(i)
        if w is None:
            return
        if not w.resident:
            self.stats.unprefetched += 1
            self._fetch(i)
        w.wait()

    def _keep_only(self, *keep: int) -> None:
        for i, w in self.weights.items():
            if w.resident and i not in keep:
                w.release()

    # -------------------------------------------------------------- what the hooks report

    def part_forward_starts(self) -> None:
        self._fetch(0)

    def forward_starts(self, i: int) -> None:
        self._keep_only(i, i + 1)
        self._need(i)
        self._fetch(i + 1)

    def forward_ends(self, i: int, output) -> None:
        outputs = [t for t in _tensors(output) if t.requires_grad] if torch.is_grad_enabled() else []
        for t in outputs:
            t.register_hook(lambda grad, i=i: self.backward_starts(i))
        if not (outputs and i == self.last):
            self._keep_only(*(j for j in self.weights if j != i))

    def backward_starts(self, i: int) -> None:
        if not self._end_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.backward_ends)
            self._end_queued = True
        self._keep_only(i, i - 1)
        self._need(i)
        self._fetch(i - 1)

    def backward_ends(self) -> None:
        self._end_queued = False
        self._keep_only()


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []


def _hook_block(block: nn.Module, i: int, swapper: BlockSwapper) -> None:
    """Report block i's forward and backward to ``swapper``: its ``forward`` is replaced on the
    instance, outside every other wrapper (checkpointing, compile, the saved-tensor levers), so a
    checkpointed block's recompute, which calls the original forward, is not reported again."""
    inner = block.forward

    def forward(*args, **kwargs):
        swapper.forward_starts(i)
        out = inner(*args, **kwargs)
        swapper.forward_ends(i, out)
        return out

    block.forward = forward


def _host_state_dict(weights: SwappedWeights):
    def hook(module, state_dict, prefix, local_metadata) -> None:
        for name, host in weights.hosts.items():
            if prefix + name in state_dict:
                state_dict[prefix + name] = host
    return hook


def place_beside_swapped(model: nn.Module, count: int, device: torch.device) -> nn.Module:
    """Move ``model`` to ``device`` but for the frozen tensors of the first ``count`` blocks of each
    part, which :func:`apply_block_swap` then copies to pinned host memory: a base larger than the GPU
    never lands on it whole. Returns ``model``."""
    stay = {id(t) for _, part in model_parts(model) for block in list(part.blocks)[:count]
            for _, t in frozen_tensors(block)}
    return model._apply(lambda t: t if id(t) in stay else t.to(device))


def apply_block_swap(model: nn.Module, count: int, device: torch.device) -> BlockSwapper:
    """Keep the frozen weights of the first ``count`` blocks of ``model.blocks`` (a whole model or
    one expert) in host memory, on ``device`` only around their block's forward and backward.
    Returns the swapper (also ``model.block_swapper``): its ``stats`` and ``resident_bytes()``."""
    blocks = list(model.blocks)
    if not 0 < count <= len(blocks):
        raise UserError(f"memory.swap_blocks={count} is not possible for a model of {len(blocks)} blocks; "
                        f"valid: 0 (off) to {len(blocks)}")
    swapper = BlockSwapper(blocks, count, device)
    for i, weights in swapper.weights.items():
        blocks[i].register_state_dict_post_hook(_host_state_dict(weights))
    for i in range(min(count + 1, len(blocks))):   # block ``count`` prefetches the last swapped one in backward
        _hook_block(blocks[i], i, swapper)
    model.register_forward_pre_hook(lambda module, args: swapper.part_forward_starts())
    model.block_swapper = swapper
    return swapper


def block_swappers(model: nn.Module) -> list[BlockSwapper]:
    """The swapper of every part of ``model`` that has one (none without ``memory.swap_blocks``)."""
    return [m.block_swapper for m in model.modules() if isinstance(getattr(m, "block_swapper", None), BlockSwapper)]


def swapped_names(model: nn.Module, swapper: BlockSwapper) -> list[str]:
    """The names in ``model`` of the tensors ``swapper`` keeps on the host (for DDP to leave alone)."""
    ids = {id(t) for w in swapper.weights.values() for t in w.tensors}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return [name for name, t in named if id(t) in ids]
