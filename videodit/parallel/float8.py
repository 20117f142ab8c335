"""fp8 compute (``train.fp8``): torchao's float8 training for the linear layers of the blocks.

:func:`apply_float8` swaps every ``nn.Linear`` inside ``model.blocks`` (attention q/k/v/o, self
and cross, and the MLP) for torchao's ``Float8Linear``: each matmul of forward and backward
casts its two operands to float8 (input and weight e4m3, the output gradient e5m2) with one
dynamic scale per tensor and runs ``torch._scaled_mm``. Master weights, gradients, optimizer
state and checkpoints stay as they are (fp32, the same names): only the matmuls change.

What is not converted, and why:

* the embedders, the time/caption MLPs and the head: a few small matmuls outside the repeated
  blocks (no measurable speed-up) that set the scale of everything after them, so their
  rounding error reaches every block (the precision-sensitive ends of the network, which
  torchtitan also keeps out: its ``output`` filter);
* norms, modulation tables and attention itself: not linear layers;
* a block linear with a side that is not a multiple of 16 (the ``_scaled_mm`` kernel's
  requirement; torchao converts such a layer anyway and the GPU matmul then fails at the first
  step, so :func:`fp8_eligible` keeps it in high precision, the same rule on CPU and GPU).

Scaling: tensorwise (torchao's default recipe), not rowwise. It is the fastest recipe (cuBLAS's
tensorwise kernel), the only one FSDP2's float8 all-gather supports, and its kernel writes the
output in any dtype, so it runs from fp32 master weights without FSDP (the rowwise kernel writes
bf16 only: torchao casts fp32 outputs back afterwards). Rowwise is more accurate on
outlier-heavy activations; it can be added as a recipe option when a model needs it.

On CPU (tests) torchao's emulation runs the same casts and rounding with fp32 matmuls; on
CUDA the float8 kernels need compute capability >= 8.9. torchao pads the inner dimension of
each matmul to a multiple of 16 (``pad_inner_dim``): a weight gradient's inner dimension is the
batch's token count, which video buckets do not keep a multiple of 16.

Under FSDP2 (and HSDP) the converted weights are all-gathered in float8 (half the bytes of a
bf16 gather; ``enable_fsdp_float8_all_gather``), each with the scale of the whole tensor, and
:func:`precompute_scales_after_step` computes every weight's scale after each optimizer step in
one all-reduce instead of one per weight at the next gather (``precompute_float8_dynamic_scale_
for_fsdp``, torchtitan's post-optimizer hook). A step's numerics do not depend on it.

Order (``parallelize``): after the pipeline split (only this rank's blocks) and before TP, SP,
activation checkpointing, compile and FSDP2, as torchtitan converts its model before
parallelising it. ``train.compile`` then traces the float8 casts into the block's graph, which
fuses them with their neighbours; torchao and torchtitan call compile necessary for a speed-up,
eager float8 is often slower than bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from videodit.errors import UserError
from videodit.models.lowmem import fp8_eligible
from videodit.quiet import quiet_torchao

MIN_CAPABILITY = (8, 9)            # CUDA compute capability with float8 matmuls (Ada, Hopper, Blackwell)


@dataclass(frozen=True)
class Float8Options:
    emulate: bool = False           # CPU: float8 rounding with fp32 matmuls (torchao's emulation)
    fsdp_all_gather: bool = False   # FSDP2 gathers converted weights in float8


def float8_options(train, device: torch.device, data_parallel: str) -> Float8Options | None:
    """The options of ``train.fp8`` (a ``TrainConfig``) on ``device`` under ``data_parallel``
    (``ParallelDims.data_parallel``); None when fp8 compute is off."""
    if not train.fp8:
        return None
    return Float8Options(emulate=device.type != "cuda", fsdp_all_gather=data_parallel in ("fsdp", "hsdp"))


def check_float8(device: torch.device, *, tp: int, lora_rank: int) -> None:
    """Refuse, in one line each, what ``train.fp8=true`` cannot run (before any model is built)."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            raise UserError(f"train.fp8 needs float8 matmuls: a GPU of compute capability >= 8.9 (L4, L40S, RTX "
                            f"4090, H100, B200); {torch.cuda.get_device_name(device)} is "
                            f"{capability[0]}.{capability[1]}: set train.fp8=false")
    elif device.type != "cpu":
        raise UserError(f"train.fp8 runs on CUDA (float8 matmuls) or on CPU (emulated), not {device.type}; "
                        "set train.fp8=false")
    if lora_rank:
        raise UserError("train.fp8 with LoRA (lora.rank > 0) is not supported: torchao's float8 linear always "
                        "computes the weight gradient, which a frozen base discards, so it would add matmuls "
                        "rather than save time; set train.fp8=false (lora.base_dtype=fp8 stores the frozen base in "
                        "float8)")
    if tp > 1:
        raise UserError(f"train.fp8 with parallel.tp={tp} is not supported (torchao's float8 tensor-parallel "
                        "styles are not wired in); shard with parallel.dp_shard (FSDP2, float8 all-gather) or "
                        "parallel.sp instead")
    _import_float8()   # not installed: say so now, not after the data and model are built


