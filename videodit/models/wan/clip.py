"""Wan 2.1 I2V's image encoder: CLIP ViT-H/14 features of the given frame, as Wan computes them.

Wan (``wan/modules/clip.py``, ``CLIPModel.visual``) squashes each frame in [-1, 1] to the model's
square (bicubic ``F.interpolate``, ``align_corners=False``, no antialiasing, no crop, no clamp),
maps it to [0, 1], normalises it with CLIP's mean and std, and takes the output of the
second-to-last transformer block (``use_31_block=True``): no post-layernorm, no projection. For
ViT-H/14 at 224 px that is 1 class token + 16 x 16 patches = 257 tokens of width 1280, which the
I2V DiT embeds (``ImageEmbedding``, Wan's ``img_emb``). Wan runs it in fp16 (``clip_dtype``).

The network is transformers' ``CLIPVisionModel`` built one block short: the last block's output
is never used, so its weights are never loaded and its ``last_hidden_state`` is Wan's feature
(transformers' ``hidden_states[-2]`` of the whole model, which diffusers' pipeline takes). It
loads from

* diffusers' ``Wan-AI/Wan2.1-I2V-14B-480P-Diffusers`` (its ``image_encoder/``, or that folder
  itself): config.json + model.safetensors (safetensors only, never a pickled ``.bin``); or
* Wan's ``models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth`` (or its folder): the whole
  XLM-RoBERTa + ViT-H CLIP, read with ``torch.load(weights_only=True)`` so no code in it can
  run; only its ``visual.*`` tensors are kept, renamed to transformers' and the architecture read
  off their shapes (the head count, which no shape holds, is Wan's 16 for width 1280).

Nothing is downloaded.
"""

from __future__ import annotations

import math
import pickle
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from videodit.errors import UserError, os_error_message
from videodit.user_files import NotRegularFile, check_regular_file, read_user_json

WAN_CLIP_FILE = "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"   # wan/configs/wan_i2v_14B.py
# Wan's _clip() transforms (OpenAI CLIP's statistics, used for every non-SigLIP model).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Attention heads by width: no tensor shape holds them (clip_xlm_roberta_vit_h_14: vision_heads=16).
WAN_CLIP_HEADS = {1280: 16}
CHECKPOINT_SUFFIXES = (".pth", ".pt", ".ckpt", ".bin")

_WHERE_TO_GET = ("point it to Wan-AI/Wan2.1-I2V-14B-480P-Diffusers (or its image_encoder/ folder) or to Wan's "
                 f"{WAN_CLIP_FILE} (nothing is downloaded)")
_HUB_PREFIX = "vision_model."   # how transformers 4.x names CLIPVisionModel's tensors on disk


class WanImageEncoder(nn.Module):
    """A frozen CLIP vision transformer that ends at the block whose output Wan uses.

    ``vision``: a transformers ``CLIPVisionModel`` holding the released encoder's blocks except its
    last (:func:`load_wan_image_encoder` builds it so). ``encode`` gives fp32 features
    ``[B, num_tokens, dim]`` whatever the weights' dtype.
    """

    def __init__(self, vision: nn.Module):
        super().__init__()
        self.vision = vision
        self.register_buffer("mean", torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(CLIP_STD).view(1, 3, 1, 1), persistent=False)
        self.requires_grad_(False)
        self.eval()

    @property
    def image_size(self) -> int:
        """The side of the square every frame is resized to (224 for ViT-H/14)."""
        return int(self.vision.config.image_size)

    @property
    def num_tokens(self) -> int:
        """Tokens per frame: the class token and one per patch (257 for ViT-H/14 at 224 px)."""
        return (self.image_size // int(self.vision.config.patch_size)) ** 2 + 1

    @property
    def dim(self) -> int:
        """The feature width (1280 for ViT-H)."""
        return int(self.vision.config.hidden_size)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.vision.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.vision.parameters()).device

    def train(self, mode: bool = True) -> "WanImageEncoder":
        # A parent model calling .train() must not flip the frozen encoder out of eval mode.
        return super().train(False)

    @torch.no_grad()
    def encode(self, frames: Tensor) -> Tensor:
        """frames: [B, 3, H, W] in [-1, 1], any H and W -> features float32 [B, num_tokens, dim]."""
        if frames.ndim != 4 or frames.shape[1] != 3:
            raise ValueError(f"expected frames [B,3,H,W] in [-1, 1], got shape {tuple(frames.shape)}")
        # Wan's own preprocessing, which the I2V DiT was trained with: a bicubic squash to the square.
        # diffusers' WanImageToVideoPipeline differs (CLIPImageProcessor: shortest side + centre crop).
        size = (self.image_size, self.image_size)
        pixels = F.interpolate(frames.to(self.device, torch.float32), size=size, mode="bicubic", align_corners=False)
        pixels = (pixels.mul(0.5).add(0.5) - self.mean.float()) / self.std.float()
        return self.vision(pixel_values=pixels.to(self.dtype)).last_hidden_state.float()


