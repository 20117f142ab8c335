"""What the memory levers for big models act on, read off a model's structure alone (pure: no
torch.distributed, works on meta models). The parallel layers that apply the levers
(``parallel/fp8_base.py``, ``float8.py``, ``block_swap.py``, ``checkpoint_offload.py``) and the
planner that counts them (``planner/levers.py``) share these facts from here.
"""

from __future__ import annotations

from torch import nn

from videodit.models.spec import model_parts

SWAP_IN_FLIGHT = 2               # swapped blocks on the device at once: the one that runs and the prefetched one
CHECKPOINT_INPUTS_IN_FLIGHT = 2  # offloaded checkpoint inputs on the GPU in backward: the recomputing block's and the next
FP8_ALIGNMENT = 16               # torch._scaled_mm: both sides of a weight a multiple of 16
_BYTES = {"fp32": 4, "bf16": 2}


def base_weight_bytes(numel: int, rows: int, kind: str, compute: str = "bf16") -> int:
    """Bytes the frozen weight of one layer (``numel`` values in ``rows`` output rows) takes
    when held as ``kind`` (fp32, bf16 or fp8) in a run computing in ``compute`` (bf16 or fp32):
    fp8 is 1 byte per value plus one scale per row in the compute dtype, i.e. per parameter
    1 + scale_bytes / in_features."""
    if kind == "fp8":
        return numel + rows * _BYTES[compute]
    return numel * _BYTES[kind]


def fp8_layer_paths(model: nn.Module) -> list[str]:
    """Module paths of the ``nn.Linear`` layers whose weights an fp8 base stores in fp8: every
    Linear inside the blocks of each part of ``model`` (peft's ``...base_layer`` for an adapted
    one) and the base layer of every adapted layer outside them."""
    from videodit.models.lora import is_lora_layer   # no peft import unless it is loaded

    inside = {id(module) for _, part in model_parts(model) for block in getattr(part, "blocks", [])
              for module in block.modules()}
    modules = dict(model.named_modules())
    adapted = {f"{name}.base_layer" for name, module in modules.items() if is_lora_layer(module)}
    return [name for name, module in modules.items()
            if isinstance(module, nn.Linear) and (name in adapted or id(module) in inside)
            and not _is_adapter_path(name)]


def _is_adapter_path(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name


def fp8_eligible(layer: nn.Module) -> bool:
    """A plain linear layer whose two sides are multiples of 16 (what float8 matmuls take)."""
    return (isinstance(layer, nn.Linear) and layer.in_features % FP8_ALIGNMENT == 0
            and layer.out_features % FP8_ALIGNMENT == 0)
