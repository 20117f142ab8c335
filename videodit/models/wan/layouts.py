"""Wan DiT weights on disk (2.1 and 2.2, every task): Wan's original folder and diffusers' ``WanTransformer3DModel``.

Layouts read (safetensors only; loading never runs code from the files):

- Wan's original folder (``Wan-AI/Wan2.1-T2V-1.3B``): ``config.json`` as ``WanModel.save_pretrained``
  writes it (``dim``, ``ffn_dim``, ``num_heads``, ``num_layers``, ``in_dim``, ...) and
  ``diffusion_pytorch_model.safetensors``, or shards named by
  ``diffusion_pytorch_model.safetensors.index.json``. Wan leaves ``text_dim``, ``patch_size``,
  ``qk_norm`` and ``cross_attn_norm`` out of its config; they are read off the weights' shapes.
- a diffusers folder (``config.json`` with ``_class_name: WanTransformer3DModel``), or a diffusers
  pipeline folder holding it under ``transformer/``.

Names inside videodit are Wan's original ones (``WanDiT.state_dict()``); :func:`to_diffusers` and
:func:`from_diffusers` rename. Note the swap: Wan's ``norm3`` (the affine norm before
cross-attention) is diffusers' ``norm2``; Wan's ``norm2`` and diffusers' ``norm3`` hold no weights.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from videodit.errors import UserError
from videodit.models.wan.experts import expert_folder, is_experts_folder
from videodit.models.wan.model import I2V_MASK_CHANNELS, MODEL_TYPES, WanDiT, WanGeometry
from videodit.models.weight_files import (MAX_SIZE, MAX_TOKENS, ConfigValues, LazyTensors, build_bounded,
                                          merged_sources, read_index, read_json, sharded_sources)
from videodit.user_files import read_user_json

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
LAYOUTS = ("wan", "diffusers")
WAN22_LATENT_CHANNELS = 48   # Wan 2.2's 16x VAE (TI2V-5B)
DIFFUSERS_TEXT_LEN = 512   # diffusers' WanPipeline pads captions to 512 tokens; its config has no text_len

# Wan name (module or parameter path) -> diffusers name; matched on whole dot-separated segments.
_TOP = {
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    "head.modulation": "scale_shift_table",
    # Wan 2.1 I2V's CLIP projection (Wan's MLPProj: LayerNorm, Linear, GELU, Linear, LayerNorm)
    "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
}
_BLOCK = {   # inside blocks.N
    **{f"{wan}.{p}": f"{dif}.to_{p}" for wan, dif in (("self_attn", "attn1"), ("cross_attn", "attn2"))
       for p in "qkv"},
    **{f"{wan}.o": f"{dif}.to_out.0" for wan, dif in (("self_attn", "attn1"), ("cross_attn", "attn2"))},
    **{f"{wan}.{n}": f"{dif}.{n}" for wan, dif in (("self_attn", "attn1"), ("cross_attn", "attn2"))
       for n in ("norm_q", "norm_k")},
    "cross_attn.k_img": "attn2.add_k_proj",
    "cross_attn.v_img": "attn2.add_v_proj",
    "cross_attn.norm_k_img": "attn2.norm_added_k",
    "norm3": "norm2",
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
    "modulation": "scale_shift_table",
}


def _rename(name: str, top: dict[str, str], block: dict[str, str]) -> str:
    match = re.fullmatch(r"(blocks\.\d+\.)(.+)", name)
    prefix, rest, table = (match[1], match[2], block) if match else ("", name, top)
    for old, new in table.items():
        if rest == old or rest.startswith(old + "."):
            return prefix + new + rest[len(old):]
    return name   # unknown names pass through, for the strict key check to name them


def diffusers_name(name: str) -> str:
    return _rename(name, _TOP, _BLOCK)


def wan_name(name: str) -> str:
    return _rename(name, {v: k for k, v in _TOP.items()}, {v: k for k, v in _BLOCK.items()})


def to_diffusers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {diffusers_name(k): v for k, v in state.items()}


def from_diffusers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {wan_name(k): v for k, v in state.items()}


# ---------------------------------------------------------------------------- configs

def _layout_of(config) -> str | None:
    if not isinstance(config, dict):
        return None
    if config.get("_class_name") == "WanTransformer3DModel":
        return "diffusers"
    if str(config.get("model_type", "")).startswith("videodit"):
        return None   # videodit's own model folder (its geometry has the same field names)
    if config.get("_class_name") == "WanModel" or (
            "_class_name" not in config and {"dim", "num_heads", "num_layers"} <= config.keys()):
        return "wan"
    return None


_FIX = "restore the config.json of the Wan download"


def geometry_from_wan_config(config: dict, shapes: Mapping[str, tuple], file: Path) -> WanGeometry:
    """Wan's WanModel config; what it leaves out (text_dim, patch_size, ...) from the weights.
    Wan 2.1's and 2.2's i2v configs read alike: Wan 2.1's has CLIP's ``img_emb`` in its weights.
    Every value is checked as the schema checks its own (type, finite, range) before use."""
    model_type = config.get("model_type", "t2v")
    if model_type not in MODEL_TYPES:
        raise UserError(f"{file} is a Wan {str(model_type)[:40]!r} model; videodit trains Wan's "
                        f"{', '.join(MODEL_TYPES)} DiTs")
    c = ConfigValues(config, file, _FIX)
    text = shapes.get("text_embedding.0.weight")
    patch = shapes.get("patch_embedding.weight")
    image = shapes.get("img_emb.proj.0.weight")
    dim = c.int("dim")
    return WanGeometry(task=model_type, image_dim=image[0] if image and len(image) == 1 else None,
        dim=dim, ffn_dim=c.int("ffn_dim"), num_heads=c.int("num_heads", high=dim), num_layers=c.int("num_layers"),
        in_channels=c.int("in_dim", 16), out_channels=c.int("out_dim", 16), freq_dim=c.int("freq_dim", 256, low=2),
        text_len=c.int("text_len", 512, high=MAX_TOKENS), eps=c.float("eps", 1e-6, below=1.0),
        text_dim=c.int("text_dim", text[1] if text and len(text) == 2 else 4096),
        patch_size=c.ints("patch_size", tuple(patch[2:]) if patch and len(patch) == 5 else (1, 2, 2)),
        qk_norm=c.bool("qk_norm", "blocks.0.self_attn.norm_q.weight" in shapes),
        cross_attn_norm=c.bool("cross_attn_norm", "blocks.0.norm3.weight" in shapes))


def geometry_from_diffusers_config(config: dict, file: Path) -> WanGeometry:
    """diffusers' config has no model_type: an input of 2 x out + 4 channels is i2v (the mask and
    the given frames' latents), one of Wan 2.2's 48 latent channels is TI2V-5B's ti2v."""
    if config.get("pos_embed_seq_len") is not None:
        raise UserError(f"{file} sets pos_embed_seq_len: Wan 2.1's first-last-frame (FLF2V) model, which videodit "
                        "does not train")
    c = ConfigValues(config, file, _FIX)
    heads = c.int("num_attention_heads")
    head_dim = c.int("attention_head_dim")
    in_channels = c.int("in_channels", 16)
    out_channels = in_channels if config.get("out_channels") is None else c.int("out_channels")
    model_type = ("i2v" if in_channels == 2 * out_channels + I2V_MASK_CHANNELS else
                  "ti2v" if in_channels == out_channels == WAN22_LATENT_CHANNELS else "t2v")
    if heads * head_dim > MAX_SIZE:
        raise UserError(f"{file}: num_attention_heads x attention_head_dim = {heads * head_dim} is out of range (at "
                        f"most {MAX_SIZE}); {_FIX}")
    return WanGeometry(
        task=model_type, image_dim=c.optional_int("image_dim"),
        dim=heads * head_dim, ffn_dim=c.int("ffn_dim"), num_heads=heads,
        num_layers=c.int("num_layers"), in_channels=in_channels, out_channels=out_channels,
        freq_dim=c.int("freq_dim", 256, low=2), text_dim=c.int("text_dim", 4096), text_len=DIFFUSERS_TEXT_LEN,
        patch_size=c.ints("patch_size", (1, 2, 2)),
        qk_norm=True,   # diffusers' WanAttention always has norm_q/norm_k, whatever qk_norm says
        cross_attn_norm=c.bool("cross_attn_norm", True), eps=c.float("eps", 1e-6, below=1.0))