# --------------------------------------------------------------------------- Wan's .pth


def _read_wan_pth(file: Path) -> dict[str, Tensor]:
    """The ``visual.*`` tensors of Wan's CLIP checkpoint, without the prefix. Weights-only and
    memory-mapped: a crafted pickle cannot run code, and the text tower is never read."""
    try:
        try:
            state = torch.load(check_regular_file(file), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            state = torch.load(file, map_location="cpu", weights_only=True)   # a pre-zip torch file
    except pickle.UnpicklingError as exc:
        if "global" in str(exc).lower():   # weights_only met a class or function: it would run code
            found = re.search(r"GLOBAL ([\w.]+)", str(exc))
            what = f" ({found.group(1)})" if found else ""
            raise UserError(f"{file} holds objects other than tensors{what}, which videodit refuses to unpickle; "
                            f"use Wan's {WAN_CLIP_FILE} (a plain state dict)") from None
        raise UserError(f"{file} cannot be read as weights (not a torch checkpoint); restore Wan's {WAN_CLIP_FILE}") \
            from None
    except NotRegularFile as exc:
        raise UserError(os_error_message(exc)) from None
    except Exception as exc:   # corrupt zip, truncated file, unreadable...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"{file} cannot be read as weights ({first}); restore Wan's {WAN_CLIP_FILE}") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise UserError(f"{file} is not a plain state dict of tensors (as Wan's {WAN_CLIP_FILE} is); "
                        "save the CLIP model's state dict alone")
    visual = {k[len("visual."):]: v for k, v in state.items() if k.startswith("visual.")}
    if not visual:
        raise UserError(f"{file} has no visual.* tensors (CLIP's image tower); use Wan's {WAN_CLIP_FILE}")
    return visual


# Inside one block: Wan's names -> transformers' (``attn.to_qkv`` is split into q, k and v).
_BLOCK_NAMES = {"norm1": "layer_norm1", "attn.proj": "self_attn.out_proj", "norm2": "layer_norm2",
                "mlp.0": "mlp.fc1", "mlp.2": "mlp.fc2"}
_TOP_NAMES = {"patch_embedding.weight": "embeddings.patch_embedding.weight",
              "pre_norm.weight": "pre_layrnorm.weight", "pre_norm.bias": "pre_layrnorm.bias",
              "post_norm.weight": "post_layernorm.weight", "post_norm.bias": "post_layernorm.bias"}


