"""LTX-2 weights on disk, read and written (safetensors only; nothing is unpickled).

Layouts:

- **the release** (``ltx-2-19b-dev.safetensors``, ``ltx-2.3-22b-dev.safetensors``): one file per
  model, its configuration as JSON under ``config`` in the safetensors metadata. Prefixes:
  ``model.diffusion_model.*`` the DiT (ComfyUI's naming) and, under the same prefix, the text
  connectors (``video_embeddings_connector.*``, ``audio_embeddings_connector.*``);
  ``text_embedding_projection.*`` Gemma's feature projection; ``vae.*``, ``audio_vae.*``,
  ``vocoder.*`` the decoders. The DiT is read; the connectors and the projection are the frozen
  text side (``read_text_side`` gives them to the text encoder; they never enter the DiT module);
  every other prefix is left unread, with a note.
- **diffusers'** ``LTX2VideoTransformer3DModel`` folder (or a pipeline's ``transformer/``):
  config.json and ``diffusion_pytorch_model*.safetensors``; diffusers only renames
  (``patchify_proj`` -> ``proj_in``, ``adaln_single`` -> ``time_embed``, ``q_norm`` -> ``norm_q``,
  ``av_ca_*`` -> ``av_cross_attn_*``, ...).

Inside videodit the names are the release's without the prefix (``LTX2Model.state_dict()``).
Reading is lazy and strict: the configuration is checked first (``release_config.py``), then every
name and shape of the header against the model it describes, before a tensor is read; a mismatch
is one line naming the tensor.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from videodit.errors import UserError
from videodit.models.ltx2.geometry import LTX2Geometry
from videodit.models.ltx2.model import LTX2Model
from videodit.models.ltx2.release_config import (DIFFUSERS_CLASS, diffusers_config, geometry_from_diffusers,
                                                 geometry_from_release, release_config)
from videodit.models.weight_files import LazyTensors, open_safetensors, read_json
from videodit.user_files import read_user_json

log = logging.getLogger(__name__)

PREFIX = "model.diffusion_model."
CONNECTORS = ("video_embeddings_connector.", "audio_embeddings_connector.", "embeddings_connector.")
TEXT_PROJECTION = "text_embedding_projection."
PROBE = PREFIX + "patchify_proj.weight"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"

# Release name <-> diffusers name, on whole dot-separated segments: the first segment at the top,
# the third inside ``transformer_blocks.N`` (the block's own tables), the fourth (an attention's q/k norms).
_TOP = {"patchify_proj": "proj_in", "audio_patchify_proj": "audio_proj_in", "adaln_single": "time_embed",
        "audio_adaln_single": "audio_time_embed", "prompt_adaln_single": "prompt_adaln",
        "audio_prompt_adaln_single": "audio_prompt_adaln",
        "av_ca_video_scale_shift_adaln_single": "av_cross_attn_video_scale_shift",
        "av_ca_audio_scale_shift_adaln_single": "av_cross_attn_audio_scale_shift",
        "av_ca_a2v_gate_adaln_single": "av_cross_attn_video_a2v_gate",
        "av_ca_v2a_gate_adaln_single": "av_cross_attn_audio_v2a_gate"}
_BLOCK = {"scale_shift_table_a2v_ca_video": "video_a2v_cross_attn_scale_shift_table",
          "scale_shift_table_a2v_ca_audio": "audio_a2v_cross_attn_scale_shift_table"}
_NORMS = {"q_norm": "norm_q", "k_norm": "norm_k"}


def _rename(name: str, top: dict, block: dict, norms: dict) -> str:
    parts = name.split(".")
    if parts[0] == "transformer_blocks" and len(parts) > 2:
        parts[2] = block.get(parts[2], parts[2])
        if len(parts) > 3:
            parts[3] = norms.get(parts[3], parts[3])
    else:
        parts[0] = top.get(parts[0], parts[0])
    return ".".join(parts)


def diffusers_name(name: str) -> str:
    return _rename(name, _TOP, _BLOCK, _NORMS)


def release_name(name: str) -> str:
    """The release's name of a diffusers name (unknown names pass through for the strict check)."""
    return _rename(name, *({v: k for k, v in table.items()} for table in (_TOP, _BLOCK, _NORMS)))


# ----------------------------------------------------------------------------- recognising