def wan_config(g: WanGeometry) -> dict:
    """config.json as WanModel.save_pretrained writes it. Wan leaves text_dim, patch_size, qk_norm and
    cross_attn_norm out (its WanModel would warn about them and ignore them); the reader takes them
    from the weights."""
    return {"_class_name": "WanModel", "_diffusers_version": "0.30.0", "dim": g.dim, "eps": g.eps,
            "ffn_dim": g.ffn_dim, "freq_dim": g.freq_dim, "in_dim": g.in_channels, "model_type": g.task,
            "num_heads": g.num_heads, "num_layers": g.num_layers, "out_dim": g.out_channels, "text_len": g.text_len}


def check_diffusers_writable(geometry: WanGeometry) -> None:
    """diffusers' folder cannot say what it does not have: a model without q/k norms, or whose
    captions are padded to other than 512 tokens, would load as a different model."""
    if not geometry.qk_norm or geometry.text_len != DIFFUSERS_TEXT_LEN:
        raise UserError("diffusers' WanTransformer3DModel always has q/k norms and its pipeline pads captions to "
                        f"{DIFFUSERS_TEXT_LEN} tokens; this model (qk_norm={geometry.qk_norm}, "
                        f"text_len={geometry.text_len}) can only be written with layout=wan (--format wan)")