def wan_clip_config(visual: dict[str, Tensor], where: str, num_heads: int | None = None) -> dict:
    """``CLIPVisionConfig`` arguments of the whole (uncut) ViT, read off Wan's ``visual.*`` tensors."""
    def need(name: str, ndim: int) -> Tensor:
        if name not in visual:
            raise UserError(f"{where}: tensor visual.{name} is missing; is this Wan's CLIP ({WAN_CLIP_FILE})?")
        if visual[name].ndim != ndim:
            raise UserError(f"{where}: tensor visual.{name} has shape {tuple(visual[name].shape)}, not {ndim}-D as "
                            "in Wan's CLIP ViT")
        return visual[name]

    width, channels, patch, patch_w = need("patch_embedding.weight", 4).shape
    if channels != 3 or patch != patch_w:
        raise UserError(f"{where}: visual.patch_embedding takes {channels}-channel {patch}x{patch_w} patches, not "
                        "square RGB ones; is this Wan's CLIP?")
    if "patch_embedding.bias" in visual:   # Wan's pre_norm=False ViTs, which CLIPVisionModel cannot hold
        raise UserError(f"{where}: the patch embedding has a bias (a ViT without pre_norm), unlike Wan's ViT-H; "
                        f"use Wan's {WAN_CLIP_FILE}")
    need("cls_embedding", 3)
    need("pre_norm.weight", 1)
    positions = need("pos_embedding", 3).shape[1]
    grid = math.isqrt(max(positions - 1, 0))
    if grid * grid + 1 != positions:
        raise UserError(f"{where}: visual.pos_embedding has {positions} positions, not 1 + a square grid of patches")
    blocks = sorted({int(m.group(1)) for m in (re.match(r"transformer\.(\d+)\.", k) for k in visual) if m})
    if blocks != list(range(len(blocks))) or len(blocks) < 2:
        raise UserError(f"{where}: visual.transformer holds blocks {blocks[:6]}{'...' if len(blocks) > 6 else ''}; "
                        "Wan's ViT has at least 2, numbered from 0 (its features are the second-to-last block's)")
    mlp = need("transformer.0.mlp.0.weight", 2).shape[0]
    heads = num_heads or WAN_CLIP_HEADS.get(width)
    if heads is None:
        raise UserError(f"{where}: a CLIP ViT {width} wide has no known head count (Wan's ViT-H: 1280 wide, 16 "
                        "heads); pass num_heads")
    if width % heads:
        raise UserError(f"{where}: width {width} does not split into {heads} heads; pass the right num_heads")
    return dict(hidden_size=width, intermediate_size=mlp, num_attention_heads=heads, num_hidden_layers=len(blocks),
                image_size=grid * patch, patch_size=patch, num_channels=3, hidden_act="gelu", layer_norm_eps=1e-5)


def wan_clip_to_transformers(visual: dict[str, Tensor], where: str) -> dict[str, Tensor]:
    """Wan's ``visual.*`` tensors (prefix removed) under ``CLIPVisionModel``'s names (without its
    ``vision_model.`` prefix). ``head`` (the contrastive projection) has no counterpart and is dropped."""
    out: dict[str, Tensor] = {}
    for name, tensor in visual.items():
        block = re.match(r"transformer\.(\d+)\.(.+)\.(weight|bias)$", name)
        if name == "cls_embedding":
            out["embeddings.class_embedding"] = tensor.reshape(-1)
        elif name == "pos_embedding":
            out["embeddings.position_embedding.weight"] = tensor.reshape(tensor.shape[-2], tensor.shape[-1])
        elif name in _TOP_NAMES:
            out[_TOP_NAMES[name]] = tensor
        elif name == "head":
            continue
        elif block and block.group(2) == "attn.to_qkv":
            index, kind = block.group(1), block.group(3)
            for part, chunk in zip("qkv", tensor.chunk(3, dim=0)):   # rows: all q heads, all k, all v
                out[f"encoder.layers.{index}.self_attn.{part}_proj.{kind}"] = chunk
        elif block and block.group(2) in _BLOCK_NAMES:
            out[f"encoder.layers.{block.group(1)}.{_BLOCK_NAMES[block.group(2)]}.{block.group(3)}"] = tensor
        else:
            raise UserError(f"{where}: tensor visual.{name} is not part of Wan's CLIP ViT (pre-norm blocks of "
                            f"attention and a GELU MLP); use Wan's {WAN_CLIP_FILE}")
    return out


