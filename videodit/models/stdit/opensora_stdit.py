"""Open-Sora 1.2 STDiT3 weights <-> videodit STDiT weights (state dicts; files are opensora_files.py).

Open-Sora v1.2.0's STDiT3 (opensora/models/stdit/stdit3.py) and videodit's STDiT with
``position_embedding="opensora"`` and ``null_caption_mask="prompt"`` compute the same function;
their state dicts differ only in layout:

- renames: ``x_embedder.proj`` -> ``patch_embed``, ``y_embedder.y_proj`` -> ``caption_embedder.proj``,
  ``y_embedder.y_embedding`` -> ``caption_embedder.null_caption``, ``cross_attn.q_linear`` ->
  ``cross_attn.q``, ``final_layer.scale_shift_table``/``linear`` -> ``final_layer.table``/``proj``;
- fused projections: ``attn.qkv`` splits 3 ways (q, k, v), ``cross_attn.kv_linear`` 2 ways (k, v);
- temporal RoPE: Open-Sora (rotary_embedding_torch) rotates interleaved pairs (2i, 2i+1) of a head,
  videodit half-split pairs (i, i + d/2). Permuting the q and k rows of every head of the temporal
  blocks (and the q_norm/k_norm weights) by [0, 2, 4, ..., 1, 3, 5, ...] makes them identical; the
  permutation stays inside a head, so tensor parallelism by heads is unaffected;
- output: Open-Sora predicts ``x0 - noise`` with ``pred_sigma`` (2C values per patch position, the
  first C used); videodit predicts ``noise - x0`` with C. Import keeps the first C and negates;
  export negates and writes zeros for the unused sigma half;
- ``rope.freqs`` (a constant) is dropped on import and recomputed on export.
"""

from __future__ import annotations

import math
import re

import torch

from videodit.errors import UserError
from videodit.models.layers import OPENSORA_BASE_PIXELS, RotaryEmbedding
from videodit.models.stdit.model import DiTGeometry, STDiT
from videodit.models.weight_files import ConfigValues, build_bounded

OPENSORA_MODEL_TYPE = "STDiT3"
# STDiT3Config's defaults (v1.2.0), for keys a config.json leaves out.
STDIT3_DEFAULTS = dict(input_size=[None, None, None], input_sq_size=OPENSORA_BASE_PIXELS, in_channels=4,
                       patch_size=[1, 2, 2], hidden_size=1152, depth=28, num_heads=16, mlp_ratio=4.0,
                       class_dropout_prob=0.1, pred_sigma=True, drop_path=0.0, caption_channels=4096,
                       model_max_length=300, qk_norm=True, enable_flash_attn=False, enable_layernorm_kernel=False,
                       enable_sequence_parallelism=False, only_train_temporal=False, freeze_y_embedder=False,
                       skip_y_embedder=False)
RENAMES = [("x_embedder.proj.", "patch_embed."), ("y_embedder.y_proj.", "caption_embedder.proj."),
           ("y_embedder.y_embedding", "caption_embedder.null_caption"), ("cross_attn.q_linear.", "cross_attn.q."),
           ("final_layer.scale_shift_table", "final_layer.table"), ("final_layer.linear.", "final_layer.proj.")]
_FUSED = re.compile(r"(?P<block>(spatial|temporal)_blocks\.\d+)\.(?P<kind>attn\.qkv|cross_attn\.kv_linear)\."
                    r"(?P<param>weight|bias)")
_NORM = re.compile(r"temporal_blocks\.\d+\.attn\.[qk]_norm\.weight")


def is_opensora_config(config) -> bool:
    return isinstance(config, dict) and (config.get("model_type") == OPENSORA_MODEL_TYPE
                                         or OPENSORA_MODEL_TYPE in (config.get("architectures") or []))


# ---------------------------------------------------------------------------- geometry

def geometry_from_opensora(config: dict) -> DiTGeometry:
    """The videodit geometry computing what an STDiT3 ``config.json`` describes."""
    c = {**STDIT3_DEFAULTS, **config}
    if c["input_sq_size"] != OPENSORA_BASE_PIXELS or c["skip_y_embedder"]:
        raise UserError(f"this STDiT3 config has input_sq_size={c['input_sq_size']} skip_y_embedder="
                        f"{c['skip_y_embedder']}; videodit converts Open-Sora 1.2's (input_sq_size=512, "
                        "skip_y_embedder=false) only")
    values = ConfigValues(c, "the STDiT3 config.json", "restore the config.json of the Open-Sora download")
    values.bool("qk_norm")
    values.bool("pred_sigma", True)
    return DiTGeometry(in_channels=int(c["in_channels"]), caption_channels=int(c["caption_channels"]),
                       caption_length=int(c["model_max_length"]), depth=int(c["depth"]),
                       hidden_size=int(c["hidden_size"]), num_heads=int(c["num_heads"]),
                       mlp_ratio=float(c["mlp_ratio"]), patch_size=tuple(int(p) for p in c["patch_size"]),
                       qk_norm=bool(c["qk_norm"]), position_embedding="opensora", null_caption_mask="prompt")


