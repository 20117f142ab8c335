"""Gradients across a parallel layout: when to communicate, finishing partial sums, and
clipping by the norm of the whole model's gradient.

The whole-model norm has to count every element once, whatever the layout:

- DTensor gradients (FSDP shards, TP shards, or both) are grouped by mesh and placements;
  each group's norm is reduced over its own mesh by DTensor;
- plain gradients are whole on this rank (replicated), so their local norm is exact;
- pipeline stages hold different parameters, so the squared norms are summed over the
  pipeline group.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel


def gradient_sync(module: nn.Module, enabled: bool):
    """A context in which backward does (enabled) or skips (disabled) the gradient collective:
    gradient accumulation communicates only on the last micro-batch."""
    if isinstance(module, DistributedDataParallel):
        return contextlib.nullcontext() if enabled else module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):   # FSDP2
        module.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def sum_partial_gradients(model: nn.Module, names: list[str], group) -> None:
    """All-reduce (sum) the gradients of ``names`` over ``group``: parameters that every
    rank holds whole but whose gradient each rank computes from part of the work."""
    for name in names:
        grad = model.get_parameter(name).grad
        if grad is not None:
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)


def global_grad_norm(parameters, pp_group=None) -> torch.Tensor:
    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict = {}
    for grad in grads:
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(grad)
    device = grads[0].to_local().device if grads and isinstance(grads[0], DTensor) else \
        (grads[0].device if grads else torch.device("cpu"))
    squared = torch.zeros((), dtype=torch.float64, device=device)
    for group in groups.values():   # the same order on every rank: parameter order
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squared += norm.double().to(device) ** 2
    if pp_group is not None:
        dist.all_reduce(squared, group=pp_group)
    return squared.sqrt()


def clip_gradients(parameters, max_norm: float, pp_group=None) -> float:
    """Clip by the global gradient norm across all shards and stages; return the norm before
    clipping."""
    parameters = list(parameters)
    norm = float(global_grad_norm(parameters, pp_group))
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        with torch.no_grad():
            for p in parameters:
                if p.grad is not None:
                    p.grad.mul_(scale)
    return norm