def wan_clip_name(name: str) -> str:
    """The Wan tensor a transformers name (unprefixed) comes from, for messages."""
    block = re.match(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
    if block:
        inner = {v: k for k, v in _BLOCK_NAMES.items()}.get(block.group(2), "attn.to_qkv")
        return f"visual.transformer.{block.group(1)}.{inner}.{block.group(3)}"
    top = {v: k for k, v in _TOP_NAMES.items()}
    top.update({"embeddings.class_embedding": "cls_embedding", "embeddings.position_embedding.weight": "pos_embedding"})
    return "visual." + top.get(name, name)


# --------------------------------------------------------------------------- building


def _build(config: dict, tensors: dict[str, Tensor], dtype: torch.dtype, where: str, fix: str,
           source_name=lambda name: _HUB_PREFIX + name) -> WanImageEncoder:
    """``CLIPVisionModel`` cut one block short of ``config`` (the whole model's), strictly from
    ``tensors`` (transformers' names, unprefixed); the last block's tensors are not needed.
    ``source_name``: a tensor's name in the file, for messages."""
    try:
        import transformers
        from transformers import CLIPVisionConfig, CLIPVisionModel
    except ImportError:
        raise UserError("the Wan CLIP image encoder needs the transformers package: pip install 'videodit[hf]'") \
            from None
    cut = CLIPVisionConfig(**{**config, "num_hidden_layers": int(config["num_hidden_layers"]) - 1})
    with torch.device("meta"):
        expected = {k.removeprefix(_HUB_PREFIX): v.shape for k, v in CLIPVisionModel(cut).state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    wrong = sorted(k for k in set(expected) & set(tensors) if tuple(tensors[k].shape) != tuple(expected[k]))
    if missing or wrong:
        name = (missing or wrong)[0]
        problem = "is missing" if missing else \
            f"has shape {tuple(tensors[name].shape)}, the architecture wants {tuple(expected[name])}"
        raise UserError(f"{where}: tensor {source_name(name)} {problem} ({len(missing) + len(wrong)} such tensors); "
                        f"{fix}")
    # transformers >= 4.56 renamed torch_dtype to dtype.
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    dtype_kwarg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    state = {_HUB_PREFIX + k: tensors[k].to(dtype).contiguous() for k in expected}
    try:
        vision = CLIPVisionModel.from_pretrained(None, config=cut, state_dict=state, **{dtype_kwarg: dtype})
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"{where}: cannot build the CLIP vision model ({first}); {fix}") from None
    return WanImageEncoder(vision)


def _load_transformers_folder(folder: Path, where: str, dtype: torch.dtype, num_heads: int | None) -> WanImageEncoder:
    """A ``CLIPVisionModel`` folder (config.json + model.safetensors), reading only the tensors used."""
    try:
        config = read_user_json(folder / "config.json")
    except (OSError, ValueError) as exc:
        raise UserError(f"{where}: cannot read {folder / 'config.json'} ({exc}); fix or replace it") from None
    if not isinstance(config, dict) or config.get("model_type") != "clip_vision_model":
        found = config.get("model_type") if isinstance(config, dict) else None
        raise UserError(f"{folder / 'config.json'} has model_type={found!r}, not 'clip_vision_model' (Wan 2.1 I2V's "
                        f"image_encoder/); {_WHERE_TO_GET}")
    if num_heads is not None and config.get("num_attention_heads") != num_heads:
        raise UserError(f"{folder / 'config.json'} has num_attention_heads={config.get('num_attention_heads')}, not "
                        f"the num_heads={num_heads} given; leave num_heads out for a folder")
    weights = folder / "model.safetensors"
    if not weights.exists():
        pickles = sorted(p.name for p in folder.glob("*.bin"))
        has = f"has {pickles[0]} but " if pickles else "has "
        raise UserError(f"{folder} {has}no model.safetensors; videodit reads only safetensors (a .bin is a pickle, "
                        "which could run code): use the release's model.safetensors")
    fields = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "image_size",
              "patch_size", "num_channels", "hidden_act", "layer_norm_eps")
    arch = {k: config[k] for k in fields if k in config}
    if not isinstance(arch.get("num_hidden_layers"), int) or arch["num_hidden_layers"] < 2:
        raise UserError(f"{folder / 'config.json'} has num_hidden_layers={arch.get('num_hidden_layers')!r}; Wan's "
                        "features are the second-to-last block's, so at least 2 are needed")
    try:
        from safetensors import safe_open
        with safe_open(str(check_regular_file(weights)), framework="pt") as handle:
            names = {name.removeprefix(_HUB_PREFIX): name for name in handle.keys()}
            last = f"encoder.layers.{arch['num_hidden_layers'] - 1}."
            tensors = {k: handle.get_tensor(name) for k, name in names.items() if not k.startswith(last)}
    except NotRegularFile as exc:
        raise UserError(os_error_message(exc)) from None
    except Exception as exc:   # bad header, truncated file...
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"{weights} cannot be read as safetensors ({first}); restore it from the release") from None
    return _build(arch, tensors, dtype, where, fix=f"is {weights} the release's CLIP image encoder?")