def opensora_config(geometry: DiTGeometry) -> dict:
    """The ``config.json`` of an Open-Sora STDiT3 folder (``STDiT3.from_pretrained`` reads it)."""
    check_exportable(geometry)
    g = geometry
    return {"architectures": [OPENSORA_MODEL_TYPE], "model_type": OPENSORA_MODEL_TYPE,
            **STDIT3_DEFAULTS, "in_channels": g.in_channels, "patch_size": list(g.patch_size),
            "hidden_size": g.hidden_size, "depth": g.depth, "num_heads": g.num_heads, "mlp_ratio": g.mlp_ratio,
            "caption_channels": g.caption_channels, "model_max_length": g.caption_length, "qk_norm": g.qk_norm}


def config_from_weights(state: dict[str, torch.Tensor]) -> dict:
    """An STDiT3 config read off the weights of a training checkpoint (which has no config.json)."""
    try:
        embed = state["x_embedder.proj.weight"]
        hidden, channels, patch = embed.shape[0], embed.shape[1], list(embed.shape[2:])
        head_dim = 2 * state["rope.freqs"].shape[0]
        depth = _block_count(state)
        sigma = state["final_layer.linear.weight"].shape[0] == 2 * channels * math.prod(patch)
        return {"model_type": OPENSORA_MODEL_TYPE, "in_channels": channels, "patch_size": patch,
                "hidden_size": hidden, "depth": depth, "num_heads": hidden // head_dim,
                "mlp_ratio": state["spatial_blocks.0.mlp.fc1.weight"].shape[0] / hidden,
                "caption_channels": state["y_embedder.y_proj.fc1.weight"].shape[1],
                "model_max_length": state["y_embedder.y_embedding"].shape[0],
                "qk_norm": "spatial_blocks.0.attn.q_norm.weight" in state, "pred_sigma": sigma}
    except (KeyError, ValueError, IndexError) as exc:
        raise UserError(f"these weights are not an Open-Sora STDiT3 state dict (no {exc}); pass an STDiT3 "
                        "folder (config.json + model.safetensors) or an Open-Sora 1.2 training checkpoint") from None


_SPATIAL = re.compile(r"spatial_blocks\.([0-9]{1,9})\.")


def _block_count(state) -> int:
    """The spatial blocks the names number 0, 1, ...: counted off the names (an index of 10^12 is a
    missing block, never a range to build)."""
    found = {int(m[1]) for name in state if (m := _SPATIAL.match(name))}
    if not found:
        raise KeyError("'spatial_blocks.0'")
    missing = next((i for i in range(len(found)) if i not in found), None)
    if missing is not None:
        raise UserError(f"the weights number spatial_blocks up to {max(found)} but lack spatial_blocks.{missing}; "
                        "restore them from the original checkpoint")
    return len(found)


def check_exportable(geometry: DiTGeometry) -> None:
    """Refuse models whose function Open-Sora's STDiT3 cannot compute."""
    g = geometry
    wrong = [f"{k}={v}" for k, v, ok in (("position_embedding", g.position_embedding, "opensora"),
                                          ("null_caption_mask", g.null_caption_mask, "prompt"),
                                          ("pooled_caption", g.pooled_caption, False),
                                          ("temporal_pos_embed", g.temporal_pos_embed, False)) if v != ok]
    if wrong:
        raise UserError(f"this model ({' '.join(wrong)}) has no Open-Sora STDiT3 equivalent; export models built "
                        "with model.position_embedding=opensora model.null_caption_mask=prompt and no pooled_caption "
                        "or temporal_pos_embed (as `videodit ckpt import` makes them)")


# ---------------------------------------------------------------------------- weights

def rope_half_split(rows: torch.Tensor, head_dim: int, inverse: bool = False) -> torch.Tensor:
    """Reorder the rows of each head from interleaved RoPE pairs (Open-Sora) to half-split pairs
    (videodit): new row j < d/2 is old row 2j, new row d/2 + j is old row 2j + 1 (``inverse``: back)."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    if inverse:
        order = torch.argsort(order)
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, head_dim, *rows.shape[1:])[:, order.to(rows.device)].reshape(rows.shape)


def _output_rows(tensor: torch.Tensor, geometry: DiTGeometry, keep: int) -> torch.Tensor:
    """[P * C_out, ...] -> [P, C_out, ...]: rows per patch position, then channel."""
    return tensor.reshape(math.prod(geometry.patch_size), keep, *tensor.shape[1:])


def from_opensora(state: dict[str, torch.Tensor], geometry: DiTGeometry, pred_sigma: bool = True
                  ) -> dict[str, torch.Tensor]:
    """videodit's state dict from an STDiT3 one (checked first: every tensor present, right shapes)."""
    check_state(state, geometry, pred_sigma)
    head_dim = geometry.hidden_size // geometry.num_heads
    out = {}
    for name, tensor in state.items():
        if name == "rope.freqs":
            continue
        if m := _FUSED.fullmatch(name):
            block, param = m["block"], m["param"]
            if m["kind"] == "attn.qkv":
                q, k, v = tensor.chunk(3)
                if block.startswith("temporal"):
                    q, k = rope_half_split(q, head_dim), rope_half_split(k, head_dim)
                out.update({f"{block}.attn.{p}.{param}": t for p, t in zip("qkv", (q, k, v))})
            else:
                k, v = tensor.chunk(2)
                out.update({f"{block}.cross_attn.k.{param}": k, f"{block}.cross_attn.v.{param}": v})
        elif _NORM.fullmatch(name):
            out[name] = rope_half_split(tensor, head_dim)
        elif name.startswith("final_layer.linear."):
            channels = geometry.in_channels
            rows = _output_rows(tensor, geometry, 2 * channels if pred_sigma else channels)[:, :channels]
            out[_rename(name)] = -rows.reshape(-1, *tensor.shape[1:])
        else:
            out[_rename(name)] = tensor
    return {name: t.contiguous() for name, t in out.items()}


