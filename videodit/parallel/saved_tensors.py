"""Offload or compress what a block saves for backward, through ``saved_tensors_hooks``.

Activation checkpointing removes saved tensors and pays for it in recompute. The two
levers here keep every saved tensor but make it cheaper to hold, for the blocks that are
not checkpointed:

* **compression** stores floating-point activations as bf16 (half of fp32) or as fp8 e4m3
  with one scale per tensor (a quarter of fp32) and casts them back when backward needs
  them. It costs a cast each way and is *lossy*: backward sees a rounded copy of the
  activation, so gradients differ slightly from the exact ones (bf16 keeps 8 mantissa
  bits, e4m3 only 3). Forward values are untouched.
* **offload** copies saved CUDA tensors into pinned host memory on a side stream during
  forward and back to the GPU in backward. It is exact, but it moves every saved byte over
  PCIe twice; it is free only while those copies hide behind compute. On CPU the tensors
  are already in host memory, so it does nothing. (A checkpointed block's token input, all it
  keeps, is offloaded by ``checkpoint_offload.py``.)

Compression runs before offload, so fewer bytes cross the bus. Parameters (and views of
them), autocast's cached low-precision copies of parameters, small tensors and integer or
boolean tensors are returned as they are: storing a copy of a tensor that stays alive
anyway would add memory instead of saving it. Tensor subclasses pass through too, so under
tensor parallelism what the sharded linear layers save (DTensors) is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

COMPRESSIONS = ("none", "bf16", "fp8")
# Below this a copy, its cast and (for offload) a host round trip cost more than they save.
MIN_BYTES = 64 * 1024
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max   # 448


@dataclass
class SavedTensorStats:
    """What one wrapped module's hooks did, summed over calls."""

    packed: int = 0            # saved tensors that were compressed or offloaded
    bytes_in: int = 0          # their bytes as autograd handed them over
    bytes_stored: int = 0      # their bytes as held until backward (after compression)
    bytes_offloaded: int = 0   # of those, bytes held in pinned host memory

    def add(self, other: SavedTensorStats) -> SavedTensorStats:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


def saved_tensor_stats(model: nn.Module) -> SavedTensorStats:
    """The stats of every wrapped module inside ``model``, summed."""
    total = SavedTensorStats()
    for module in model.modules():
        stats = getattr(module, "saved_tensor_stats", None)
        if stats is not None:
            total.add(stats)
    return total


class _Packed:
    """A saved tensor as held until backward: ``data`` (maybe compressed, maybe on the host)
    plus what it takes to restore it."""

    __slots__ = ("copied", "data", "device", "dtype", "scale")

    def __init__(self, data, dtype, scale=None, device=None, copied=None):
        self.data, self.dtype, self.scale, self.device, self.copied = data, dtype, scale, device, copied


_side_stream: torch.cuda.Stream | None = None


def _offload_stream() -> torch.cuda.Stream:
    """One copy stream per process, created on first use (creating it needs a GPU)."""
    global _side_stream
    if _side_stream is None:
        _side_stream = torch.cuda.Stream()
    return _side_stream


def _compress(t: torch.Tensor, compression: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    if compression == "bf16" and t.dtype in (torch.float32, torch.float16, torch.float64):
        return t.to(torch.bfloat16), None
    if compression == "fp8":
        # One scale per tensor maps its largest magnitude to e4m3's largest value; an
        # all-zero tensor keeps scale 1 (no division by zero). No host sync: it stays a tensor.
        amax = t.detach().abs().amax().float()
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return (t.float() / scale).to(FP8), scale
    return t, None


def _offload(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    stream = _offload_stream()
    # The copy must start after the kernels that produce ``t`` on the compute stream.
    stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
    # ``t`` may be freed by the compute stream before the copy has read it; this keeps the
    # caching allocator from handing its memory out again until the side stream is done.
    t.record_stream(stream)
    return host, copied


def _is_parameter_cast(t: torch.Tensor) -> bool:
    """Autocast's cached low-precision copy of a parameter (a cast straight off a leaf), or a
    view of one (a linear layer saves the transposed weight)."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(next_fn is not None and type(next_fn).__name__ == "AccumulateGrad"
               for next_fn, _ in fn.next_functions)


def wrap_saved_tensors(module: nn.Module, *, offload: bool, compression: str) -> None:
    """Run ``module``'s forward under hooks that offload and/or compress the activations it
    saves for backward. Replaces ``forward`` on the instance; the module's parameters, names
    and state dict are unchanged. ``module.saved_tensor_stats`` counts what was packed."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression {compression!r} is not one of {COMPRESSIONS}")
    inner = module.forward
    stats = module.saved_tensor_stats = SavedTensorStats()

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled() or (compression == "none" and not offload):
            return inner(*args, **kwargs)
        # Taken per call: FSDP swaps sharded and unsharded parameters between calls.
        param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()
                          if type(p) in (torch.Tensor, nn.Parameter)}
        # Several ops often save the same tensor (q, k and v all save the normed input):
        # one packed copy serves them all, else compression could use more memory than none.
        # The weak reference tells a live tensor from a freed one whose address was reused.
        packed_here: dict[tuple, tuple[StorageWeakRef, _Packed]] = {}

        def pack(t: torch.Tensor):
            if (type(t) is not torch.Tensor or not t.is_floating_point() or t.device.type == "meta"
                    or t.numel() * t.element_size() < MIN_BYTES
                    or t.untyped_storage().data_ptr() in param_storages or _is_parameter_cast(t)):
                return t
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
            if key in packed_here and not packed_here[key][0].expired():
                return packed_here[key][1]
            data, scale = _compress(t, compression)
            move = offload and data.is_cuda
            if data is t and not move:
                return t   # e.g. bf16 compression of a tensor that already is bf16, on CPU
            stats.packed += 1
            stats.bytes_in += t.numel() * t.element_size()
            stats.bytes_stored += data.numel() * data.element_size()
            packed = _Packed(data, t.dtype, scale, t.device)
            if move:
                packed.data, packed.copied = _offload(data)
                stats.bytes_offloaded += data.numel() * data.element_size()
            packed_here[key] = (StorageWeakRef(t.untyped_storage()), packed)
            return packed

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            data = packed.data
            if packed.copied is not None:
                # The host copy must be complete before the device copy reads it.
                torch.cuda.current_stream(packed.device).wait_event(packed.copied)
                data = data.to(packed.device, non_blocking=True)
            if packed.scale is not None:
                data = data.float() * packed.scale
            return data.to(packed.dtype)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return inner(*args, **kwargs)

    module.forward = forward
