"""Write the golden fixtures of Wan 2.1 I2V's CLIP image encoder (tests/fixtures/wan_clip/) with Wan's code.

    python scripts/make_wan_clip_fixtures.py /path/to/Wan2.1 [--out tests/fixtures/wan_clip] [--no-check]

The checkout is Wan-Video/Wan2.1 at 9737cba. As in ``make_wan_fixtures.py`` (whose helpers this
reuses: the stub ``wan`` packages, the dense fp32 stand-in for flash-attention, the seeded
weights), only ``wan/modules/clip.py`` is used, with its XLM-RoBERTa text tower; its tokenizer
module is replaced by a placeholder (only ``CLIPModel.__init__`` uses it, and that is bypassed:
it loads the released checkpoint), and, when torchvision is absent, ``torchvision.transforms`` by
a stand-in whose ``Normalize`` computes what torchvision's does (``(x - mean) / std`` per channel);
``CLIPModel.visual`` uses only that transform.

The model is Wan's own ``clip_xlm_roberta_vit_h_14`` factory with tiny sizes: a ViT with patch 14
(as released) at image size 56 (4 x 4 patches + the class token = 17 tokens), width 32, 2 heads,
3 blocks, MLP 64, GELU, pre-norm; a one-block XLM-RoBERTa of width 16 beside it; every weight
seeded random (norm scales and biases included). Wan's ``CLIPModel.visual`` runs on frames of odd
sizes (squashed to 56 x 56 by its bicubic resize), with ``use_31_block=True`` in fp32. Written into
``--out`` (about 470 KB):

- ``wan/models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth``: the whole tiny CLIP's state
  dict as Wan's release holds it (``visual.*``, ``textual.*``, ``log_scale``; ``torch.save``).
- ``diffusers/image_encoder/``: the same vision tower as the release's diffusers folder holds it:
  config.json (``CLIPVisionModel``, ``hidden_act: gelu``) and model.safetensors with
  transformers 4.x's ``vision_model.*`` names (as Wan-AI/Wan2.1-I2V-14B-480P-Diffusers has; written
  here directly, since transformers 5's ``save_pretrained`` drops that prefix). The renaming is
  done here, walking Wan's modules, independently of videodit's converter.
- ``cases.safetensors``: per case, ``{case}.pixels`` (uint8 [B, 3, H, W]; the frames are
  ``pixels / 127.5 - 1``, in [-1, 1]) and ``{case}.features``, Wan's fp32 output [B, 17, 32]; and
  ``cases.json``: the sizes, and the diffusers folder's deviation from Wan through transformers'
  own ``hidden_states[-2]`` (the way diffusers' pipeline reads it).

Deterministic for the same checkout and library versions. Afterwards it prints videodit's
deviations from Wan for both layouts (``--no-check`` skips this). tests/models/test_wan_clip.py
reads the fixtures; it never needs Wan's code.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_wan_fixtures import import_wan, randomize  # noqa: E402  (the DiT fixtures' helpers)

REPO = Path(__file__).resolve().parents[1]
SEED = 2027
WAN_CLIP_FILE = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
# Overrides of clip_xlm_roberta_vit_h_14's config (patch 14, GELU, token pooling, pre-norm stay Wan's).
TINY = dict(embed_dim=16, image_size=56, vision_dim=32, vision_mlp_ratio=2, vision_heads=2, vision_layers=3,
            vocab_size=32, max_text_len=8, text_dim=16, text_heads=2, text_layers=1, text_dropout=0.0)
# case: (frames, height, width): one upsampled, one downsampled, neither square.
CASES = {"upsample": (2, 37, 45), "downsample": (1, 90, 70)}


# ------------------------------------------------------------------------------- Wan's code


def _torchvision_stand_in() -> None:
    """``torchvision.transforms`` as far as wan/modules/clip.py uses it (only ``Normalize`` runs)."""
    transforms = types.ModuleType("torchvision.transforms")

    class Compose:
        def __init__(self, steps):
            self.transforms = list(steps)

    class Normalize:   # torchvision.transforms.functional.normalize on a float tensor
        def __init__(self, mean, std):
            self.mean, self.std = mean, std

        def __call__(self, x):
            mean = torch.as_tensor(self.mean, dtype=x.dtype, device=x.device).view(-1, 1, 1)
            std = torch.as_tensor(self.std, dtype=x.dtype, device=x.device).view(-1, 1, 1)
            return x.clone().sub_(mean).div_(std)

    class Unused:   # Resize / ToTensor: built by Wan's _clip, never called by CLIPModel.visual
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, x):
            raise NotImplementedError("the torchvision stand-in only normalises")

    transforms.Compose, transforms.Normalize = Compose, Normalize
    transforms.Resize = transforms.ToTensor = Unused
    transforms.InterpolationMode = types.SimpleNamespace(BICUBIC="bicubic")
    package = types.ModuleType("torchvision")
    package.transforms = transforms
    sys.modules.update({"torchvision": package, "torchvision.transforms": transforms})


def import_wan_clip(checkout: Path):
    """Wan's ``wan.modules.clip`` without the package ``__init__``s, its tokenizer or torchvision."""
    import_wan(checkout)   # stub packages + the flash-attention stand-in (and wan.modules.model)
    if importlib.util.find_spec("torchvision") is None:
        _torchvision_stand_in()
    tokenizers = types.ModuleType("wan.modules.tokenizers")
    tokenizers.HuggingfaceTokenizer = None   # used by CLIPModel.__init__ only
    sys.modules["wan.modules.tokenizers"] = tokenizers
    spec = importlib.util.spec_from_file_location("wan.modules.clip", checkout / "wan" / "modules" / "clip.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["wan.modules.clip"] = module
    spec.loader.exec_module(module)
    return module


def wan_visual(clip_module, model, transforms, frames: torch.Tensor) -> torch.Tensor:
    """``CLIPModel.visual`` as image2video.py calls it (one [C, 1, H, W] video per frame), on the
    tiny model: ``CLIPModel.__init__`` is bypassed because it loads the released checkpoint."""
    clip = object.__new__(clip_module.CLIPModel)
    clip.model, clip.transforms, clip.dtype, clip.device = model, transforms, torch.float32, "cpu"
    with torch.no_grad():
        return clip.visual([frame[:, None] for frame in frames])


# ------------------------------------------------------------------------------- diffusers' layout


def transformers_layout(visual) -> dict[str, torch.Tensor]:
    """The tiny ViT's tensors under the release's ``CLIPVisionModel`` names, read off Wan's
    modules (not videodit's converter): ``to_qkv``'s rows are q, k, v, each all heads."""
    out = {"embeddings.class_embedding": visual.cls_embedding.reshape(-1),
           "embeddings.patch_embedding.weight": visual.patch_embedding.weight,
           "embeddings.position_embedding.weight": visual.pos_embedding[0],
           "pre_layrnorm.weight": visual.pre_norm.weight, "pre_layrnorm.bias": visual.pre_norm.bias,
           "post_layernorm.weight": visual.post_norm.weight, "post_layernorm.bias": visual.post_norm.bias}
    for i, block in enumerate(visual.transformer):
        prefix = f"encoder.layers.{i}."
        width = block.attn.dim
        for j, part in enumerate("qkv"):
            rows = slice(j * width, (j + 1) * width)
            out[prefix + f"self_attn.{part}_proj.weight"] = block.attn.to_qkv.weight[rows]
            out[prefix + f"self_attn.{part}_proj.bias"] = block.attn.to_qkv.bias[rows]
        pairs = {"self_attn.out_proj": block.attn.proj, "layer_norm1": block.norm1, "layer_norm2": block.norm2,
                 "mlp.fc1": block.mlp[0], "mlp.fc2": block.mlp[2]}
        for name, layer in pairs.items():
            out[prefix + name + ".weight"], out[prefix + name + ".bias"] = layer.weight, layer.bias
    return {"vision_model." + k: v.detach().clone().contiguous() for k, v in out.items()}


def transformers_config(visual) -> dict:
    """config.json as the release's image_encoder/ has it, at the tiny sizes."""
    return {"architectures": ["CLIPVisionModel"], "attention_dropout": 0.0, "dropout": 0.0, "hidden_act": "gelu",
            "hidden_size": visual.dim, "image_size": visual.image_size, "initializer_factor": 1.0,
            "initializer_range": 0.02, "intermediate_size": visual.transformer[0].mlp[0].out_features,
            "layer_norm_eps": 1e-05, "model_type": "clip_vision_model", "num_attention_heads": visual.num_heads,
            "num_channels": 3, "num_hidden_layers": visual.num_layers, "patch_size": visual.patch_size,
            "projection_dim": visual.out_dim, "torch_dtype": "float32", "transformers_version": "4.49.0"}


def wan_pixels(clip_module, transforms, image_size: int, frames: torch.Tensor) -> torch.Tensor:
    """What Wan's ``visual`` hands its ViT: the same call with a model that returns its input."""
    echo = types.SimpleNamespace(image_size=image_size, visual=lambda x, use_31_block: x)
    return wan_visual(clip_module, echo, transforms, frames)


# ------------------------------------------------------------------------------- writing


def write(clip_module, out: Path) -> dict:
    from transformers import CLIPVisionModel

    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    model, transforms = clip_module.clip_xlm_roberta_vit_h_14(pretrained=False, return_transforms=True,
                                                              dtype=torch.float32, device="cpu", **TINY)
    model = model.eval().requires_grad_(False)
    randomize(model, generator)
    (out / "wan").mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / "wan" / WAN_CLIP_FILE)

    folder = out / "diffusers" / "image_encoder"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(transformers_layout(model.visual), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(transformers_config(model.visual), indent=2) + "\n")
    theirs = CLIPVisionModel.from_pretrained(str(folder), local_files_only=True, use_safetensors=True).eval()

    tensors, meta = {}, {"tiny": TINY, "patch_size": model.patch_size, "num_heads": model.vision_heads,
                         "num_tokens": model.visual.num_patches + 1, "cases": {}}
    for name, (count, height, width) in CASES.items():
        pixels_u8 = torch.randint(0, 256, (count, 3, height, width), generator=generator, dtype=torch.uint8)
        frames = pixels_u8.float() / 127.5 - 1
        features = wan_visual(clip_module, model, transforms, frames)
        with torch.no_grad():   # diffusers' pipeline takes hidden_states[-2]; the pixels are Wan's
            pixels = wan_pixels(clip_module, transforms, model.image_size, frames)
            hf = theirs(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
        rel = float((hf - features).abs().max() / features.abs().max())
        meta["cases"][name] = {"frames": [count, 3, height, width], "features": list(features.shape),
                               "transformers_hidden_states_-2_vs_wan_rel": rel}
        print(f"{name}: frames {tuple(frames.shape)} -> features {tuple(features.shape)}; "
              f"transformers' hidden_states[-2] on the diffusers folder vs Wan: rel {rel:.2e}")
        tensors.update({f"{name}.pixels": pixels_u8, f"{name}.features": features.contiguous()})
    save_file(tensors, str(out / "cases.safetensors"), metadata={"format": "pt"})
    (out / "cases.json").write_text(json.dumps(meta, indent=1) + "\n")
    return tensors


def check(out: Path, tensors: dict, num_heads: int) -> None:
    """videodit's features from both layouts against Wan's."""
    sys.path.insert(0, str(REPO))
    from videodit.models.wan.clip import load_wan_image_encoder

    layouts = {"wan .pth": (out / "wan" / WAN_CLIP_FILE, num_heads), "diffusers folder": (out / "diffusers", None)}
    for layout, (path, heads) in layouts.items():
        encoder = load_wan_image_encoder(path, num_heads=heads)
        for name in CASES:
            expected = tensors[f"{name}.features"]
            frames = tensors[f"{name}.pixels"].float() / 127.5 - 1
            deviation = (encoder.encode(frames) - expected).abs().max()
            rel = deviation / expected.abs().max()
            print(f"videodit, {layout:16s} {name:10s}: max abs {deviation:.2e} rel {rel:.2e}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wan_checkout", type=Path)
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "wan_clip")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    # Wan's torch.cuda.amp.autocast warns on every call on a CPU-only machine.
    warnings.filterwarnings("ignore", message=".*autocast.*")
    clip_module = import_wan_clip(args.wan_checkout.resolve())
    args.out.mkdir(parents=True, exist_ok=True)
    tensors = write(clip_module, args.out)
    if not args.no_check:
        check(args.out, tensors, TINY["vision_heads"])


if __name__ == "__main__":
    main()
