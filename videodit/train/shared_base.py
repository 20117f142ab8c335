"""Shared-base LoRA roles: a distillation run whose student and critic are adapters of ONE model.

With ``lora.rank`` set, a DMD2 run holds the teacher's weights once, frozen (in ``lora.base_dtype``),
and trains two adapters on them: the student's (``default``, the run's own, saved and exported as
any LoRA run's) and the critic's (``critic``). The teacher is the same model with its adapters
off. A 14B DMD2 run then holds one 14B base instead of three 14B networks, their gradients and
two optimizers' moments.

Each role is a view of the trainer's :class:`ParallelModel` that sets its adapter for every
forward (``models/lora.py``: ``using_adapter``); activation checkpointing recomputes a forward
with the adapter it ran with. The parallel layout is applied once, to the one model (DDP finds
the adapter a backward left out unused).
"""

from __future__ import annotations

import torch

from videodit.models.lora import adapter_parameters, lora_layers, using_adapter
from videodit.parallel.gradients import clip_gradients
from videodit.parallel.parallelize import ParallelModel

CRITIC = "critic"   # the critic's adapter name (in its parameter names: ``...lora_A.critic.weight``)


class AdapterSwitch:
    """``module`` called with ``adapter`` active (None: the base alone)."""

    def __init__(self, module: torch.nn.Module, layers: list, adapter: str | None):
        self.module, self.layers, self.adapter = module, layers, adapter

    def __call__(self, *args, **kwargs):
        with using_adapter(self.layers, self.adapter):
            return self.module(*args, **kwargs)


class AdapterRole:
    """A trained role of a shared-base run: what DMD2 calls on its critic (``module``,
    ``forward_backward``, ``clip_gradients``, ...), each with ``adapter`` active, and only that
    adapter's gradients clipped."""

    def __init__(self, parallel: ParallelModel, adapter: str):
        if parallel.pipeline is not None or parallel.partial_gradients:
            raise ValueError("adapter roles run without pipeline or tensor parallelism")
        self.parallel, self.adapter = parallel, adapter
        self.local_model = parallel.local_model
        self.layers = lora_layers(parallel.local_model)
        self.module = AdapterSwitch(parallel.module, self.layers, adapter)
        self.autocast, self.global_loss = parallel.autocast, parallel.global_loss

    def train(self) -> None:
        self.parallel.train()

    def forward_backward(self, inputs, target, *, scale: float, sync: bool) -> float:
        with using_adapter(self.layers, self.adapter):
            return self.parallel.forward_backward(inputs, target, scale=scale, sync=sync)

    def clip_gradients(self, max_norm: float) -> float:
        return clip_gradients(adapter_parameters(self.local_model, self.adapter), max_norm)


def frozen_base(parallel: ParallelModel) -> AdapterSwitch:
    """The teacher of a shared-base run: the run's model with every adapter off."""
    return AdapterSwitch(parallel.module, lora_layers(parallel.local_model), None)
