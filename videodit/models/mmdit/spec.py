"""Open-Sora 2.0's MMDiT behind the model-family seam (``models/spec.py``).

What differs from STDiT and Wan, as the rest of the system sees it: two kinds of blocks in one
list (19 double-stream, then 38 single-stream, one call ``block(img, txt, vec, rope[, text_mask])``),
text that travels through every block beside the image (joint attention over [text; image]: the
caption's length costs in every block), a pooled caption vector (CLIP-L) in the modulation, and
the given frames entering as input channels (``cond_in``: a mask and the masked latents).
Parallel plans live in ``parallel_plan.py``; the encoders in ``vae.py`` and ``text.py``.
"""

from __future__ import annotations

import dataclasses
import json

import torch
from torch import nn

from videodit.errors import UserError
from videodit.models.flop_count import FlopCount
from videodit.models.mmdit import flops, layouts, parallel_plan
from videodit.models.mmdit.model import DoubleStreamBlock, MMDiT, MMDiTGeometry, unpatchify
from videodit.models.mmdit.stage import MMDiTStage, stage_io
from videodit.models.spec import ActivationDims, Conditions, ModelSpec, TensorParallelPlan

MODEL_TYPE = "videodit-mmdit"
HC_LATENT_CHANNELS = 128   # the Video DC-AE (dc-ae-f32t4c128) of opensora-v2-hc
# LoRA's targets in other namings: Open-Sora 2.0 has none of its own (PEFT on its module names);
# diffusers' Flux names for the layers that exist in both (inside a double or a single block).
DIFFUSERS_NAMES = {
    "attn.to_q": "img_attn.q_proj", "attn.to_k": "img_attn.k_proj", "attn.to_v": "img_attn.v_proj",
    "attn.to_out.0": "img_attn.proj", "attn.add_q_proj": "txt_attn.q_proj", "attn.add_k_proj": "txt_attn.k_proj",
    "attn.add_v_proj": "txt_attn.v_proj", "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2", "ff_context.net.0.proj": "txt_mlp.0",
    "ff_context.net.2": "txt_mlp.2", "proj_out": "linear2",
}