def _load_wan_file(file: Path, where: str, dtype: torch.dtype, num_heads: int | None) -> WanImageEncoder:
    visual = _read_wan_pth(file)
    config = wan_clip_config(visual, where, num_heads)
    tensors = wan_clip_to_transformers(visual, where)
    return _build(config, tensors, dtype, where, fix=f"is this Wan's CLIP ({WAN_CLIP_FILE})?",
                  source_name=wan_clip_name)


def load_wan_image_encoder(path: str | Path | None, dtype: torch.dtype = torch.float32,
                           num_heads: int | None = None) -> WanImageEncoder:
    """The frozen :class:`WanImageEncoder` from ``path``, by what is there: a diffusers pipeline
    folder with ``image_encoder/``, a ``CLIPVisionModel`` folder (config.json), Wan's
    ``models_clip_*.pth`` or the folder holding it. ``dtype``: weights and compute (Wan uses fp16);
    features come out fp32. ``num_heads``: for a Wan checkpoint of a width other than ViT-H's."""
    if path is None or not str(path).strip():
        raise UserError(f"the Wan CLIP image encoder needs a path: {_WHERE_TO_GET}")
    root = Path(path).expanduser()
    where = f"'{path}'"
    if root.is_file():
        if root.suffix not in CHECKPOINT_SUFFIXES:
            raise UserError(f"{where} is a {root.suffix or 'suffix-less'} file, not Wan's {WAN_CLIP_FILE}; "
                            f"{_WHERE_TO_GET}")
        return _load_wan_file(root, where, dtype, num_heads)
    if not root.is_dir():
        raise UserError(f"{where} is neither a file nor an existing folder: {_WHERE_TO_GET}")
    if (root / "image_encoder" / "config.json").is_file():   # a diffusers pipeline folder
        return _load_transformers_folder(root / "image_encoder", where, dtype, num_heads)
    # Wan's release folder: its config.json is the DiT's, so the .pth is looked for first.
    originals = sorted(root.glob("models_clip*.pth"), key=lambda p: (p.name != WAN_CLIP_FILE, p.name))
    if originals:
        return _load_wan_file(originals[0], f"'{originals[0]}'", dtype, num_heads)
    if (root / "config.json").is_file():
        return _load_transformers_folder(root, where, dtype, num_heads)
    raise UserError(f"{where} has neither image_encoder/config.json, config.json nor {WAN_CLIP_FILE}; {_WHERE_TO_GET}")


__all__ = ["CLIP_MEAN", "CLIP_STD", "WAN_CLIP_FILE", "WAN_CLIP_HEADS", "WanImageEncoder", "load_wan_image_encoder",
           "wan_clip_config", "wan_clip_name", "wan_clip_to_transformers"]