def diffusers_config(g: WanGeometry) -> dict:
    return {"_class_name": "WanTransformer3DModel", "_diffusers_version": "0.33.0",
            "patch_size": list(g.patch_size), "num_attention_heads": g.num_heads, "attention_head_dim": g.head_dim,
            "in_channels": g.in_channels, "out_channels": g.out_channels, "text_dim": g.text_dim,
            "freq_dim": g.freq_dim, "ffn_dim": g.ffn_dim, "num_layers": g.num_layers,
            "cross_attn_norm": g.cross_attn_norm, "qk_norm": "rms_norm_across_heads", "eps": g.eps,
            "image_dim": g.image_dim, "added_kv_proj_dim": g.dim if g.image_dim else None,
            "rope_max_seq_len": 1024, "pos_embed_seq_len": None}


# ---------------------------------------------------------------------------- reading

def _model_folder(path: Path) -> Path:
    """The folder holding the DiT: ``path`` itself, or a diffusers pipeline's ``transformer/``; a
    two-expert model (Wan 2.2 A14B) is refused, never read as its first expert alone."""
    if is_experts_folder(path):
        high, low = (expert_folder(path, name) for name in ("high", "low"))
        raise UserError(f"{path} holds Wan 2.2's two experts ({high.name}/ high-noise, {low.name}/ low-noise); "
                        f"videodit reads one at a time: pass {high} or {low} (recipes wan2.2-t2v-a14b-high-lora "
                        "and -low-lora train each on its timesteps)")
    if not (path / CONFIG_NAME).exists() and (path / "transformer" / CONFIG_NAME).exists():
        return path / "transformer"
    if (path / "model_index.json").is_file() and (path / "transformer").is_dir():
        return path / "transformer"
    return path


def is_wan_folder(path: str | Path) -> bool:
    if is_experts_folder(path):   # Wan's two experts (a videodit two-expert folder is not a released one)
        return is_wan_folder(expert_folder(path, "high"))
    folder = _model_folder(Path(path))
    config = folder / CONFIG_NAME
    if not config.exists():
        return False
    try:   # a FIFO or device in its place is refused in one line, not taken for another layout
        return _layout_of(read_user_json(config)) is not None
    except (ValueError, UnicodeDecodeError):
        return False


def _weight_files(folder: Path) -> list[Path]:
    if (folder / INDEX_NAME).exists():
        return [folder / shard for shard in sorted(set(read_index(folder / INDEX_NAME).values()))]
    if (folder / WEIGHTS_NAME).exists():
        return [folder / WEIGHTS_NAME]
    pickled = sorted(p.name for p in folder.glob("*.pth")) + sorted(p.name for p in folder.glob("*.bin"))
    hint = f" (videodit does not unpickle {', '.join(pickled)}: convert to safetensors)" if pickled else ""
    raise UserError(f"{folder} holds no {WEIGHTS_NAME} nor {INDEX_NAME}{hint}; pass a Wan DiT folder")


def _weight_sources(folder: Path) -> dict[str, tuple[Path, str]]:
    """name in the files -> (file, name): the shards exactly as the index names them, or the one file."""
    if (folder / INDEX_NAME).exists():
        return sharded_sources(folder / INDEX_NAME)
    return merged_sources(_weight_files(folder))