class MMDiTSpec(ModelSpec):
    family = "mmdit"
    model_type = MODEL_TYPE
    geometry_type = MMDiTGeometry
    released_encoders = (16, 4096, 512)   # HunyuanVideo's VAE, T5-XXL at 512 tokens
    vae_kinds = ("hunyuan", "opensora-dc-ae")
    text_kinds = ("t5-clip",)

    released_name = "Open-Sora 2.0 MMDiT (Open_Sora_v2.safetensors or a training checkpoint)"
    released_format = "opensora-v2"
    released_short = "Open-Sora 2.0"
    released_takes_given_frames = True
    released_fix = "use model.preset=opensora-v2 (or opensora-v2-hc for the high-compression model)"
    export_formats = ("opensora-v2",)
    block_streams = parallel_plan.BLOCK_STREAMS   # (img, txt): memory.offload moves both

    # ------------------------------------------------------------------ parallel plans (parallel_plan.py)

    @property
    def sequence_parallel(self) -> str:
        return parallel_plan.sequence_parallel()

    @property
    def sequence_args(self) -> dict:
        return parallel_plan.sequence_args()

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        return parallel_plan.tensor_parallel_plan()

    def check_sequence_parallel(self, num_heads: int, *, tp: int, sp: int, ring: int) -> None:
        parallel_plan.check_sequence_parallel(num_heads, tp=tp, sp=sp, ring=ring)

    # ------------------------------------------------------------------ encoders

    def build_vae(self, kind, path, subfolder, *, scaling_factor, micro_batch, temporal_micro_batch, dtype):
        from videodit.models.mmdit.vae import build_opensora2_vae   # diffusers / the DC-AE, only when asked
        return build_opensora2_vae(kind, path, subfolder, scaling_factor=scaling_factor, micro_batch=micro_batch,
                                   temporal_micro_batch=temporal_micro_batch, dtype=dtype)

    def build_text_encoder(self, kind, path, max_length, dtype, mask=True):
        """T5-XXL (512 tokens unless ``text.max_length`` says otherwise) and CLIP-L's pooled vector;
        ``mask=False`` runs T5 unmasked, as Open-Sora does."""
        from videodit.models.mmdit.text import load_opensora2_text   # transformers, only when asked
        return load_opensora2_text(path, max_length=max_length or 512, dtype=dtype, mask=mask)

    # ------------------------------------------------------------------ build

    def geometry(self, m, latent_channels: int, caption_channels: int, caption_length: int) -> MMDiTGeometry:
        """``model.depth`` double blocks and ``model.depth_single`` single ones; the caption's
        length is not part of the model (any number of text tokens)."""
        head_dim = m.hidden_size // m.num_heads if m.num_heads and m.hidden_size % m.num_heads == 0 else None
        axes = m.axes_dim if m.axes_dim is not None else (layouts.default_axes(head_dim) if head_dim else None)
        return MMDiTGeometry(hidden_size=m.hidden_size, num_heads=m.num_heads, depth=m.depth,
                             depth_single_blocks=m.depth_single, latent_channels=latent_channels,
                             mlp_ratio=m.mlp_ratio, patch_size=tuple(m.patch_size), vec_in_dim=m.vec_in_dim,
                             context_in_dim=caption_channels, axes_dim=tuple(axes or (0, 0, 0)),
                             qkv_bias=True, cond_embed=m.cond_embed, bf16_timesteps=m.bf16_timesteps)

    def released_encoders_of(self, m) -> tuple[int, int, int]:
        """The high-compression model (patch 1) is built on the Video DC-AE's 128 channels."""
        if list(m.patch_size or []) == [1, 1, 1]:
            return (HC_LATENT_CHANNELS, *self.released_encoders[1:])
        return self.released_encoders

    def build(self, geometry: MMDiTGeometry) -> MMDiT:
        return MMDiT(geometry)

    def geometry_config(self, geometry: MMDiTGeometry) -> dict:
        config = dataclasses.asdict(geometry)
        config.update(patch_size=list(geometry.patch_size), axes_dim=list(geometry.axes_dim))
        return {"model_type": MODEL_TYPE, **config}

    def geometry_from_config(self, config: dict) -> MMDiTGeometry:
        fields = {f.name for f in dataclasses.fields(MMDiTGeometry)}
        try:
            return MMDiTGeometry(**{k: v for k, v in config.items() if k in fields})
        except TypeError as exc:
            raise UserError(f"config.json is not a videodit MMDiT config ({exc}); write it with videodit ckpt "
                            "export") from None

    def latent_channels(self, tensors) -> int:
        """The final layer's outputs per token over the patch area, read off ``cond_in`` (one more
        channel per patch value than ``img_in``); without ``cond_in``, a 2x2 patch."""
        out = tensors["final_layer.linear.weight"].shape[0]
        area = 4
        if "cond_in.weight" in tensors:
            area = tensors["cond_in.weight"].shape[1] - tensors["img_in.weight"].shape[1]
        return out // area

    def caption_channels(self, tensors) -> int:
        return tensors["txt_in.weight"].shape[1]

    # ------------------------------------------------------------------ released weights

    def released_layout(self, path) -> bool:
        return layouts.is_opensora2_layout(path)

    def read_released(self, path, ema: bool = False):
        """Lazy: each tensor is read from its file when asked for; checked strictly first."""
        return layouts.read_opensora2(path, ema=ema)

    run_fields = ("bf16_timesteps",)   # how t is rounded (a precision), not the network
    field_options = {"depth_single_blocks": "model.depth_single"}

    def read_released_like(self, path, ema: bool = False, like: dict | None = None):
        """The file has no RoPE split: ``like``'s ``axes_dim`` where it fits the heads."""
        axes = (like or {}).get("axes_dim")
        return layouts.read_opensora2(path, ema=ema, axes_dim=tuple(axes) if axes else None)

    def released_config(self, geometry, experts: bool = False) -> str | None:
        return "opensora-v2-hc" if geometry is not None and geometry.patch == 1 else "opensora-v2-stage1"

    def released_files(self, path):
        if path.is_file():
            return [path]
        folder = path / "model" if (path / "model").is_dir() else path
        return sorted(folder.glob("*.safetensors"))

    def load_released(self, path, ema: bool = False) -> MMDiT:
        return layouts.load_opensora2(path, ema=ema)

    def export_released(self, fmt: str, geometry: MMDiTGeometry, tensors):
        """``Open_Sora_v2.safetensors``: the names and (rotate-half) layout Open-Sora 2.0's
        ``MMDiTModel`` loads strictly with ``fused_qkv=False, use_liger_rope=True``; config.json
        holds its ``model=dict(...)`` for reference (Open-Sora reads its own .py configs)."""
        if fmt != "opensora-v2":
            raise UserError(f"--format {fmt} does not apply to an MMDiT; it exports as: "
                            f"{', '.join(('videodit',) + self.export_formats)}")
        implied = layouts.RELEASED_AXES if geometry.head_dim == 128 else layouts.released_axes(geometry.head_dim)
        if implied is None or tuple(geometry.axes_dim) != tuple(implied):   # the file cannot say it
            raise UserError(f"model.axes_dim={list(geometry.axes_dim)} is not the released RoPE split of a "
                            f"{geometry.head_dim}-channel head ({list(implied) if implied else 'none'}), which "
                            "Open_Sora_v2.safetensors cannot record; export it as a videodit folder (no --format)")
        config = json.dumps(layouts.opensora_model_config(geometry), indent=2) + "\n"
        return layouts.to_released(tensors, geometry), {"opensora_model_config.json": config}, layouts.RELEASED_FILE

    # ------------------------------------------------------------------ objective

    def model_inputs(self, x_t, t, cond: Conditions) -> tuple:
        """(x_t, t, y, pooled, cond[, y_mask]), all tensors: a dropped caption (``drop``) is an
        all-zero caption and pooled vector (a text encoder that gives the empty caption's
        encoding instead, as Open-Sora, replaces them before and leaves ``drop`` False); no
        pooled vector is the zero vector (given as [B, 0]); no given frames is the all-zero
        condition (Open-Sora's t2v: mask 0, latents 0); the caption's mask only where it has one
        (None: every token attended, as Open-Sora)."""
        n = x_t.shape[0]
        y, y_mask = cond.y, cond.y_mask
        # No pooled vector: a zero-width one, which the model reads as the zero vector (the spec
        # does not know the model's vec_in_dim; every input stays a tensor).
        pooled = x_t.new_zeros(n, 0) if cond.pooled is None else cond.pooled
        if cond.drop is not None:
            y = torch.where(cond.drop[:, None, None], torch.zeros_like(y), y)
            pooled = torch.where(cond.drop[:, None], torch.zeros_like(pooled), pooled)
        given = cond.given
        if given is None:
            given = x_t.new_zeros(n, x_t.shape[1] + 1, *x_t.shape[2:])
        inputs = (x_t, t, y, pooled, given.to(x_t.dtype))
        return inputs if y_mask is None else (*inputs, y_mask.bool())

    def unconditional(self, cond: Conditions, negative=None) -> Conditions:
        """Without a negative prompt, the dropped caption of training (all zero); with one (its
        (y, y_mask) or (y, y_mask, pooled)), that caption's encoding."""
        if negative is None:
            drop = torch.ones(cond.y.shape[0], dtype=torch.bool, device=cond.y.device)
            return dataclasses.replace(cond, drop=drop)
        y, y_mask, *pooled = negative
        n = cond.y.shape[0]
        return dataclasses.replace(cond, y=y.expand(n, *y.shape[1:]),
                                   y_mask=None if y_mask is None else y_mask.expand(n, -1),
                                   pooled=pooled[0].expand(n, -1) if pooled else cond.pooled,
                                   drop=torch.zeros(n, dtype=torch.bool, device=cond.y.device))

    # ------------------------------------------------------------------ blocks

    def pipeline_stage(self, model, block_ids, *, first: bool, last: bool) -> nn.Module:
        return MMDiTStage(model, block_ids, first=first, last=last)

    def stage_io(self, module, inputs, microbatches: int) -> dict:
        return stage_io(module, inputs, microbatches)

    def stage_latents(self, output, latent_shape, geometry):
        return unpatchify(output, latent_shape, geometry)

    def block_kind(self, block: nn.Module) -> str:
        return "double" if isinstance(block, DoubleStreamBlock) else "single"

    def dynamic_dims(self, args):
        """block(img [B, Li, D], txt [B, Lt, D], vec [B, D], rope [Li, ...][, text_mask [B, Lt]]):
        batch and image tokens, batch and caption tokens, batch, RoPE's rows."""
        img, txt, vec, rope, *mask = args
        return [(img, [0, 1]), (txt, [0, 1]), (vec, [0]), (rope, [0]), *((m, [0, 1]) for m in mask)]

    def blocks_of(self, model_cfg) -> int:
        """``model.depth`` double blocks, then ``model.depth_single`` single ones."""
        return model_cfg.depth + model_cfg.depth_single

    def lora_target(self, name: str) -> str:
        """diffusers' Flux names (``attn.to_q``, ``ff.net.0.proj``, ``proj_out`` inside a block) in
        Open-Sora's (``img_attn.q_proj``, ``img_mlp.0``, ``linear2``)."""
        return DIFFUSERS_NAMES.get(name, name)

    # ------------------------------------------------------------------ FLOPs, memory

    def forward_flops(self, geometry, frames: int, positions: int, caption_tokens: int) -> FlopCount:
        return flops.grid_flops(geometry, frames * positions, caption_tokens)

    def activation_dims(self, geometry: MMDiTGeometry) -> ActivationDims:
        return ActivationDims(geometry.hidden_size, geometry.num_heads, geometry.mlp_hidden, geometry.context_in_dim)

    def activation_profile(self, geometry):
        from videodit.models.mmdit.activations import profile
        return profile(geometry.depth, geometry.depth_single_blocks, geometry.num_heads)

    def kind_activation_profile(self, geometry, kind: str):
        """One double or one single block's own table (``memory.checkpoint_blocks`` leaves kinds
        plain in unequal numbers)."""
        from videodit.models.mmdit.activations import profile
        return profile(int(kind == "double"), int(kind == "single"), geometry.num_heads)
