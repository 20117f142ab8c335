"""Open-Sora 2.0 MMDiT weights on disk, read and written (safetensors; never unpickled beyond tensors).

Layouts read:

- the released file (``Open_Sora_v2.safetensors``, ``hpcai-tech/Open-Sora-v2``): one safetensors
  holding ``MMDiTModel.state_dict()``, no config: the geometry is read off the shapes (hidden size,
  head size from the q/k norm scales, block counts, MLP width, patch from ``cond_in``);
- an Open-Sora 2.0 training checkpoint (``opensora/utils/ckpt.py`` ``CheckpointIO.save``):
  ``epochN-global_stepM/`` holding ``model/`` (ColossalAI's sharded safetensors and their
  ``*.index.json``), maybe ``ema.safetensors`` or ``ema.pt``, and ``running_states.json``; or that
  ``model/`` folder itself.

RoPE layout: the released weights are in Liger's rotate-half layout (``use_liger_rope=True``:
head channels j and j + D/2 turn together), which is videodit's own, so they load unchanged.
Flux's layout (``use_liger_rope=False``: channels 2j and 2j + 1) is the same model with the q/k
projection rows, their biases and the q/k norm scales permuted inside each head
(:func:`interleaved_to_rotate_half`); ``layout="interleaved"`` reads such weights.

Strict: a missing or unexpected key is named in one line (Open-Sora itself loads with
``strict=False`` and only logs them). Reading is lazy: a tensor is read when it is asked for.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch

from videodit.errors import UserError
from videodit.models.mmdit.model import MMDiT, MMDiTGeometry
from videodit.models.weight_files import (LazyTensors, build_bounded, merged_sources, open_safetensors, read_weights,
                                          sharded_sources)

RELEASED_FILE = "Open_Sora_v2.safetensors"
RELEASED_AXES = (16, 56, 56)       # axes_dim of a 128-channel head, as released
LAYOUTS = ("rotate_half", "interleaved")
PROBE_KEYS = ("double_blocks.0.img_attn.q_proj.weight", "img_in.weight", "txt_in.weight")
# Names only an MMDiT (Open-Sora 2.0's, or Flux's) has: a file with any of them is one, whole or not.
_FAMILY_NAMES = re.compile(r"(double_blocks|single_blocks)\.[0-9]+\.|(img_in|txt_in|vector_in\.in_layer)\.weight$")
_ROPE_PARAM = re.compile(r"(double_blocks\.\d+\.(img|txt)_attn\.|single_blocks\.\d+\.)"
                         r"(q_proj\.(weight|bias)|k_proj\.(weight|bias)|norm\.(query|key)_norm\.scale)")


# ----------------------------------------------------------------------------- RoPE layouts

def rope_param(name: str) -> bool:
    """Whether a parameter's output channels are head channels that RoPE pairs (q/k rows, biases
    and norm scales)."""
    return _ROPE_PARAM.fullmatch(name) is not None


def _permute_heads(tensor: torch.Tensor, head_dim: int, index: torch.Tensor) -> torch.Tensor:
    """Reorder the first dim of ``tensor`` inside each block of ``head_dim`` rows."""
    rows = tensor.shape[0]
    return tensor.reshape(rows // head_dim, head_dim, *tensor.shape[1:])[:, index].reshape(tensor.shape)


def interleaved_to_rotate_half(name: str, tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Flux's pair (2j, 2j+1) -> rotate-half's (j, j + D/2): new channel j is old 2j, new
    j + D/2 is old 2j + 1."""
    if not rope_param(name):
        return tensor
    index = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return _permute_heads(tensor, head_dim, index)


