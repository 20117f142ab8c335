"""torchao's AdamW8bit, as ``train.optimizer=adamw8bit`` uses it.

One change: after loading a state, moments that arrive as plain fp32 tensors (saved by plain
AdamW, or decoded for another layout: ``train/moments8bit.py``) are encoded in 8 bits where
torchao itself would quantize them (a tensor, or FSDP2 shard, of at least 4096 values and a
multiple of the block size), so a resumed run holds the memory it is planned for.
"""

from __future__ import annotations

import warnings

from torch.distributed.tensor import DTensor
from torchao.optim import AdamW8bit as TorchaoAdamW8bit
from torchao.optim.subclass_8bit import OptimState8bit

from videodit.train.moments8bit import MOMENTS

# Said at the first compile of every run: it concerns AOT autograd's cache, which an optimizer
# step (no autograd) does not use.
warnings.filterwarnings("ignore", message="OptimState8bit does not implement _stable_hash_for_caching")


class AdamW8bit(TorchaoAdamW8bit):
    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                for name in MOMENTS:
                    value = state.get(name)
                    if value is None or _is_8bit(value):
                        continue
                    buffer = self._new_buffer(p, signed=name == "exp_avg")
                    if _is_8bit(buffer):
                        buffer.copy_(value)
                        state[name] = buffer


def _is_8bit(value) -> bool:
    return isinstance(value.to_local() if isinstance(value, DTensor) else value, OptimState8bit)
