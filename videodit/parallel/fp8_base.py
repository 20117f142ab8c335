"""fp8 frozen base weights for LoRA runs (``lora.base_dtype: fp8``).

A LoRA run never changes its base, so the base only has to be good enough to compute with.
Here every Linear weight inside the model's repeated blocks (the base layers of the adapted
layers and the layers without adapters), and the base layer of every adapted layer outside
them, is held as float8 e4m3 bits with one power-of-two scale per output row, and dequantised
per layer at compute time to the autocast dtype (else the input's). Everything else stays as
``lora.base_dtype: auto`` holds it (bf16 in bf16 runs): biases, norms, modulation tables, the
embedders and the head. They are a few percent of a large model's parameters, and an error in
the time embedding or the head would reach every block or every output pixel.

Why per output row and a power of two (``scripts/fp8_base_error.py``; docs/memory.md has the table):

- Per row, each output channel uses e4m3's whole range whatever the other rows' norms; per
  tensor, rows far below the largest one fall into e4m3's subnormals and lose mantissa (worst
  row 5.3e-2 relative against 2.8e-2, rows spread over 10^4x). For Xavier or normal weights and a
  tiny Wan both round alike (2.4-2.7e-2). The scales cost one value per row in the compute dtype:
  2 / in_features bytes per parameter in bf16 runs (0.04% at 5120).
- A power of two makes the scale exact in bf16 and the dequantisation exact too (an e4m3 value
  times 2^k is a bf16 value), so bf16 compute sees the fp8 rounding and nothing else. e4m3's
  relative precision is the same across its normal range, so rounding the scale up to a power of
  two costs no mantissa, only up to one binade of headroom at the bottom of the range.

The storage is not torchao's: its ``Float8Tensor`` trains on CPU (backward to the input works,
also under peft and checkpointing) but FSDP2 cannot shard it (``fully_shard`` fails on
``aten.new_zeros``). Here the bits are a plain ``uint8`` parameter: FSDP2 shards it along the
rows with the scales, all-gathers it as bytes, and leaves it out of its mixed-precision cast
(only floating-point parameters are cast), so the gathered copy is 1 byte per weight too. The
parameters are frozen, so a LoRA checkpoint (adapters only), the EMA and the optimizer never
see them; sampling and ``--merge-lora`` read the full-precision base from disk again.

Backward to the input goes through :class:`_DequantizedLinear`, which saves the fp8 bits (the
parameter itself: no new memory) and dequantises again, instead of keeping the
dequantised weight of every layer alive until backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from videodit.errors import UserError
from videodit.models.lowmem import base_weight_bytes, fp8_layer_paths  # noqa: F401  (re-exported)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max   # 448
BASE_DTYPES = ("auto", "bf16", "fp8")


def base_storage_dtype(choice: str, train_in_bf16: bool) -> torch.dtype | None:
    """The dtype a LoRA run holds its frozen base in (None: as loaded); with ``fp8`` the dtype of
    the scales and of every parameter that stays out of fp8."""
    return torch.bfloat16 if train_in_bf16 or choice == "bf16" else None


def check_base_dtype(cfg, train_in_bf16: bool) -> None:
    """Refuse, in one line, a ``lora.base_dtype`` the run cannot take."""
    choice = cfg.lora.base_dtype
    if choice == "auto":
        return
    if not cfg.lora.rank:
        raise UserError(f"lora.base_dtype={choice} sets how a LoRA run holds its frozen base, and this run trains "
                        "the whole model: set lora.rank > 0 (with model.init_from), or leave lora.base_dtype=auto")
    if choice == "bf16" and not train_in_bf16:
        raise UserError("lora.base_dtype=bf16 needs bf16 compute (the base's layers would get fp32 inputs): set "
                        "train.precision=bf16, or lora.base_dtype=fp8 (upcast per layer) or auto (an fp32 base)")
    if choice == "fp8" and cfg.parallel.tp > 1:
        raise UserError(f"lora.base_dtype=fp8 does not work with parallel.tp={cfg.parallel.tp} (tensor parallelism "
                        "shards nn.Linear weights, not fp8 storage): split the base with FSDP2 (parallel.dp_shard) "
                        "instead, or use lora.base_dtype=bf16")


# ----------------------------------------------------------------------------- the number format

def row_scales(weight: torch.Tensor) -> torch.Tensor:
    """[out, 1] fp32 dequantisation scales: per row the smallest power of two s with
    max|row| / s <= 448 (1 for an all-zero row)."""
    amax = weight.detach().abs().amax(dim=1, keepdim=True).float()
    exponent = torch.ceil(torch.log2(amax / FP8_MAX))
    return torch.where(amax > 0, torch.exp2(exponent), torch.ones_like(amax))


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] -> (e4m3 bits as uint8 [out, in], fp32 scales [out, 1]) with
    weight ~= bits (as e4m3) * scales; the division by a power of two is exact, so the only
    rounding is the cast to e4m3 (to nearest)."""
    scales = row_scales(weight)
    bits = (weight.detach().float() / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return bits.view(torch.uint8), scales


def dequantize(bits: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight in ``dtype`` (exact for bf16 and fp32: an e4m3 value times 2^k is both)."""
    return bits.view(FP8).to(dtype) * scales.to(dtype)


class _DequantizedLinear(torch.autograd.Function):
    """``F.linear(x, dequantize(bits, scales), bias)`` that saves the fp8 bits for backward,
    not the dequantised weight. The weight and bias are frozen: only ``x`` gets a gradient."""

    @staticmethod
    def forward(ctx, x, bits, scales, bias):
        ctx.save_for_backward(bits, scales)
        weight = dequantize(bits, scales, x.dtype)
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        bits, scales = ctx.saved_tensors
        return grad @ dequantize(bits, scales, grad.dtype), None, None, None


class Float8BaseLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is held as e4m3 bits (``weight_fp8``, uint8) and one
    power-of-two scale per output row (``weight_scale``, in the compute dtype), dequantised at
    each call to the autocast dtype, else the input's dtype."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bits, scales = quantize(linear.weight)
        # Registered first: models cast their inputs to ``next(layer.parameters()).dtype``
        # (Wan's to_weight_dtype), which must be the compute dtype, not uint8.
        self.weight_scale = nn.Parameter(scales.to(compute_dtype), requires_grad=False)
        self.weight_fp8 = nn.Parameter(bits, requires_grad=False)
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().to(compute_dtype), requires_grad=False))

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight in the compute dtype: a new tensor, for code that reads
        ``.weight`` (the forward pass does not)."""
        return dequantize(self.weight_fp8, self.weight_scale, self.weight_scale.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        with torch.autocast(kind, enabled=False):   # dtypes are explicit here
            return _DequantizedLinear.apply(x.to(dtype), self.weight_fp8, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight=float8_e4m3fn x per-row {str(self.weight_scale.dtype).removeprefix('torch.')} scale")


# ----------------------------------------------------------------------------- which layers

def store_base_in_fp8(model: nn.Module, compute_dtype: torch.dtype | None = None) -> list[str]:
    """Replace the weights of :func:`fp8_layer_paths` by fp8 storage, in place, layer by layer
    (each full-precision weight is freed as soon as its fp8 copy exists). ``compute_dtype``: the
    dtype their scales and biases are held in (None: each weight's own). Returns the paths."""
    paths = fp8_layer_paths(model)
    with torch.no_grad():
        for path in paths:
            parent, _, child = path.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            linear = getattr(owner, child)
            if linear.weight.requires_grad:
                raise ValueError(f"{path} is trained: only a frozen base goes to fp8")
            setattr(owner, child, Float8BaseLinear(linear, compute_dtype or linear.weight.dtype))
    return paths


def fp8_storage_bytes(model: nn.Module) -> int:
    """Bytes of the fp8 bits and their scales held by ``model`` (this rank's shards)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Float8BaseLinear):
            for param in (module.weight_fp8, module.weight_scale):
                local = param.to_local() if hasattr(param, "to_local") else param
                total += local.numel() * local.element_size()
    return total