def to_opensora(state: dict[str, torch.Tensor], geometry: DiTGeometry) -> dict[str, torch.Tensor]:
    """STDiT3's state dict (``pred_sigma=True``, the sigma half zero) from videodit's."""
    check_exportable(geometry)
    head_dim = geometry.hidden_size // geometry.num_heads
    out, done = {}, set()
    for name, tensor in state.items():
        if name in done:
            continue
        if m := re.fullmatch(r"((spatial|temporal)_blocks\.\d+)\.attn\.q\.(weight|bias)", name):
            block, param = m[1], m[3]
            q, k, v = (state[f"{block}.attn.{p}.{param}"] for p in "qkv")
            if block.startswith("temporal"):
                q, k = rope_half_split(q, head_dim, inverse=True), rope_half_split(k, head_dim, inverse=True)
            out[f"{block}.attn.qkv.{param}"] = torch.cat([q, k, v])
            done.update(f"{block}.attn.{p}.{param}" for p in "kv")
        elif m := re.fullmatch(r"((spatial|temporal)_blocks\.\d+)\.cross_attn\.k\.(weight|bias)", name):
            block, param = m[1], m[3]
            out[f"{block}.cross_attn.kv_linear.{param}"] = torch.cat([tensor, state[f"{block}.cross_attn.v.{param}"]])
            done.add(f"{block}.cross_attn.v.{param}")
        elif re.fullmatch(r"(spatial|temporal)_blocks\.\d+\.(attn\.[kv]|cross_attn\.v)\.(weight|bias)", name):
            continue   # taken with its q (or k) above
        elif _NORM.fullmatch(name):
            out[name] = rope_half_split(tensor, head_dim, inverse=True)
        elif name.startswith("final_layer.proj."):
            rows = -_output_rows(tensor, geometry, geometry.in_channels)
            sigma = torch.zeros_like(rows)   # Open-Sora's unused second half of each patch's outputs
            out[_rename(name, back=True)] = torch.cat([rows, sigma], dim=1).reshape(-1, *tensor.shape[1:])
        else:
            out[_rename(name, back=True)] = tensor
    out["rope.freqs"] = RotaryEmbedding(head_dim).inv_freq.to(device=next(iter(state.values())).device)
    return {name: t.contiguous() for name, t in out.items()}


def _rename(name: str, back: bool = False) -> str:
    for theirs, ours in RENAMES:
        old, new = (ours, theirs) if back else (theirs, ours)
        if name.startswith(old):
            return new + name[len(old):]
        if f".{old}" in name:
            return name.replace(f".{old}", f".{new}", 1)
    return name


def check_state(state: dict[str, torch.Tensor], geometry: DiTGeometry, pred_sigma: bool = True) -> None:
    """One UserError naming the first missing, unexpected or misshapen STDiT3 tensor."""
    model = build_bounded(lambda: STDiT(geometry), len(state), "the config describes an STDiT3 of far more tensors "
                          f"than the {len(state)} its weights hold; pass the config.json written with these weights")
    expected = to_opensora(model.state_dict(), geometry)
    if not pred_sigma:
        weight, bias = expected["final_layer.linear.weight"], expected["final_layer.linear.bias"]
        expected["final_layer.linear.weight"] = weight[: weight.shape[0] // 2]
        expected["final_layer.linear.bias"] = bias[: bias.shape[0] // 2]
    fix = "the weights do not fit their config.json; pass the config.json written with these weights"
    for name, tensor in expected.items():
        if name not in state:
            raise UserError(f"the Open-Sora weights have no tensor {name}; {fix}")
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise UserError(f"Open-Sora tensor {name} is {tuple(state[name].shape)} but the config needs "
                            f"{tuple(tensor.shape)}; {fix}")
    extra = sorted(state.keys() - expected.keys())
    if extra:
        raise UserError(f"the Open-Sora weights have tensors STDiT3 of this config lacks "
                        f"({', '.join(extra[:3])}); {fix}")
    freqs = state["rope.freqs"].cpu()   # cast with the model in bf16 training checkpoints
    if not torch.allclose(freqs.float(), RotaryEmbedding(2 * freqs.numel()).inv_freq.to(freqs.dtype).float()):
        raise UserError("rope.freqs differ from rotary_embedding_torch's defaults (theta 10000), which videodit's "
                        "temporal RoPE computes; these weights come from a modified STDiT3")