def is_release_file(path: str | Path) -> bool:
    path = Path(path)
    if not (path.is_file() and path.suffix == ".safetensors"):
        return False
    try:
        return PROBE in open_safetensors(path).keys()
    except UserError:
        return False


def _diffusers_folder(path: Path) -> Path | None:
    for folder in (path, path / "transformer"):
        config = folder / CONFIG_NAME
        if config.is_file():
            try:
                data = read_user_json(config)
            except (ValueError, UnicodeDecodeError, OSError):
                continue
            if isinstance(data, dict) and data.get("_class_name") == DIFFUSERS_CLASS:
                return folder
    return None


def is_diffusers_folder(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and _diffusers_folder(path) is not None


def is_ltx2_layout(path: str | Path) -> bool:
    return is_release_file(path) or is_diffusers_folder(path)


# ----------------------------------------------------------------------------- reading

def read_ltx2(path: str | Path) -> tuple[LTX2Geometry, LazyTensors]:
    """(geometry, the DiT's tensors under videodit's names, read lazily) of either layout, checked
    strictly; raises a one-line UserError on anything else."""
    path = Path(path)
    if is_release_file(path):
        return read_release(path)
    folder = _diffusers_folder(path) if path.is_dir() else None
    if folder is None:
        raise UserError(f"{path} is neither an LTX-2 release file (a .safetensors holding {PROBE}) nor a diffusers "
                        f"{DIFFUSERS_CLASS} folder; pass ltx-2-19b-dev.safetensors, ltx-2.3-22b-dev.safetensors or "
                        "a diffusers LTX-2 pipeline's transformer/")
    return read_diffusers(folder)


def release_metadata_config(path: Path) -> dict:
    """The JSON ``config`` of a release file's safetensors metadata."""
    metadata = open_safetensors(path).metadata() or {}
    if "config" not in metadata:
        raise UserError(f"{path} has no config in its safetensors metadata; pass the release file as downloaded "
                        "(its configuration travels inside it)")
    try:
        config = json.loads(metadata["config"])
    except (ValueError, RecursionError):
        raise UserError(f"{path}: the metadata config is not valid JSON; restore the file from the original "
                        "download") from None
    return config


def read_release(path: str | Path) -> tuple[LTX2Geometry, LazyTensors]:
    path = Path(path)
    geometry = geometry_from_release(release_metadata_config(path), str(path))
    dit, ignored = {}, set()
    for key in open_safetensors(path).keys():
        if key.startswith(PREFIX) and not key[len(PREFIX):].startswith(CONNECTORS):
            dit[key[len(PREFIX):]] = (path, key)
        elif not key.startswith(PREFIX):
            ignored.add(key.split(".", 1)[0])
    if ignored:
        log.info("%s: read the DiT (%s*); left unread: %s (the text side and the decoders)", path, PREFIX,
                 ", ".join(f"{p}.*" for p in sorted(ignored)))
    tensors = LazyTensors(dit)
    check_tensors(tensors, expected_shapes(geometry), str(path), PREFIX)
    return geometry, tensors


def read_text_side(path: str | Path) -> LazyTensors:
    """A release's frozen text side, for the text encoder: the connectors (names without
    ``model.diffusion_model.``) and Gemma's feature projection (``text_embedding_projection.*``)."""
    path = Path(path)
    sources = {}
    for key in open_safetensors(path).keys():
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        if name.startswith(CONNECTORS) or key.startswith(TEXT_PROJECTION):
            sources[name] = (path, key)
    if not sources:
        raise UserError(f"{path} holds no text connectors (model.diffusion_model.*_embeddings_connector.*); pass the "
                        "full release file")
    return LazyTensors(sources)


def read_diffusers(folder: Path) -> tuple[LTX2Geometry, LazyTensors]:
    config_file = folder / CONFIG_NAME
    geometry = geometry_from_diffusers(read_json(config_file), str(config_file))
    sources = {}
    for file in _weight_files(folder):
        for key in open_safetensors(file).keys():
            if release_name(key) in sources:   # which copy a loader would take is written nowhere
                raise UserError(f"the tensor {key[:80]} is in both {sources[release_name(key)][0]} and {file}; "
                                "keep the shards of one download only")
            sources[release_name(key)] = (file, key)
    tensors = LazyTensors(sources)
    check_tensors(tensors, expected_shapes(geometry), str(folder), "", rename=diffusers_name)
    return geometry, tensors


def _weight_files(folder: Path) -> list[Path]:
    if (folder / INDEX_NAME).is_file():
        weight_map = read_json(folder / INDEX_NAME).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{folder / INDEX_NAME} has no weight_map; restore it from the original download")
        files = sorted({str(name) for name in weight_map.values()})
        for name in files:
            if Path(name).name != name or not (folder / name).is_file():
                raise UserError(f"{folder / INDEX_NAME} names the shard {name[:80]!r}, which is not in {folder}; "
                                "download every shard beside the index")
        return [folder / name for name in files]
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    raise UserError(f"{folder} holds no {WEIGHTS_NAME} nor {INDEX_NAME}; pass a diffusers LTX-2 transformer folder")


def expected_shapes(geometry: LTX2Geometry) -> dict[str, tuple[int, ...]]:
    """name -> shape of the DiT a geometry describes (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = LTX2Model(geometry)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_tensors(tensors: Mapping, expected: Mapping[str, tuple[int, ...]], where: str, prefix: str = "",
                  rename=lambda name: name) -> None:
    """Strict: the same names and shapes as ``expected`` (shapes from the header only), or one line
    naming the first tensor as the file names it."""
    more = lambda names: f" (and {len(names) - 1} more)" if len(names) > 1 else ""   # noqa: E731
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise UserError(f"{where} lacks the tensor {prefix}{rename(missing[0])}{more(missing)}; the weights are "
                        "incomplete or not the LTX-2 DiT their config describes: download them again")
    unexpected = [name for name in tensors if name not in expected]
    if unexpected:
        raise UserError(f"{where} has the unexpected tensor {prefix}{rename(unexpected[0])[:120]}{more(unexpected)}; "
                        "it is not the LTX-2 DiT its config describes (fp8 files and LTX-2.5 are not read): pass "
                        "the bf16 LTX-2.0 or 2.3 release")
    for name, shape in expected.items():
        found = tensors.shape(name) if hasattr(tensors, "shape") else tuple(tensors[name].shape)
        if tuple(found) != tuple(shape):
            raise UserError(f"{where}: tensor {prefix}{rename(name)} has shape {list(found)[:8]} but the config "
                            f"gives {list(shape)}; the config does not match the weights: restore the file")


def load_ltx2(path: str | Path, dtype: torch.dtype | None = torch.float32) -> LTX2Model:
    """The model of either layout, built on the meta device and filled tensor by tensor."""
    geometry, tensors = read_ltx2(path)
    with torch.device("meta"):
        model = LTX2Model(geometry)
    state = {}
    for name in tensors:
        tensor = tensors[name]
        state[name] = tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor
    tensors.close()
    model.load_state_dict(state, strict=True, assign=True)
    return model


# ----------------------------------------------------------------------------- writing

def release_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {PREFIX + name: tensor for name, tensor in state.items()}


def release_metadata(geometry: LTX2Geometry) -> dict[str, str]:
    """The safetensors metadata of a release file: the config ltx-core builds the DiT from."""
    return {"config": json.dumps(release_config(geometry)), "format": "pt"}


def diffusers_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {diffusers_name(name): tensor for name, tensor in state.items()}


def _checked(state: Mapping[str, torch.Tensor], geometry: LTX2Geometry) -> dict[str, torch.Tensor]:
    check_tensors(state, expected_shapes(geometry), "the state to write")
    return {name: state[name].detach().to("cpu").contiguous() for name in state}


def write_release(file: str | Path, geometry: LTX2Geometry, state: Mapping[str, torch.Tensor]) -> Path:
    """One release-layout file of the DiT alone (``model.diffusion_model.*`` and its metadata config):
    what ltx-core's model builder and ComfyUI load. The text side and decoders stay in the original
    release file."""
    file = Path(file)
    save_file(release_tensors(_checked(state, geometry)), str(file), metadata=release_metadata(geometry))
    return file


def write_diffusers(folder: str | Path, geometry: LTX2Geometry, state: Mapping[str, torch.Tensor]) -> Path:
    """diffusers' ``LTX2VideoTransformer3DModel`` folder: config.json and one safetensors file."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = diffusers_tensors(_checked(state, geometry))
    (folder / CONFIG_NAME).write_text(json.dumps(diffusers_config(geometry), indent=2) + "\n")
    save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    return folder
