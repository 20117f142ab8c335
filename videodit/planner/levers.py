"""The levers that let a big model train on a small GPU, as the planner counts them
(docs/memory.md, "Big models on small GPUs"):

- ``lora.base_dtype=fp8``: every block Linear of the frozen base as 1 byte per weight plus one
  scale per output row in the compute dtype (``parallel/fp8_base.py``);
- ``train.optimizer=adamw8bit``: two 8-bit moments and their fp32 block scales per trained
  parameter instead of two fp32 moments (``train/optimizer.py``, torchao's blocks of 256);
- ``memory.swap_blocks=K``: the frozen weights of K blocks live on the host; at most
  ``IN_FLIGHT`` of them are on the GPU at once (``parallel/block_swap.py``);
- ``train.fp8``: torchao's float8 compute for the block Linears: no new state; the gathered
  (FSDP2) weights of converted layers in 1 byte, no autocast copies of them, and the float8
  operands of one layer at a time (``parallel/float8.py``).

What each costs in step time decides the order in which the planner suggests them
(:data:`FIX_ORDER`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from videodit.models.lowmem import SWAP_IN_FLIGHT as IN_FLIGHT
from videodit.models.lowmem import base_weight_bytes, fp8_eligible, fp8_layer_paths

# torchao's AdamW8bit: 256 values share one fp32 scale per moment (train/optimizer.py).
ADAM8_BLOCK = 256


def optimizer_bytes_per_param(kind: str) -> float:
    """State bytes per trained parameter: AdamW's two fp32 moments, or two 8-bit codes and their
    share of two fp32 block scales (the code maps and the small fp32 tensors are a rounding error)."""
    return 8.0 if kind == "adamw" else 2.0 + 8.0 / ADAM8_BLOCK


@dataclass(frozen=True)
class Levers:
    """The levers a run uses."""
    optimizer: str = "adamw"      # train.optimizer
    fp8_base: bool = False        # lora.base_dtype=fp8
    swap_blocks: int = 0          # memory.swap_blocks
    fp8_compute: bool = False     # train.fp8

    def describe(self) -> list[str]:
        """The levers that are on, as their config settings."""
        on = [("train.optimizer=adamw8bit", self.optimizer == "adamw8bit"), ("lora.base_dtype=fp8", self.fp8_base),
              (f"memory.swap_blocks={self.swap_blocks}", self.swap_blocks > 0), ("train.fp8=true", self.fp8_compute)]
        return [name for name, used in on if used]


def levers_from_config(cfg) -> Levers:
    return Levers(optimizer=cfg.train.optimizer, fp8_base=cfg.lora.rank > 0 and cfg.lora.base_dtype == "fp8",
                  swap_blocks=cfg.memory.swap_blocks, fp8_compute=cfg.train.fp8)


@dataclass(frozen=True)
class LeverCounts:
    """What the levers act on, counted once on the meta model (whole model, one expert)."""
    fp8_base_params: int          # base weights that go to fp8
    fp8_base_bytes_bf16: int      # their bytes, scales in bf16
    fp8_base_bytes_fp32: int      # ... scales in fp32
    fp8_compute_params: int       # block Linear weights torchao converts (sides multiples of 16)
    largest_linear: tuple[int, int]   # (in, out) of the widest converted layer: its float8 operands

    def fp8_base_bytes(self, bf16: bool) -> int:
        return self.fp8_base_bytes_bf16 if bf16 else self.fp8_base_bytes_fp32


def count_levers(model: nn.Module) -> LeverCounts:
    modules = dict(model.named_modules())
    base = [modules[path] for path in fp8_layer_paths(model)]
    converted = [m for block in model.blocks for m in block.modules() if fp8_eligible(m)]
    widest = max(((m.in_features, m.out_features) for m in converted), key=lambda s: s[0] * s[1], default=(0, 0))
    return LeverCounts(
        fp8_base_params=sum(m.weight.numel() for m in base),
        fp8_base_bytes_bf16=sum(base_weight_bytes(m.weight.numel(), m.out_features, "fp8", "bf16") for m in base),
        fp8_base_bytes_fp32=sum(base_weight_bytes(m.weight.numel(), m.out_features, "fp8", "fp32") for m in base),
        fp8_compute_params=sum(m.weight.numel() for m in converted), largest_linear=widest)


def swapped_resident_saving(levers: Levers, blocks_here: int, block_base_bytes: float) -> float:
    """GPU bytes block swapping saves: the swapped blocks' frozen weights, but for the ones in flight."""
    swapped = min(levers.swap_blocks, blocks_here)
    return max(0, swapped - IN_FLIGHT) * block_base_bytes


def float8_operand_bytes(levers: Levers, counts: LeverCounts, tokens: int) -> int:
    """The float8 operands torchao makes for one layer at a time (input, weight, output gradient,
    with padding and layout copies: at most 3 x their elements), for the widest converted layer."""
    if not levers.fp8_compute:
        return 0
    k, n = counts.largest_linear
    return 3 * (tokens * n + tokens * k + n * k)


# The levers the planner suggests, cheapest in step time first, after checkpointing: 8-bit
# moments cost a dequantise per step, the fp8 base a dequantise per layer, sequence parallelism
# communication, offload and block swapping host copies (overlapped, but bounded by PCIe).
FIX_ORDER = ("adamw8bit", "fp8_base", "sp", "offload", "swap_blocks", "cpu_offload")
