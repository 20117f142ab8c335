"""Training state across layouts: full (gathered) tensors for files any process can read,
and sharded state for ``torch.distributed.checkpoint`` (DCP).

Full state: ``model.safetensors`` and ``ema.safetensors`` always hold whole tensors (what
sampling and export read) and, without sharding, ``optimizer.pt`` holds the optimizer
state keyed by parameter name. Sharded runs (FSDP/HSDP) also write ``dcp/``: model, EMA
and optimizer as DCP shards, which DCP re-shards on load, so a run saved on 4 ranks
resumes on 2 or on 1. Loading works the same from any layout into any layout.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, distribute_tensor

SHARDS_DIR = "dcp"


def full_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors: plain ones as they are, sharded ones gathered to CPU memory. Gathering
    is a collective, so every rank calls this."""
    return {name: tensor.full_tensor().cpu() if isinstance(tensor, DTensor) else tensor.detach()
            for name, tensor in tensors.items()}


def gather_stages(tensors: dict[str, torch.Tensor], ctx) -> dict[str, torch.Tensor]:
    """Under pipeline parallelism each stage holds part of the model: merge the parts on the
    first rank of each pipeline group (global rank 0 gets the whole model; other ranks get
    their own part back). A collective over the pipeline group."""
    if not ctx.distributed or ctx.dims.pp == 1:
        return tensors
    group = ctx.group("pp")
    first = dist.get_global_rank(group, 0)
    parts = [None] * ctx.dims.pp if ctx.rank == first else None
    dist.gather_object(tensors, parts, dst=first, group=group)
    if ctx.rank != first:
        return tensors
    return {name: tensor for part in parts for name, tensor in part.items()}


def _restricted(state: dict, names) -> dict:
    return {name: value for name, value in state.items() if name in names}


def copy_into(targets: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors from ``source`` into ``targets``, which may be shards (DTensor)."""
    missing = targets.keys() - source.keys()
    if missing:
        raise KeyError(f"state lacks {sorted(missing)[:3]}")
    with torch.no_grad():
        for name, target in targets.items():
            value = source[name].to(target.device if not isinstance(target, DTensor) else target.to_local().device)
            if isinstance(target, DTensor):
                value = distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements)
                target.to_local().copy_(value.to_local())
            else:
                target.copy_(value)


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state keyed by parameter name (unsharded runs only)."""
    return get_optimizer_state_dict(model, optimizer)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a whole, name-keyed optimizer state into a plain or sharded model's optimizer
    (a pipeline stage takes its own parameters' part)."""
    names = {name for name, _ in model.named_parameters()}
    state = {"state": _restricted(state["state"], names),
             "param_groups": [{**group, "params": [n for n in group["params"] if n in names]}
                              for group in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load whole tensors into a plain or sharded model (a pipeline stage takes its part)."""
    state = _restricted(state, model.state_dict().keys())
    if any(isinstance(p, DTensor) for p in model.parameters()):
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))
    else:
        model.load_state_dict(state)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, ema: dict | None) -> dict:
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    if ema is not None:
        state["ema"] = ema
    return state


def save_shards(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ema: dict | None) -> None:
    """Every rank writes its shards into ``folder/dcp`` (a collective)."""
    dcp.save(sharded_state(model, optimizer, ema), checkpoint_id=str(Path(folder) / SHARDS_DIR))


def load_shards(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, ema: dict | None) -> None:
    """Read ``folder/dcp`` into this run's layout, whatever layout wrote it."""
    state = sharded_state(model, optimizer, ema)
    with warnings.catch_warnings():   # one process reading shards is intended, not a mistake
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(Path(folder) / SHARDS_DIR), no_dist=not dist.is_initialized())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    # The EMA tensors were loaded in place.