def rotate_half_to_interleaved(name: str, tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse: new channel 2j is old j, new 2j + 1 is old j + D/2."""
    if not rope_param(name):
        return tensor
    index = torch.stack([torch.arange(head_dim // 2), torch.arange(head_dim // 2, head_dim)], dim=1).flatten()
    return _permute_heads(tensor, head_dim, index)


class PermutedTensors(Mapping):
    """A lazy mapping with the RoPE permutation applied to each q/k tensor as it is read."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], head_dim: int):
        self.tensors, self.head_dim = tensors, head_dim

    def __getitem__(self, name: str) -> torch.Tensor:
        return interleaved_to_rotate_half(name, self.tensors[name], self.head_dim)

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors.shape(name)


# ----------------------------------------------------------------------------- geometry

def geometry_from_shapes(shapes: Mapping[str, tuple[int, ...]], where: Path,
                         axes_dim: tuple[int, int, int] | None = None) -> MMDiTGeometry:
    """The geometry of Open-Sora 2.0 weights from their shapes, each checked before use (its rank,
    sizes of at least 1). What shapes cannot say: the RoPE split of a head (``axes_dim``, taken when
    it fits the head: 3 even sizes summing to it; else the released (16, 56, 56) for 128 channels or
    the same proportions 1/8, 7/16, 7/16), theta (1e4)."""
    def need(key, rank):
        if key not in shapes:
            raise UserError(f"{where} lacks {key}, which every Open-Sora 2.0 MMDiT has; restore the file from "
                            "the original download")
        shape = tuple(shapes[key])
        if len(shape) != rank or not all(isinstance(d, int) and d >= 1 for d in shape):
            raise UserError(f"{where}: {key} has shape {list(shape)}, not the {rank}-D shape of sizes of at least 1 "
                            "an Open-Sora 2.0 MMDiT has; restore the file from the original download")
        return shape
    if "double_blocks.0.img_attn.qkv.weight" in shapes or "single_blocks.0.linear1.weight" in shapes:
        raise UserError(f"{where} has fused qkv weights (Flux's own names, fused_qkv=True); videodit reads Open-Sora "
                        "2.0's unfused q_proj/k_proj/v_proj (v_mlp) layout")
    hidden, in_channels = need("img_in.weight", 2)
    depth = _count(shapes, "double_blocks", where)
    single = _count(shapes, "single_blocks", where)
    norm = "double_blocks.0.img_attn.norm.query_norm.scale" if depth else "single_blocks.0.norm.query_norm.scale"
    head_dim = need(norm, 1)[0]
    if hidden % head_dim:
        raise UserError(f"{where}: heads of {head_dim} channels ({norm}) do not divide the width {hidden} "
                        "(img_in.weight); restore the file from the original download")
    cond = need("cond_in.weight", 2) if "cond_in.weight" in shapes else None
    patch_area = cond[1] - in_channels if cond is not None else 4   # one more channel (the mask) per patch value
    patch = round(patch_area ** 0.5) if patch_area > 0 else 0
    if patch < 1 or patch * patch != patch_area or in_channels % patch_area:
        raise UserError(f"{where}: img_in takes {in_channels} values and cond_in {cond[1] if cond else '-'}, which "
                        "fit no square patch; the file is not an Open-Sora 2.0 MMDiT")
    axes = tuple(axes_dim) if axes_dim is not None else None
    if axes is None or not rope_split_fits(axes, head_dim):
        axes = RELEASED_AXES if head_dim == 128 else released_axes(head_dim)
        if axes is None:
            raise UserError(no_split_message(head_dim, where, axes_dim))
    mlp = (need("double_blocks.0.img_mlp.0.weight", 2)[0] if depth
           else need("single_blocks.0.v_mlp.weight", 2)[0] - hidden)
    if mlp < 1:
        raise UserError(f"{where}: single_blocks.0.v_mlp.weight is narrower than the width {hidden}; restore the file "
                        "from the original download")
    return MMDiTGeometry(hidden_size=hidden, num_heads=hidden // head_dim, depth=depth, depth_single_blocks=single,
                         latent_channels=in_channels // patch_area, mlp_ratio=mlp / hidden,
                         patch_size=(1, patch, patch), vec_in_dim=need("vector_in.in_layer.weight", 2)[1],
                         context_in_dim=need("txt_in.weight", 2)[1], axes_dim=axes,
                         qkv_bias=(depth == 0 or "double_blocks.0.img_attn.q_proj.bias" in shapes),
                         cond_embed=cond is not None)


def rope_split_fits(axes_dim, head_dim: int) -> bool:
    """3 even sizes summing to the head size."""
    return (len(axes_dim) == 3 and all(isinstance(a, int) and a >= 2 and a % 2 == 0 for a in axes_dim)
            and sum(axes_dim) == head_dim)


def released_axes(head_dim: int) -> tuple[int, int, int] | None:
    """The released split's proportions (16, 56, 56 of 128) for another head size; None when they
    give no split (head sizes not divisible by 32)."""
    side = 7 * head_dim // 16
    frames = head_dim - 2 * side
    if head_dim % 32 or frames <= 0:
        return None
    return frames, side, side


def no_split_message(head_dim: int, where, wished=None) -> str:
    """Why heads of ``head_dim`` channels have no known RoPE split, and the override that gives one."""
    text = (f"{where}: heads of {head_dim} channels have no RoPE split in the released proportions (1/8 frames, "
            "7/16 rows, 7/16 columns: head sizes divisible by 32)")
    if wished is not None and sum(wished) != head_dim:
        return (f"{text}, and model.axes_dim={list(wished)} splits heads of {sum(wished)}: set model.hidden_size / "
                f"model.num_heads to heads of {head_dim} channels and model.axes_dim to 3 even sizes summing to "
                f"{head_dim}")
    return f"{text}; give one with model.axes_dim=[frames,rows,columns]: 3 even sizes summing to {head_dim}"


def default_axes(head_dim: int, where: Path | str = "the model") -> tuple[int, int, int]:
    """The released split's proportions (16, 56, 56 of 128) for another head size, or one line."""
    axes = released_axes(head_dim)
    if axes is None:
        raise UserError(no_split_message(head_dim, where))
    return axes


_INDEX = {prefix: re.compile(rf"{prefix}\.([0-9]+)\.") for prefix in ("double_blocks", "single_blocks")}


def _count(shapes, prefix: str, where) -> int:
    """How many blocks of ``prefix`` the names number 0, 1, ...; the work is bounded by the names
    (an index of 10^12 is a missing block, never a range to build)."""
    found = {int(m[1]) for k in shapes if (m := _INDEX[prefix].match(k)) and len(m[1]) <= 9}
    for index in range(len(found)):
        if index not in found:
            raise UserError(f"{where}: the weights number {prefix} up to {max(found)} but lack {prefix}.{index}; "
                            "restore the file from the original download")
    return len(found)


# ----------------------------------------------------------------------------- layouts on disk

def is_opensora2_file(path: Path) -> bool:
    """A safetensors file whose names are an Open-Sora 2.0 MMDiT's."""
    if not (path.is_file() and path.suffix == ".safetensors"):
        return False
    try:
        keys = open_safetensors(path).keys()
    except UserError:
        return False
    return is_mmdit_names(keys)


def is_mmdit_names(keys) -> bool:
    """Whether tensor names are an MMDiT's (any of its own names: a file lacking some is still one,
    and its reader names what is missing instead of another family's reader)."""
    return any(_FAMILY_NAMES.search(k) for k in keys)


# Files of videodit's own folders (model folders, checkpoints), which are never Open-Sora's.
VIDEODIT_MARKERS = ("config.json", "manifest.json", "config.yaml", "export.json")


def _checkpoint_model_folder(path: Path) -> Path | None:
    """The folder of a training checkpoint's model weights, if ``path`` is one (its model/
    folder beside running_states.json, or that model/ folder, holding ColossalAI's index)."""
    if any((path / name).exists() for name in VIDEODIT_MARKERS):
        return None
    if (path / "model").is_dir():
        folder = path / "model"
    elif any(path.glob("*.safetensors.index.json")):
        folder = path
    else:
        return None
    return folder if _weight_sources_or_none(folder) else None


def is_opensora2_layout(path: str | Path) -> bool:
    path = Path(path)
    if path.is_file():
        return is_opensora2_file(path)
    if not path.is_dir():
        return False
    folder = _checkpoint_model_folder(path)
    if folder is None:
        return False
    return is_mmdit_names(_weight_sources_or_none(folder) or {})


def _weight_sources_or_none(folder: Path) -> dict[str, tuple[Path, str]] | None:
    """name -> (file, name in the file) of a folder's safetensors: the shards an ``*.index.json``
    names (ColossalAI's), or every ``*.safetensors`` beside none. None if it holds none."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise UserError(f"{folder} holds {len(indexes)} indexes ({', '.join(i.name for i in indexes[:3])}); which "
                        "shards make the model is ambiguous: keep the index of one checkpoint")
    if indexes:
        sources = sharded_sources(indexes[0])
    else:
        files = []
        for file in sorted(folder.glob("*.safetensors")):
            if file.name.startswith("ema"):
                continue
            try:
                open_safetensors(file)
            except UserError:
                continue
            files.append(file)
        sources = merged_sources(files)
    if not sources:
        return None
    if all(k.startswith("module.") for k in sources):   # a DDP-wrapped model's names
        sources = {k[len("module."):]: v for k, v in sources.items()}
    return sources


def read_opensora2(path: str | Path, ema: bool = False, layout: str = "rotate_half",
                   axes_dim: tuple[int, int, int] | None = None) -> tuple[MMDiTGeometry, Mapping[str, torch.Tensor]]:
    """(geometry, lazy tensors in videodit's names and rotate-half layout) of any layout above,
    checked strictly against the model the geometry builds."""
    path = Path(path)
    if layout not in LAYOUTS:
        raise UserError(f"RoPE layout {layout!r} is not one of {', '.join(LAYOUTS)}")
    if path.is_file():
        if ema:
            raise UserError(f"{path} is one weights file; --ema reads a training checkpoint's ema.safetensors")
        tensors = LazyTensors({k: (path, k) for k in open_safetensors(path).keys()})
    elif ema:
        tensors = _read_ema(path)
    else:
        folder = _checkpoint_model_folder(path)
        if folder is None:
            raise UserError(f"{path} holds no Open-Sora 2.0 weights: pass {RELEASED_FILE} or a training checkpoint "
                            "(epochN-global_stepM/ with model/)")
        tensors = LazyTensors(_weight_sources_or_none(folder))
    shapes = {k: tensors.shape(k) for k in tensors}
    geometry = geometry_from_shapes(shapes, path, axes_dim)
    check_names(geometry, shapes, path)
    if layout == "interleaved":
        tensors = PermutedTensors(tensors, geometry.head_dim)
    return geometry, tensors


def _read_ema(path: Path) -> Mapping[str, torch.Tensor]:
    """A training checkpoint's EMA weights: ``ema.safetensors`` (Open-Sora's async save, read
    lazily) or ``ema.pt`` (its synchronous ``torch.save``, tensors only)."""
    file = path / "ema.safetensors"
    if file.is_file():
        return LazyTensors({k: (file, k) for k in open_safetensors(file).keys()})
    if (path / "ema.pt").is_file():
        return _ShapedDict(read_weights(path / "ema.pt"))
    raise UserError(f"{path} has no ema.safetensors nor ema.pt (Open-Sora 2.0 trains without EMA unless asked); "
                    "import its model/ weights (leave out --ema)")


class _ShapedDict(dict):
    """A dict of tensors that answers ``shape(name)`` as :class:`LazyTensors` does."""

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self[name].shape)


def expected_shapes(geometry: MMDiTGeometry) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = MMDiT(geometry)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_names(geometry: MMDiTGeometry, shapes: Mapping[str, tuple[int, ...]], where: Path) -> None:
    """Strict: every key of the model, no other, each of its shape; one line naming the first few.
    The model is built (on the meta device) only while it needs not far more tensors than ``shapes`` holds."""
    model = build_bounded(lambda: MMDiT(geometry), len(shapes), f"{where}: its names describe an MMDiT of far more "
                          f"tensors than the {len(shapes)} it holds; restore the file from the original download")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({', '.join(unexpected[:3])}"
                         f"{', ...' if len(unexpected) > 3 else ''})")
        raise UserError(f"{where} does not match an Open-Sora 2.0 MMDiT: keys {' and '.join(parts)}; pass the "
                        f"complete weights of Open-Sora 2.0 ({RELEASED_FILE} or a training checkpoint's model/)")
    wrong = [k for k in expected if tuple(shapes[k]) != expected[k]]
    if wrong:
        k = wrong[0]
        raise UserError(f"{where}: {k} has shape {list(shapes[k])}, the model read off the other weights needs "
                        f"{list(expected[k])}; restore the file from the original download")


def load_opensora2(path: str | Path, ema: bool = False, layout: str = "rotate_half",
                   dtype: torch.dtype = torch.float32) -> MMDiT:
    """The model of Open-Sora 2.0 weights: built on the meta device and filled tensor by tensor."""
    geometry, tensors = read_opensora2(path, ema=ema, layout=layout)
    with torch.device("meta"):
        model = MMDiT(geometry)
    model.load_state_dict({k: tensors[k].to(dtype) for k in tensors}, assign=True, strict=True)
    return model


def to_released(tensors: Mapping[str, torch.Tensor], geometry: MMDiTGeometry,
                layout: str = "rotate_half") -> dict[str, torch.Tensor]:
    """The state dict Open-Sora's ``MMDiTModel`` (``fused_qkv=False``) loads strictly: the same
    names; in Flux's layout (``use_liger_rope=False``) with ``layout="interleaved"``."""
    if layout == "rotate_half":
        return dict(tensors)
    return {k: rotate_half_to_interleaved(k, v, geometry.head_dim) for k, v in tensors.items()}


def opensora_model_config(g: MMDiTGeometry) -> dict:
    """The ``model=dict(...)`` of Open-Sora 2.0's config that builds this model (its ``Flux()``)."""
    return dict(type="flux", from_pretrained=RELEASED_FILE, guidance_embed=False, fused_qkv=False,
                use_liger_rope=True, in_channels=g.in_channels, vec_in_dim=g.vec_in_dim,
                context_in_dim=g.context_in_dim, hidden_size=g.hidden_size, mlp_ratio=g.mlp_ratio,
                num_heads=g.num_heads, depth=g.depth, depth_single_blocks=g.depth_single_blocks,
                axes_dim=list(g.axes_dim), theta=g.theta, qkv_bias=g.qkv_bias, cond_embed=g.cond_embed,
                patch_size=g.patch)
