"""A LoRA run's adapters renamed into the key conventions other tools load (``videodit ckpt export
--lora-format``). Pure conversions, no files: ``lora_export.py`` writes them.

videodit's adapters carry peft's in-model names, ``<module>.lora_A.default.weight`` (A, [rank, in])
and ``<module>.lora_B.default.weight`` (B, [out, rank]); the layer adds ``alpha / rank * B @ A``.
No format keeps peft's ``.default`` adapter name: keys that carry it are a known reason a LoRA
"won't load" elsewhere. The key names are the interface; docs/export.md gives the sources read.

- ``diffusers``: ``transformer.<diffusers module>.lora_A.weight`` / ``.lora_B.weight``. diffusers'
  Wan loader passes no network alphas, and without metadata takes alpha = rank (scale 1), so B is
  written pre-multiplied by alpha / rank, and the ``lora_adapter_metadata`` (as diffusers'
  ``save_lora_weights`` writes it) says ``r = lora_alpha = rank``: the same effect in every
  diffusers version, with or without metadata support.
- ``comfyui``, by the family's ``comfyui_lora_keys``: ComfyUI maps ``diffusion_model.<module>`` onto
  the weight ``diffusion_model.<module>.weight``. ``lora_down`` (Wan): ``.lora_down.weight`` (A),
  ``.lora_up.weight`` (B) and ``.alpha``, kept as trained; ComfyUI adds ``strength * alpha / rank *
  up @ down``. ``lora_A`` (LTX-2: LTX's own LoRA files, as ltx-trainer writes them): ``.lora_A.weight``
  / ``.lora_B.weight`` and no alpha, so B is written pre-multiplied by alpha / rank: ltx-core adds
  ``strength * B @ A``, ComfyUI takes a missing alpha as scale 1, and diffusers' LTX-2 loader
  (``_convert_non_diffusers_ltx2_lora_to_diffusers``, alpha = rank) refuses any key without "lora".
- ``peft``: ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight`` and
  ``adapter_config.json`` (``lora_alpha`` = alpha), what ``PeftModel.save_pretrained`` writes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import torch

from videodit.errors import UserError

LORA_FORMATS = ("diffusers", "comfyui", "peft")

_ADAPTER_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])\.default\.weight")

Layers = dict[str, tuple[torch.Tensor, torch.Tensor]]   # module path -> (A [rank, in], B [out, rank])


def adapter_layers(adapters: dict[str, torch.Tensor], where: str) -> Layers:
    """``{module path: (A, B)}`` of a checkpoint's adapter tensors (peft's in-model names), in
    their order; a name or shape that is not a LoRA pair is a one-line UserError."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapters.items():
        match = _ADAPTER_KEY.fullmatch(name)
        if match is None or tensor.dim() != 2:
            raise UserError(f"{where}: {name!r} is not a LoRA adapter weight of videodit; export a checkpoint "
                            "written by videodit's LoRA training")
        halves.setdefault(match["module"], {})[match["which"]] = tensor
    layers = {}
    for module, pair in halves.items():
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.shape[0] != b.shape[1]:
            raise UserError(f"{where}: the adapter of {module} lacks its lora_A or lora_B half, or their ranks "
                            "differ; export a checkpoint written by videodit's LoRA training")
        layers[module] = (a, b)
    if not layers:
        raise UserError(f"{where} holds no adapter weights; export a checkpoint of a LoRA run (lora.rank > 0)")
    return layers


def check_format(fmt: str, family: str, loadable: tuple[str, ...]) -> None:
    """Refuse, in one line, a format whose files load nowhere for ``family`` (``loadable``: its
    spec's ``lora_formats``)."""
    if fmt not in LORA_FORMATS:
        raise UserError(f"--lora-format {fmt!r} is not a LoRA format; choose one of: {', '.join(LORA_FORMATS)}")
    if fmt not in loadable:
        raise UserError(f"--lora-format {fmt} does not apply to a {family} LoRA run (diffusers and ComfyUI load "
                        f"Wan and LTX-2 LoRAs, not {family} ones); export it as --lora-format "
                        f"{' or '.join(loadable)}, or merged with --merge-lora")


