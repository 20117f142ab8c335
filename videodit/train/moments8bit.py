"""8-bit optimizer moments in ``optimizer.pt``: written as plain tensors, read back exactly.

torchao keeps each large moment of ``train.optimizer=adamw8bit`` as an ``OptimState8bit``:
uint8 ``codes`` (the parameter's shape), one fp32 ``scale`` per block of 256 values and the
256-entry fp32 code map ``qmap``. Decoding and encoding again is not exact (the signed map has
no code for -1, so a block whose largest magnitude is negative gets another scale), so the
checkpoint holds the codes and scales themselves: a moment ``m`` becomes ``m_codes``,
``m_scale``, ``m_qmap``. ``optimizer.pt``, async-save snapshots and ``weights_only`` loading then
see plain tensors only, and a resumed run rebuilds the same ``OptimState8bit`` bit for bit.

DCP shards (FSDP2, TP, PP) hold torchao's ``OptimState8bit`` as it is: torchao implements
what DCP needs (``detach`` to save, a dim-0 ``slice`` at block boundaries to re-shard).

Loading into another layout or optimizer: into sharded parameters (DTensor) or into plain
AdamW the moments are decoded to fp32 (torch distributes those; AdamW8bit encodes them
again where torchao would quantize), and a param group saved by the other optimizer keeps only
the options this one has. Nothing here imports torchao until a moment is rebuilt.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
PARTS = ("codes", "scale", "qmap")


def plain_moments(state: dict) -> dict:
    """A name-keyed optimizer state dict with every 8-bit moment as its three plain tensors."""
    return {**state, "state": {name: _split(values) for name, values in state["state"].items()}}


def restored_moments(state: dict, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict:
    """The inverse of :func:`plain_moments` for this run: ``OptimState8bit`` again where this
    optimizer is 8-bit and the parameters are whole, fp32 moments otherwise."""
    rebuild = _is_8bit_optimizer(optimizer) and not any(isinstance(p, DTensor) for p in model.parameters())
    return {"state": {name: _joined(values, rebuild) for name, values in state["state"].items()},
            "param_groups": [_fitted_group(group, optimizer.param_groups[0]) for group in state["param_groups"]]}


def _fitted_group(group: dict, current: dict) -> dict:
    """A saved param group as this optimizer takes it: only the options it has (AdamW's
    ``foreach``, ``fused``, ... are not torchao's), its LR a tensor where this optimizer keeps
    one (torchao) and a number where it does not."""
    fitted = {key: value for key, value in group.items() if key in current}
    if "lr" in fitted:
        lr = float(fitted["lr"])
        fitted["lr"] = torch.tensor(lr, dtype=current["lr"].dtype) if isinstance(current["lr"], torch.Tensor) else lr
    return fitted


def _is_8bit_optimizer(optimizer) -> bool:
    return getattr(optimizer, "block_size", None) is not None   # torchao's low-bit optimizers have one


def _split(values: dict) -> dict:
    out = {}
    for name, value in values.items():
        if _is_optim_state_8bit(value):
            out.update({f"{name}_{part}": getattr(value, part) for part in PARTS})
        else:
            out[name] = value
    return out


def _joined(values: dict, rebuild: bool) -> dict:
    out = dict(values)
    for name in MOMENTS:
        keys = [f"{name}_{part}" for part in PARTS]
        if keys[0] in out:
            codes, scale, qmap = (out.pop(key) for key in keys)
            out[name] = _optim_state_8bit(codes, scale, qmap) if rebuild else _decoded(codes, scale, qmap)
    return out


def _decoded(codes: torch.Tensor, scale: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """fp32 values of 8-bit codes: the code map's value times the block's scale (torchao's rule)."""
    return (qmap[codes.int()].view(scale.numel(), -1) * scale.view(-1, 1)).view(codes.shape)


def _is_optim_state_8bit(value) -> bool:
    return type(value).__name__ == "OptimState8bit" and hasattr(value, "codes")   # no torchao import needed


def _optim_state_8bit(codes: torch.Tensor, scale: torch.Tensor, qmap: torch.Tensor):
    from torchao.optim.subclass_8bit import OptimState8bit

    # The first entry of the map is negative only for the signed map (the first moment's).
    return OptimState8bit(codes, scale, qmap, signed=bool(qmap[0] < 0))