def convert_blocks(blocks, options: Float8Options) -> int:
    """Swap the eligible linear layers of every block in ``blocks`` for torchao's ``Float8Linear``,
    in place. Returns how many were swapped."""
    float8 = _import_float8()
    config = float8.Float8LinearConfig(emulate=options.emulate, pad_inner_dim=True,
                                       enable_fsdp_float8_all_gather=options.fsdp_all_gather)
    converted = 0
    for block in blocks:
        lora = next((name for name, module in block.named_modules() if _is_lora_layer(module)), None)
        if lora is not None:
            raise UserError(f"train.fp8 cannot convert the LoRA layer {lora} of a block: train LoRA with "
                            "train.fp8=false")
        before = len(float8_layers(block))
        float8.convert_to_float8_training(block, config=config,
                                          module_filter_fn=lambda module, _name: fp8_eligible(module))
        converted += len(float8_layers(block)) - before
    return converted


def apply_float8(model: nn.Module, options: Float8Options) -> list[str]:
    """fp8 compute for the blocks of ``model`` (a whole model, a pipeline stage or one expert):
    returns the float8 layers' names inside ``model``."""
    convert_blocks(model.blocks, options)
    return float8_layers(model)


def precompute_scales_after_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """With FSDP2's float8 all-gather: after every ``optimizer.step()``, compute the float8 scales
    of all of ``model``'s converted weights in one all-reduce (instead of one all-reduce per
    weight when it is next gathered). Nothing to do otherwise.

    A precomputed scale belongs to the weights the step left. Loading a checkpoint changes them
    without a step (and DCP's loading runs a zero-learning-rate step on the old weights first, to
    create the optimizer state), so loading ``model``'s state dict drops the scales: the next
    gather computes them from the loaded weights, as a fresh run does (bitwise resume)."""
    if not any(_gathers_float8(module) for module in model.modules()):
        return
    float8 = _import_float8()
    optimizer.register_step_post_hook(lambda *_: float8.precompute_float8_dynamic_scale_for_fsdp(model))

    def drop_scales(*_):
        for module in model.modules():
            if _gathers_float8(module):
                local = getattr(module.weight, "_local_tensor", module.weight)   # FSDP2's DTensor shard
                local._precomputed_scale = None
    model.register_load_state_dict_post_hook(drop_scales)


def float8_layers(model: nn.Module) -> list[str]:
    """The names of ``model``'s float8 linear layers (none without ``train.fp8``)."""
    return [name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"]


def _gathers_float8(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return type(module).__name__ == "Float8Linear" and bool(getattr(config, "enable_fsdp_float8_all_gather", False))


def _is_lora_layer(module: nn.Module) -> bool:
    from videodit.models.lora import is_lora_layer
    return is_lora_layer(module)


def _import_float8():
    """``torchao.float8``, imported quietly: torchao logs a warning for every optional kernel
    library it cannot load (mxfp8, CUTLASS sm90a), none of which float8 training uses."""
    try:
        with quiet_torchao():
            import torchao.float8 as float8
    except ImportError:
        raise UserError("train.fp8 needs torchao: pip install 'videodit[lowmem]' (or pip install torchao), or "
                        "set train.fp8=false") from None
    return float8