def read_wan_folder(path: str | Path) -> tuple[WanGeometry, LazyTensors]:
    """(geometry, the DiT's tensors under Wan's names, read lazily) of any layout above."""
    path = Path(path)
    folder = _model_folder(path)
    config_file = folder / CONFIG_NAME
    if not config_file.exists():
        raise UserError(f"{path} has no {CONFIG_NAME}; pass a Wan 2.1 or 2.2 folder (Wan's original download, a diffusers "
                        "WanTransformer3DModel folder, or a diffusers Wan pipeline)")
    config = read_json(config_file)
    layout = _layout_of(config)
    if layout is None:
        raise UserError(f"{config_file} is neither Wan's WanModel config nor diffusers' WanTransformer3DModel "
                        "config; pass a Wan 2.1 or 2.2 folder")
    rename = wan_name if layout == "diffusers" else (lambda name: name)
    sources = {rename(key): source for key, source in _weight_sources(folder).items()}
    tensors = LazyTensors(sources)
    if layout == "wan":
        shapes = {name: tensors.shape(name) for name in
                  ("text_embedding.0.weight", "patch_embedding.weight", "img_emb.proj.0.weight") if name in tensors}
        shapes.update({name: () for name in tensors if name.startswith("blocks.0.")})
        build = lambda: geometry_from_wan_config(config, shapes, config_file)   # noqa: E731
    else:
        build = lambda: geometry_from_diffusers_config(config, config_file)   # noqa: E731
    try:
        geometry = build()
    except (TypeError, ValueError, ZeroDivisionError, OverflowError) as exc:   # what the checks above let through
        raise UserError(f"{config_file} has values that are not sizes ({_short(exc)}); restore the config.json "
                        "of the Wan download") from None
    check_sizes(geometry, tensors, config_file)
    check_tensors(tensors, expected_state(geometry, len(tensors), config_file), str(path))
    return geometry, tensors


def expected_state(geometry: WanGeometry, held: int, config_file: Path | str) -> dict[str, torch.Tensor]:
    """The state dict (meta tensors) of the WanDiT ``geometry`` describes, built only while it needs no
    more tensors than the ``held`` ones of its weights."""
    model = build_bounded(lambda: WanDiT(geometry), held, f"{config_file} describes a Wan DiT of far more tensors than "
                          f"the {held} its weights hold; config.json does not match the weights: fix or restore it")
    return model.state_dict()


def read_experts_folder(path: str | Path) -> tuple[WanGeometry, LazyTensors]:
    """(geometry, the tensors of both experts) of a two-expert model (Wan 2.2 A14B), named as in a
    ``WanExperts``: ``high_noise_model.*`` and ``low_noise_model.*``."""
    geometries, sources = [], {}
    for expert, prefix in (("high", "high_noise_model."), ("low", "low_noise_model.")):
        geometry, tensors = read_wan_folder(expert_folder(path, expert))
        geometries.append(geometry)
        sources.update({prefix + name: source for name, source in tensors.sources.items()})
    if geometries[0] != geometries[1]:
        raise UserError(f"the two experts in {path} have different config.json sizes; restore the download")
    return geometries[0], LazyTensors(sources)


def weight_files(path: str | Path) -> list[Path]:
    """The DiT weight files of a Wan folder (both experts' of a two-expert model): what a LoRA
    base's fingerprint covers, not a pipeline's text encoder or VAE."""
    if is_experts_folder(path):
        return [file for expert in ("high", "low") for file in weight_files(expert_folder(path, expert))]
    return _weight_files(_model_folder(Path(path)))


