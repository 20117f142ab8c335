"""LoRA for training, applied from outside the model and before every other layer of
``parallelize`` (pipeline, TP, SP, activation checkpointing, compile, FSDP2/DDP), so each of
them sees the adapted model:

- :func:`apply_lora` adds the adapters (peft, ``models/lora.py``), which freezes the base, and
  casts the frozen base to ``base_dtype`` (bf16 when training in bf16): no fp32 master copy,
  no gradients and no optimizer state for it. The adapters stay fp32 (autocast runs them in
  bf16); FSDP2 shards base and adapters alike and reduces only the adapters' gradients.
- :func:`tensor_parallel_plan` rewrites a tensor-parallel plan for adapted layers (peft's own
  layout): a column-wise layer's ``base_layer`` is sharded as before, its ``lora_A`` stays
  whole (it reads the replicated input) and its ``lora_B`` is column-wise; a row-wise layer's
  ``lora_A`` is row-wise (its output all-reduced: rank values per token) and its ``lora_B``
  stays whole. The whole adapters get the same gradient on every TP rank, like the other
  replicated parameters.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from videodit.config import LoraConfig
from videodit.models.lora import ADAPTER, adapter_names, add_adapters, is_lora_layer, lora_layers, scale_numerator
from videodit.parallel.fp8_base import store_base_in_fp8


def apply_lora(model: nn.Module, cfg: LoraConfig, base_dtype: torch.dtype | None = None,
               adapters: tuple[str, ...] = (ADAPTER,)) -> nn.Module:
    """Add ``cfg``'s adapters to ``model`` in place (one per name in ``adapters``: a shared-base
    distillation run's roles), freeze the rest and hold it in ``base_dtype`` (None: as it is);
    ``lora.base_dtype: fp8`` holds the block Linear weights in fp8 instead
    (``parallel/fp8_base.py``), their scales in ``base_dtype``. Returns ``model``."""
    add_adapters(model, cfg, adapters)
    if cfg.base_dtype == "fp8":   # quantised from the weights as loaded, before any cast
        store_base_in_fp8(model, base_dtype)
    if base_dtype is not None:
        with torch.no_grad():
            for param in model.parameters():
                if not param.requires_grad and param.is_floating_point():
                    param.data = param.data.to(base_dtype)
    return model


def tensor_parallel_plan(module: nn.Module, plan: dict) -> dict:
    """``plan`` (module path inside ``module`` -> ParallelStyle) with every entry that names an
    adapted layer replaced by entries for its base layer and adapters (module docstring)."""
    out = {}
    for path, style in plan.items():
        try:
            layer = module.get_submodule(path)
        except AttributeError:
            layer = None
        if not is_lora_layer(layer):
            out[path] = style
            continue
        out[f"{path}.base_layer"] = style
        a, b = f"{path}.lora_A.{ADAPTER}", f"{path}.lora_B.{ADAPTER}"
        if isinstance(style, ColwiseParallel):
            # lora_A reads the whole (replicated) input as a plain tensor; lora_B shards like the base.
            out[a] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                        use_local_output=True)
            out[b] = style
        elif isinstance(style, RowwiseParallel):
            out[a] = style   # the input's shard of lora_A; its rank-wide output is all-reduced
        else:
            raise ValueError(f"tensor parallelism of the adapted layer {path}: {type(style).__name__} is not "
                             "supported (column- or row-wise only)")
    return out


def lora_summary(model: nn.Module, cfg: LoraConfig) -> str:
    """One line: what trains and what is frozen."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    layers = lora_layers(model)
    names = adapter_names(layers)
    # fp8 storage (parallel/fp8_base.py) holds e4m3 bits in uint8 parameters
    dtypes = "/".join(sorted({str(p.dtype).removeprefix("torch.").replace("uint8", "float8_e4m3fn") for p in frozen}))
    share = 100 * trained / max(trained + sum(p.numel() for p in frozen), 1)
    each = f" ({len(names)} adapters each: {', '.join(names)}, one shared base)" if len(names) > 1 else ""
    return (f"LoRA: rank {cfg.rank}, alpha {scale_numerator(cfg):g}, on {len(layers)} layers{each}: {trained:,} "
            f"adapter parameters train ({share:.2f}% of the model); the base is frozen in {dtypes}")
