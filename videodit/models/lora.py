"""LoRA adapters on a model, with peft: added from outside the model's class, folded back into
plain weights for export.

peft's ``inject_adapter_in_model`` swaps each target ``nn.Linear`` in place for
``peft.tuners.lora.Linear``: the original layer becomes ``<path>.base_layer`` (its weight
``<path>.base_layer.weight``), and the adapter adds ``<path>.lora_A.default.weight`` [rank, in]
and ``<path>.lora_B.default.weight`` [out, rank], whose product, scaled by alpha/rank, is added
to the layer's output. B starts at zero, so an adapted model starts out computing exactly what
its base computes. peft freezes every other parameter; only the adapters train. The model keeps
its class and its ``blocks``, so parallelism, activation checkpointing and sampling treat it as
before.

Targets (``lora.targets``) are module paths inside every block (``attn.q``, ``cross_attn.k``,
``mlp.fc1``) or full module paths (``t_block.1``); each must name an ``nn.Linear``. A target that
names no layer as given is read in the family's other naming (``ModelSpec.lora_target``: Wan
takes diffusers' ``attn1.to_q``, ``ffn.net.0.proj``, ... for its ``self_attn.q``, ``ffn.0``, ...);
the adapters always carry the model's own names.

peft imports transformers, which takes seconds, so it is imported only when LoRA is used:
:func:`is_lora_layer` answers False without importing it.
"""

from __future__ import annotations

import contextlib
import re
import sys

from torch import nn

from videodit.config import LoraConfig
from videodit.errors import UserError
from videodit.models.spec import model_parts

ADAPTER = "default"          # peft's adapter name; it appears in the parameter names


def scale_numerator(cfg: LoraConfig) -> float:
    """peft's ``lora_alpha``: the adapter's output is scaled by alpha / rank."""
    return float(cfg.rank if cfg.alpha is None else cfg.alpha)


def _block_names(model: nn.Module) -> list[str]:
    blocks = {id(block) for block in getattr(model, "blocks", [])}
    return [name for name, module in model.named_modules() if id(module) in blocks]


def _translation(model: nn.Module):
    """The family's ``lora_target`` (other namings -> own names); as given for a model of no family."""
    from videodit.models.families import spec_of
    try:
        return spec_of(model).lora_target
    except TypeError:
        return lambda name: name


def _resolve(modules: dict[str, nn.Module], blocks: list[str], target: str) -> list[str] | None:
    """The Linear layers ``target`` names inside every block (of each kind that has it: the
    MMDiT's double blocks have ``img_attn.q_proj``, its single blocks ``q_proj``), else as a
    full path; None: none."""
    has = {block: isinstance(modules.get(f"{block}.{target}"), nn.Linear) for block in blocks}
    kinds = {type(modules[block]) for block, found in has.items() if found}
    inside = [f"{block}.{target}" for block in blocks if type(modules[block]) in kinds]
    if inside and all(has[block] for block in blocks if type(modules[block]) in kinds):
        return inside
    if isinstance(modules.get(target), nn.Linear):
        return [target]
    return None


def target_paths(model: nn.Module, targets: list[str]) -> list[str]:
    """The full module paths of the Linear layers ``targets`` names (see the module docstring),
    in model order, in each expert of a two-expert model; a target that names no Linear layer
    is a one-line UserError."""
    parts = model_parts(model)
    if len(parts) > 1:
        return [prefix + path for prefix, part in parts for path in target_paths(part, targets)]
    modules = dict(model.named_modules())
    blocks = _block_names(model)
    translate = _translation(model)
    chosen = set()
    for target in targets:
        paths = _resolve(modules, blocks, target)
        if paths is None and translate(target) != target:
            paths = _resolve(modules, blocks, translate(target))
        if paths is not None:
            chosen.update(paths)
        else:
            linear = sorted({name.split(".", 2)[2] for name, m in modules.items()
                             if isinstance(m, nn.Linear) and name.count(".") >= 2
                             and name.split(".", 2)[0] + "." + name.split(".", 2)[1] in blocks})
            raise UserError(f"lora.targets: {target!r} is not a Linear layer of every block nor of the model; "
                            f"inside a block: {', '.join(linear)}")
    return [name for name in modules if name in chosen]


def target_shapes(model: nn.Module, cfg: LoraConfig) -> dict[str, tuple[int, int]]:
    """``{path: (in_features, out_features)}`` of every adapted layer (works on a meta model);
    a ``cfg.rank`` above the narrowest one's smaller side is a one-line UserError (alpha > 0 is
    the config's own bound)."""
    modules = dict(model.named_modules())
    shapes = {path: (modules[path].in_features, modules[path].out_features)
              for path in target_paths(model, cfg.targets)}
    check_rank(cfg.rank, shapes)
    return shapes