def _short(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "..."


_BLOCK_INDEX = re.compile(r"blocks\.([0-9]{1,9})\.")


def check_sizes(geometry: WanGeometry, tensors: "LazyTensors", config_file: Path) -> None:
    """The config's sizes against the weights' headers, before anything is built: a config.json
    asking for a million layers (or another width) than the weights hold is refused in one line."""
    blocks = {m[1] for name in tensors if (m := _BLOCK_INDEX.match(name))}   # names only: never a range of them
    found = {"num_layers": len(blocks)}
    shape = lambda name, rank: tensors.shape(name) if name in tensors and len(tensors.shape(name)) == rank \
        else None   # noqa: E731
    if (patch := shape("patch_embedding.weight", 5)) is not None:
        found.update(dim=patch[0], in_channels=patch[1], patch_size=tuple(patch[2:]))
    if (ffn := shape("blocks.0.ffn.0.weight", 2)) is not None:
        found["ffn_dim"] = ffn[0]
    if (text := shape("text_embedding.0.weight", 2)) is not None:
        found["text_dim"] = text[1]
    if (time := shape("time_embedding.0.weight", 2)) is not None:
        found["freq_dim"] = time[1]
    for key, value in found.items():
        if getattr(geometry, key) != value:
            raise UserError(f"{config_file} gives {key}={_short(repr(getattr(geometry, key)), 40)} but the weights "
                            f"hold {value}; config.json does not match the weights: fix or restore it")


def check_tensors(tensors, expected: Mapping[str, torch.Tensor], where: str) -> None:
    """Strict: the same names as ``expected`` and the same shapes, or one line naming the first tensor."""
    missing = [name for name in expected if name not in tensors]
    unexpected = [name for name in tensors if name not in expected]
    more = lambda names: f" (and {len(names) - 1} more)" if len(names) > 1 else ""   # noqa: E731
    if missing:
        raise UserError(f"{where} lacks the tensor {missing[0]}{more(missing)}; the weights are incomplete or "
                        "not the Wan DiT its config.json describes: download the folder again")
    if unexpected:
        raise UserError(f"{where} has the unexpected tensor {unexpected[0]}{more(unexpected)}; it is not the Wan "
                        "DiT its config.json describes (vace/animate models add tensors): pass a t2v, i2v or ti2v "
                        "folder")
    for name, ref in expected.items():
        shape = tensors.shape(name) if isinstance(tensors, LazyTensors) else tuple(tensors[name].shape)
        if tuple(shape) != tuple(ref.shape):
            raise UserError(f"{where}: tensor {name} has shape {list(shape)} but the config gives "
                            f"{list(ref.shape)}; config.json does not match the weights: fix or restore it")


def load_wan(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> WanDiT:
    """The WanDiT of a Wan folder (any layout above), built on the meta device and filled tensor by
    tensor, so the weights are held once. ``dtype``: cast floating tensors (None: as stored)."""
    geometry, tensors = read_wan_folder(path)
    with torch.device("meta"):
        model = WanDiT(geometry)
    expected = model.state_dict()
    check_tensors(tensors, expected, str(path))
    loaded = {}
    for name in expected:
        tensor = tensors[name]
        loaded[name] = tensor.to(device=device, dtype=dtype if dtype and tensor.is_floating_point() else None)
        del tensor
    tensors.close()
    model.load_state_dict(loaded, strict=True, assign=True)
    return model


# ---------------------------------------------------------------------------- writing

def write_wan_folder(state: Mapping[str, torch.Tensor], geometry: WanGeometry, out: str | Path,
                     layout: str = "wan", max_shard_bytes: int = 10 * 10**9,
                     dtype: torch.dtype | None = None) -> Path:
    """Write ``state`` (Wan names, e.g. ``WanDiT.state_dict()``) as ``config.json`` + safetensors:
    one ``diffusion_pytorch_model.safetensors``, or shards of at most ``max_shard_bytes`` and their
    ``.index.json`` (a tensor larger than that gets a shard of its own)."""
    if layout not in LAYOUTS:
        raise UserError(f"layout={layout!r} is not a Wan layout; choose one of: {', '.join(LAYOUTS)}")
    if layout == "diffusers":
        check_diffusers_writable(geometry)
    with torch.device("meta"):
        expected = WanDiT(geometry).state_dict()
    check_tensors(state, expected, "the state to write")
    names = list(expected)
    rename = diffusers_name if layout == "diffusers" else (lambda name: name)
    shards, size = [[]], 0
    for name in names:
        nbytes = state[name].numel() * (state[name].element_size() if dtype is None else dtype.itemsize)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (*out.glob("diffusion_pytorch_model*.safetensors"), out / INDEX_NAME):
        stale.unlink(missing_ok=True)
    config = wan_config(geometry) if layout == "wan" else diffusers_config(geometry)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        file = WEIGHTS_NAME if len(shards) == 1 else f"diffusion_pytorch_model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in shard:
            tensor = state[name].detach()
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            tensors[rename(name)] = tensor.to("cpu").contiguous()
            weight_map[rename(name)] = file
            total += tensors[rename(name)].numel() * tensors[rename(name)].element_size()
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return out