def layer_rank(layers: Layers) -> int:
    """The one rank of the adapters (videodit trains one ``lora.rank``)."""
    ranks = {a.shape[0] for a, _ in layers.values()}
    if len(ranks) != 1:
        raise UserError(f"the adapters have {len(ranks)} ranks; a LoRA file has one: export a checkpoint written "
                        "by videodit's LoRA training")
    return ranks.pop()


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.detach().to("cpu", dtype).contiguous()


def scaled_lora(layers: Layers, alpha: float, prefix: str, rename: Callable[[str], str],
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """``<prefix><module>.lora_A.weight`` / ``.lora_B.weight`` with alpha / rank folded into B: the
    adapters as a loader that knows no alpha (scale 1) applies them."""
    rank = layer_rank(layers)
    tensors = {}
    for module, (a, b) in layers.items():
        name = f"{prefix}{rename(module)}"
        tensors[f"{name}.lora_A.weight"] = _cast(a, dtype)
        tensors[f"{name}.lora_B.weight"] = _cast(b.float() * (alpha / rank), dtype)   # the scale folded in
    return tensors


def diffusers_lora(layers: Layers, alpha: float, rename: Callable[[str], str],
                   dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, safetensors metadata) for diffusers' ``load_lora_weights``; ``rename``: the
    family's module name in diffusers (Wan: ``layouts.diffusers_name``)."""
    rank = layer_rank(layers)
    tensors = scaled_lora(layers, alpha, "transformer.", rename, dtype)
    # rank_pattern and alpha_pattern (empty: one rank and alpha for every module) are read, not
    # defaulted, by diffusers 0.38-0.39's loader: a file without them fails there with a KeyError.
    config = {"transformer.r": rank, "transformer.lora_alpha": rank,
              "transformer.target_modules": [rename(module) for module in layers],
              "transformer.rank_pattern": {}, "transformer.alpha_pattern": {}}
    return tensors, {"lora_adapter_metadata": json.dumps(config, indent=2, sort_keys=True)}


def comfyui_lora(layers: Layers, alpha: float, dtype: torch.dtype = torch.float32,
                 keys: str = "lora_down") -> dict[str, torch.Tensor]:
    """Tensors for ComfyUI's LoRA loaders (``LoraLoaderModelOnly``), under the model's original names:
    ``keys="lora_down"`` down/up/alpha as trained (Wan), ``"lora_A"`` LTX's peft keys with the scale
    folded into B (LTX-2: what LTX's own loaders read too)."""
    if keys == "lora_A":
        return scaled_lora(layers, alpha, "diffusion_model.", lambda module: module, dtype)
    tensors = {}
    for module, (a, b) in layers.items():
        name = f"diffusion_model.{module}"
        tensors[f"{name}.lora_down.weight"] = _cast(a, dtype)
        tensors[f"{name}.lora_up.weight"] = _cast(b, dtype)
        tensors[f"{name}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)   # read with .item()
    return tensors


def peft_lora(layers: Layers, alpha: float, dropout: float, base: str | None, model_class: type,
              dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], str]:
    """(``adapter_model.safetensors`` tensors, ``adapter_config.json`` text) as peft's
    ``PeftModel.save_pretrained`` writes them for a model of ``model_class`` (a custom model: no
    task type, and peft's ``auto_mapping`` naming the class)."""
    from peft import LoraConfig

    config = LoraConfig(r=layer_rank(layers), lora_alpha=alpha, lora_dropout=dropout, bias="none",
                        target_modules=list(layers), base_model_name_or_path=base,
                        inference_mode=True)   # as save_pretrained records it
    record = {key: sorted(value) if isinstance(value, set) else value for key, value in config.to_dict().items()}
    record["auto_mapping"] = {"base_model_class": model_class.__name__, "parent_library": model_class.__module__}
    tensors = {}
    for module, (a, b) in layers.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = _cast(a, dtype)
        tensors[f"base_model.model.{module}.lora_B.weight"] = _cast(b, dtype)
    return tensors, json.dumps(record, indent=2, sort_keys=True)