def check_rank(rank: int, shapes: dict[str, tuple[int, int]]) -> None:
    """Refuse a rank above the smaller side (in or out features) of an adapted layer: its
    adapter's A [rank, in] and B [out, rank] would hold more than a full update of the layer
    (rank 1e9 would ask for terabytes) and could learn nothing more."""
    if not shapes:
        return
    path, (fan_in, fan_out) = min(shapes.items(), key=lambda item: min(item[1]))
    if rank > min(fan_in, fan_out):
        raise UserError(f"lora.rank={rank} is more than {path} can take (in {fan_in}, out {fan_out} features; "
                        f"the narrowest adapted layer): give lora.rank <= {min(fan_in, fan_out)}, or leave that "
                        "layer out of lora.targets")


def adapter_parameter_count(model: nn.Module, cfg: LoraConfig) -> int:
    """Parameters the adapters add: rank x (in + out) per adapted layer."""
    return sum(cfg.rank * (i + o) for i, o in target_shapes(model, cfg).values()) if cfg.rank else 0


def add_adapters(model: nn.Module, cfg: LoraConfig, names: tuple[str, ...] = (ADAPTER,)) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place (peft) and freeze everything else; returns
    ``model``. The adapters are created on each base layer's device, in fp32. Several ``names``:
    one adapter each on the same layers (a shared-base distillation run's student and critic),
    the first one active."""
    if cfg.rank < 1:
        raise ValueError("add_adapters needs lora.rank >= 1")
    paths = list(target_shapes(model, cfg))   # checks the rank against the layers before peft allocates
    import warnings

    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    config = PeftLoraConfig(r=cfg.rank, lora_alpha=scale_numerator(cfg), lora_dropout=cfg.dropout, bias="none",
                            target_modules="|".join(re.escape(path) for path in paths))   # full match, exact
    for name in names:
        with warnings.catch_warnings():   # peft warns that a second adapter finds its config already there
            warnings.simplefilter("ignore")
            inject_adapter_in_model(config, model, adapter_name=name)
    set_adapter_state(lora_layers(model), names[0])
    return model


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA layer (False without importing peft when it is not loaded)."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.lora import LoraLayer
    return isinstance(module, LoraLayer)


def adapter_keys(adapter: str = ADAPTER) -> tuple[str, str]:
    return (f".lora_A.{adapter}.", f".lora_B.{adapter}.")


def is_adapter_name(name: str, adapter: str = ADAPTER) -> bool:
    """Whether a parameter name belongs to ``adapter`` (``...lora_A.default.weight``)."""
    return any(key in name for key in adapter_keys(adapter))


def base_parameter_names(model: nn.Module, adapter: str = ADAPTER) -> set[str]:
    """What a LoRA model's ``adapter`` does not own: the frozen base, and a shared-base run's
    other adapters (empty without adapters)."""
    names = [name for name, _ in model.named_parameters()]
    if not any(is_adapter_name(name, adapter) for name in names):
        return set()
    return {name for name in names if not is_adapter_name(name, adapter)}


def adapter_parameters(model: nn.Module, adapter: str = ADAPTER) -> list[nn.Parameter]:
    """The parameters ``adapter`` trains (every parameter of a model without adapters)."""
    base = base_parameter_names(model, adapter)
    return [p for name, p in model.named_parameters() if name not in base]


# ---------------------------------------------------------------- which adapter computes
#
# A shared-base run's roles are adapters of one model: the student's, the critic's, and none
# at all (the teacher is the base). Which one a forward uses is state on every LoRA layer, so it
# is set for the whole model at once and put back afterwards; activation checkpointing records
# it with each forward and sets it again when backward recomputes (parallel/activation_checkpoint.py).

def lora_layers(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if is_lora_layer(module)]


def adapter_names(layers: list[nn.Module]) -> list[str]:
    """The adapters ``layers`` hold (one, or a shared-base run's several; none without LoRA)."""
    return list(layers[0].lora_A) if layers else []


def adapter_state(layers: list[nn.Module]) -> str | None:
    """The adapter ``layers`` compute with (None: adapters off, the base alone)."""
    if not layers or layers[0].disable_adapters:
        return None
    return layers[0].active_adapters[0]


def set_adapter_state(layers: list[nn.Module], adapter: str | None) -> None:
    """Make ``layers`` compute with ``adapter`` (None: the base alone). peft's own switches
    (``set_adapter``, ``enable_adapters``) also change ``requires_grad``, which the optimizers
    and DDP's hooks rely on staying put, so only the switches themselves are set here."""
    for layer in layers:
        layer._disable_adapters = adapter is None
        if adapter is not None:
            layer._active_adapter = [adapter]


@contextlib.contextmanager
def using_adapter(layers: list[nn.Module], adapter: str | None):
    """A context in which ``layers`` compute with ``adapter`` (None: the base alone)."""
    before = adapter_state(layers)
    set_adapter_state(layers, adapter)
    try:
        yield
    finally:
        set_adapter_state(layers, before)


def base_name(name: str) -> str:
    """The name a parameter of an adapted layer's base has in the plain model
    (``attn.q.base_layer.weight`` -> ``attn.q.weight``)."""
    return name.replace(".base_layer.", ".")


def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (peft's merge, refusing NaN/inf) and put the
    plain layers back: the result has the base model's parameter names. In place."""
    for name, module in list(model.named_modules()):
        if is_lora_layer(module):
            module.merge(safe_merge=True)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config
    return model
