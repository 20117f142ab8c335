"""Exponential moving average of the trained weights, kept in fp32 beside the model (sharded
like the model under FSDP, since the shadows are clones of its parameters). A LoRA run's
frozen base never changes, so there only the adapters have shadows."""

from __future__ import annotations

import torch
from torch import nn

from videodit.models.lora import base_parameter_names
from videodit.parallel.state import copy_into


class EMA:
    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        base = base_parameter_names(model)   # a LoRA run's frozen base never changes
        self.shadow = {name: p.detach().float().clone() for name, p in model.named_parameters() if name not in base}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            if name in self.shadow:
                self.shadow[name].lerp_(p.detach().float(), 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        copy_into(self.shadow, state)   # the shadows may be shards (DTensor)
