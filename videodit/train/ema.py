"""Exponential moving average of the model weights, kept in fp32 beside the model (sharded
like the model under FSDP, since the shadows are clones of its parameters)."""

from __future__ import annotations

import torch
from torch import nn

from videodit.parallel.state import copy_into


class EMA:
    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.shadow = {name: p.detach().float().clone() for name, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            self.shadow[name].lerp_(p.detach().float(), 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        copy_into(self.shadow, state)   # the shadows may be shards (DTensor)
