"""The optimizer of a run (``train.optimizer``) and the bytes its state takes.

- ``adamw``: torch's AdamW, fused on CUDA (every parameter updated in a few launches, FSDP2/TP
  DTensors too); parameters kept on the host (``parallel.cpu_offload``) and CPU runs keep the
  default. Its state is two fp32 moments: 8 bytes per trained parameter.
- ``adamw8bit``: torchao's ``AdamW8bit`` (``pip install videodit[lowmem]``): both moments stored
  as 8-bit codes of a dynamic (bitsandbytes-style) map, with one fp32 scale per block of
  :data:`BLOCK_SIZE` values (Dettmers et al. 2021, arXiv:2110.02861); each step decodes them to
  fp32, updates in fp32 and encodes them again. About 2 bytes per parameter, see
  :func:`optimizer_state_bytes`. Checkpoints hold the codes and scales themselves, so a resumed
  run is bitwise the same run (``train/moments8bit.py``).

Why torchao and not bitsandbytes (0.50): bitsandbytes' 8-bit optimizers are CUDA kernels, so the
tests on CPU could not run them, and FSDP does not work with them (bitsandbytes#89; for FSDP2
#1633, both open). torchao's optimizer is plain PyTorch compiled with ``torch.compile``: it runs
on CPU (tests) and CUDA alike, and its state is a tensor subclass (``OptimState8bit``) that
implements what FSDP2 and DCP need: DTensor wrapping of each rank's shard, all-gather,
``detach`` for ``dcp.save`` and a dim-0 ``slice`` at block boundaries for re-sharding on load
(pytorch/ao#484; torchao's ``test/test_low_bit_optim.py`` runs it under FSDP2 on GPUs).

torchao compiles the update of each parameter with ``torch.compile(dynamic=False)``: one graph
per distinct parameter shape, compiled on the first step (20-50 s for the 14 shapes of the tiny
test model on a 2-core CPU, 3-6 s once inductor's disk cache holds them), then one compiled call
per parameter tensor each step (about 1 ms of host time each). torchao's block size (256) is
kept: smaller blocks cost more scale bytes and did not follow AdamW more closely on the toy run
(docs/memory.md); ``bf16_stochastic_round`` only applies to bf16 parameters, and videodit
trains fp32 master weights.
"""

from __future__ import annotations


import torch

from videodit.errors import UserError
from videodit.models.lora import ADAPTER, adapter_parameters
from videodit.planner.levers import ADAM8_BLOCK, optimizer_bytes_per_param
from videodit.quiet import quiet_torchao

KINDS = ("adamw", "adamw8bit")

# torchao's defaults, which videodit keeps: 256 values share one fp32 scale, and (after
# bitsandbytes) a tensor is quantized only when it has at least 4096 values and its size is a
# multiple of the block; smaller tensors (biases, norms) keep fp32 moments.
BLOCK_SIZE = ADAM8_BLOCK   # 256
MIN_QUANTIZED = 4096
CODE_MAP_ENTRIES = 256   # the fp32 lookup table (code -> value) each quantized moment carries


def bytes_per_parameter(kind: str) -> float:
    """State bytes per trained parameter of a large tensor: 8 (AdamW's two fp32 moments) or
    2 + 2 * 4 / BLOCK_SIZE (two 8-bit codes and their share of two fp32 block scales): the
    planner's count (``planner/levers.py``)."""
    _check_kind(kind)
    return optimizer_bytes_per_param(kind)


def optimizer_state_bytes(numel: int, kind: str, *, element_size: int = 4, block_size: int = BLOCK_SIZE) -> int:
    """Exact bytes of the optimizer state of one parameter tensor of ``numel`` values (under FSDP
    the numel of this rank's shard: torchao quantizes each shard on its own), fp32 parameters
    (``element_size`` 4). The 4-byte step counter every tensor has (AdamW's too) is left out.

    adamw: 2 * numel * element_size.
    adamw8bit, where numel >= 4096 and numel % block_size == 0:
        2 * (numel + 4 * numel / block_size + 4 * 256)
      = 2 * numel + 8 * numel / block_size + 2048 (two moments, each codes + block scales + its
        256-entry fp32 code map); otherwise as adamw (fp32 moments).
    """
    _check_kind(kind)
    if kind == "adamw8bit" and is_quantized(numel, block_size):
        return 2 * (numel + 4 * (numel // block_size) + 4 * CODE_MAP_ENTRIES)
    return 2 * numel * element_size


def is_quantized(numel: int, block_size: int = BLOCK_SIZE) -> bool:
    """Whether torchao stores the moments of a tensor (shard) of ``numel`` values in 8 bits."""
    return numel >= MIN_QUANTIZED and numel % block_size == 0


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes the optimizer's state holds now, on this rank (8-bit states: codes, scales and
    code maps; DTensors: the local shard), step counters left out as in
    :func:`optimizer_state_bytes`."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += _tensor_bytes(value)
    return total


def _tensor_bytes(tensor: torch.Tensor) -> int:
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    if hasattr(tensor, "codes"):   # torchao's OptimState8bit: the tensors it wraps
        return sum(t.numel() * t.element_size() for t in (tensor.codes, tensor.scale, tensor.qmap))
    return tensor.numel() * tensor.element_size()


def require_optimizer(kind: str) -> None:
    """Refuse ``adamw8bit`` without torchao before anything is built."""
    if kind == "adamw8bit":
        _adamw8bit_class()


def build_optimizer(model: torch.nn.Module, tc, *, lora: bool, adapter: str = ADAPTER) -> torch.optim.Optimizer:
    """The optimizer of ``train.optimizer`` over the trained parameters (a LoRA run: the
    adapter's only, ``adapter`` of a shared-base run's several; otherwise every parameter)."""
    params = adapter_parameters(model, adapter) if lora else list(model.parameters())
    if tc.optimizer == "adamw8bit":
        optimizer = _adamw8bit_class()(params, lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay,
                                       block_size=BLOCK_SIZE)
    else:
        fused = bool(params) and all(p.device.type == "cuda" for p in params)
        optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=tuple(tc.betas), weight_decay=tc.weight_decay,
                                      fused=True if fused else None)
    for group in optimizer.param_groups:   # the schedule's base LR as a number, for state.json
        group.setdefault("initial_lr", tc.lr)
    return optimizer


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule: a linear warmup over ``warmup_steps``, then constant."""
    warmup = max(warmup_steps, 1)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))


def scheduler_state(scheduler) -> dict:
    """The LR scheduler's state with plain numbers: torchao keeps each group's LR as a 0-d tensor
    (a Python float would recompile its step at every new value), which the scheduler copies."""
    def plain(value):
        if isinstance(value, torch.Tensor):
            return value.item()
        if isinstance(value, (list, tuple)):
            return type(value)(plain(v) for v in value)
        return value
    return {key: plain(value) for key, value in scheduler.state_dict().items()}


def last_lr(scheduler) -> float:
    return float(scheduler.get_last_lr()[0])


def _adamw8bit_class():
    try:
        with quiet_torchao():
            from videodit.train.adamw8bit import AdamW8bit
    except ImportError:
        raise UserError("train.optimizer=adamw8bit needs torchao: pip install 'videodit[lowmem]' (or pip install "
                        "torchao), or set train.optimizer=adamw") from None
    return AdamW8bit


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise UserError(f"train.optimizer={kind!r} is not an optimizer videodit has; choose one of: {', '.join(KINDS)}")
