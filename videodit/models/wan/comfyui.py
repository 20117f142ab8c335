"""What ComfyUI reads off a Wan DiT in one ``.safetensors`` file (its "Load Diffusion Model" node),
so that ``ckpt export --format comfyui`` refuses a model ComfyUI would build differently.

ComfyUI (``comfy/model_detection.py``, ``detect_unet_config``; read at Comfy-Org/ComfyUI a125cd84)
recognises Wan by ``head.modulation`` under Wan's original names, with or without a
``model.diffusion_model.`` prefix (``unet_prefix_from_state_dict``). It reads the width, the FFN
width, the layer count and the input and output channels off the weights, and an i2v model (Wan 2.1's,
with CLIP) off ``img_emb.proj.0.bias``. The rest it fixes, as every released Wan has it: 128-wide
heads (heads = dim / 128), patch (1, 2, 2), a 256-wide time sinusoid, q/k and cross-attention
norms, eps 1e-6 and umT5-XXL's 4096-wide text (its ``WanModel`` default ``text_dim``).
"""

from __future__ import annotations

from videodit.errors import UserError
from videodit.models.wan.model import WanGeometry

# What ComfyUI assumes rather than reads (field of WanGeometry -> value).
COMFYUI_FIXED = {"head_dim": 128, "patch_size": (1, 2, 2), "freq_dim": 256, "qk_norm": True,
                 "cross_attn_norm": True, "eps": 1e-6, "text_dim": 4096}


def comfyui_mismatches(geometry: WanGeometry) -> list[str]:
    """``field=ours (ComfyUI assumes theirs)`` for each fixed value this model does not have."""
    found = []
    for field, assumed in COMFYUI_FIXED.items():
        value = getattr(geometry, field)
        if (tuple(value) if isinstance(value, (list, tuple)) else value) != assumed:
            found.append(f"{field}={value} (ComfyUI assumes {assumed})")
    return found


def check_comfyui_loadable(geometry: WanGeometry) -> None:
    """Refuse, in one line, a model ComfyUI would detect as another (any released Wan passes)."""
    mismatches = comfyui_mismatches(geometry)
    if mismatches:
        raise UserError(f"ComfyUI would not build this Wan model from its weights: {', '.join(mismatches)}; "
                        "--format comfyui fits models of a released Wan's shape (use --format wan or diffusers)")
