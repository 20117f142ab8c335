"""Wan 2.1 behind the model-family seam (``models/spec.py``).

What differs from STDiT, as the rest of the system sees it: full 3D self-attention over every
video token (sequence parallelism is Ulysses / ring over the token sequence, not STDiT's
frame/position swap), q/k RMSNorm over all heads (tensor parallelism shards those norms with
the columns), text that enters only through cross-attention with no mask (a dropped caption
is an all-zero context, as an empty caption is after Wan's zero padding), and no frame masks.
"""

from __future__ import annotations

import dataclasses
import json

import torch
from torch import nn

from videodit.errors import UserError
from videodit.models.flop_count import FlopCount
from videodit.models.spec import ActivationDims, Conditions, ModelSpec, TensorParallelPlan, check_ulysses_ring
from videodit.models.wan import flops, layouts
from videodit.models.wan.experts import expert_folder, is_experts_folder
from videodit.models.wan.model import I2V_MASK_CHANNELS, WanDiT, WanGeometry, unpatchify
from videodit.models.wan.stage import WanStage, stage_io

MODEL_TYPE = "videodit-wan"


def _block_plan(block: nn.Module) -> dict:
    """Megatron pairs: q, k, v column-wise (heads split over ranks), o row-wise, in both
    attentions; the FFN's first linear column-wise, its second row-wise."""
    def attention(prefix: str, inputs: tuple) -> dict:
        plan = {prefix: ("inputs", inputs), f"{prefix}.q": "colwise", f"{prefix}.k": "colwise",
                f"{prefix}.v": "colwise", f"{prefix}.o": "rowwise"}
        if hasattr(block.get_submodule(prefix), "k_img"):   # Wan 2.1 I2V: the image's keys and values too
            plan.update({f"{prefix}.k_img": "colwise", f"{prefix}.v_img": "colwise"})
        return plan
    return {**attention("self_attn", ("replicate",)),            # rope comes as a keyword, whole
            **attention("cross_attn", ("replicate", "replicate")),   # video tokens, text tokens
            "ffn": ("inputs", ("replicate",)), "ffn.0": "colwise", "ffn.2": "rowwise"}


class WanSpec(ModelSpec):
    family = "wan"
    model_type = MODEL_TYPE
    geometry_type = WanGeometry
    sequence_parallel = "full_attention"
    released_encoders = (16, 4096, 512)   # Wan 2.1's VAE, umT5-XXL at 512 tokens
    vae_kinds = ("wan2.1", "wan2.2")
    text_kinds = ("umt5",)

    def build_vae(self, kind, path, subfolder, *, scaling_factor, micro_batch, temporal_micro_batch, dtype):
        from videodit.models.wan.vae import build_wan_vae   # diffusers, only when asked
        return build_wan_vae(path, subfolder, scaling_factor=scaling_factor, micro_batch=micro_batch, dtype=dtype,
                             kind=kind)

    def build_text_encoder(self, kind, path, max_length, dtype, mask=True):
        """umT5-XXL, 512 tokens unless ``text.max_length`` says otherwise; always with its mask."""
        from videodit.models.wan.text import load_umt5   # transformers, only when asked
        return load_umt5(path, max_length=max_length or 512, dtype=dtype)

    released_name = "Wan 2.1 or 2.2 (Wan's or diffusers' folder)"
    released_format = "wan2.1"
    released_short = "Wan"
    released_fix = "use a Wan preset of the same size (model.preset=wan2.1-t2v-1.3b or wan2.1-t2v-14b)"
    export_formats = (*layouts.LAYOUTS, "comfyui")   # ("wan", "diffusers"); comfyui: one file, Wan's names
    lora_formats = ("diffusers", "comfyui", "peft")

    def lora_module_name(self, fmt: str, module: str) -> str:
        """diffusers' names for diffusers' WanTransformer3DModel; Wan's own for ComfyUI and peft."""
        return layouts.diffusers_name(module) if fmt == "diffusers" else module
    # Wan 2.2 A14B's download, and diffusers' WanPipeline (transformer = high noise, transformer_2 = low)
    expert_folders = {"wan": ("high_noise_model", "low_noise_model"), "diffusers": ("transformer", "transformer_2"),
                      "comfyui": ("high_noise_model", "low_noise_model")}   # each holding <folder>.safetensors
    expert_prefixes = ("high_noise_model.", "low_noise_model.")   # WanExperts' attributes
    # Where a block's inputs are indexed by token, for sequence parallelism: x [B, L, D] on dim 1,
    # e0 on dim 1 when it is per token ([B, L, 6, D], 4 dims; [B, 6, D] stays whole), rope on dim 0.
    sequence_args = {0: 1, 1: (1, 4), 3: 0}

    # ------------------------------------------------------------------ build

    def geometry(self, m, latent_channels: int, caption_channels: int, caption_length: int) -> WanGeometry:
        """An i2v model takes the latent, a 4-channel mask and the given frames' latents."""
        extra = latent_channels + I2V_MASK_CHANNELS if m.task == "i2v" else 0
        return WanGeometry(dim=m.hidden_size, ffn_dim=m.ffn_dim, num_heads=m.num_heads, num_layers=m.depth,
                           in_channels=latent_channels + extra, out_channels=latent_channels,
                           text_dim=caption_channels, text_len=caption_length, patch_size=tuple(m.patch_size),
                           qk_norm=m.qk_norm, task=m.task, image_dim=m.image_dim)

    def released_encoders_of(self, m) -> tuple[int, int, int]:
        """TI2V-5B is built for Wan 2.2's 48-channel VAE; every other release for Wan 2.1's."""
        return (layouts.WAN22_LATENT_CHANNELS, *self.released_encoders[1:]) if m.task == "ti2v" \
            else self.released_encoders

    def takes_first_frame(self, geometry: WanGeometry) -> bool:
        return geometry.task == "i2v"

    def first_frame_condition(self, first_frame_latents):
        """Wan's i2v conditioning (``wan/image2video.py``): a 4-channel mask, 1 on latent frame 0
        (its first pixel frame, alone in the causal VAE's first latent frame, is the given one), 0
        after; then the latents of the given frame followed by zero frames (mid-grey in [-1, 1])."""
        mask = torch.zeros_like(first_frame_latents[:, :1]).expand(-1, I2V_MASK_CHANNELS, -1, -1, -1).clone()
        mask[:, :, 0] = 1
        return torch.cat([mask, first_frame_latents], dim=1)

    def combine_experts(self, high, low, boundary):
        """Wan 2.2 A14B: the experts switch where Wan's integer timestep crosses boundary x 1000."""
        from videodit.models.wan.experts import WanExperts
        return WanExperts(high, low, boundary)

    def expert_guidance(self, boundary, guidance):
        from videodit.models.wan.experts import expert_guidance
        return expert_guidance(boundary, guidance)

    def expert_at(self, t, boundary):
        from videodit.models.wan.experts import high_noise
        return "high" if bool(high_noise(torch.tensor([float(t)]), boundary)) else "low"

    def build_image_encoder(self, path, dtype):
        """Wan 2.1 I2V's CLIP ViT-H/14 (``models/wan/clip.py``), from either layout."""
        from videodit.models.wan.clip import load_wan_image_encoder   # transformers, only when asked
        return load_wan_image_encoder(path, dtype=dtype)

    def build(self, geometry: WanGeometry) -> WanDiT:
        return WanDiT(geometry)

    def geometry_config(self, geometry: WanGeometry) -> dict:
        return {"model_type": MODEL_TYPE, **dataclasses.asdict(geometry)}

    def geometry_from_config(self, config: dict) -> WanGeometry:
        fields = {f.name for f in dataclasses.fields(WanGeometry)}
        try:
            return WanGeometry(**{k: v for k, v in config.items() if k in fields})
        except TypeError as exc:
            raise UserError(f"config.json is not a videodit Wan config ({exc}); write it with videodit ckpt export") \
                from None

    def latent_channels(self, tensors) -> int:
        """The latent's channels: the head's outputs per patch value (an i2v model takes more in)."""
        patch = tensors["patch_embedding.weight"].shape[2:]
        return tensors["head.head.weight"].shape[0] // (patch[0] * patch[1] * patch[2])

    def caption_channels(self, tensors) -> int:
        return tensors["text_embedding.0.weight"].shape[1]

    # ------------------------------------------------------------------ released weights

    def released_layout(self, path) -> bool:
        return layouts.is_wan_folder(path)

    def read_released(self, path, ema: bool = False):
        """Read lazily: each tensor is read from its shard when it is asked for."""
        if is_experts_folder(path):
            return layouts.read_experts_folder(path)
        return layouts.read_wan_folder(path)

    def released_files(self, path):
        return layouts.weight_files(path)

    run_fields = ("text_len",)   # the caption tokens: text.max_length of the run
    field_options = {"dim": "model.hidden_size", "num_layers": "model.depth"}

    def released_config(self, geometry, experts: bool = False) -> str | None:
        """The recipe of the release these weights are: its VAE, umT5, CLIP and sampling."""
        if geometry is None:
            return "wan2.1-t2v-1.3b-finetune"
        if experts:
            return "wan2.2-t2v-a14b-lora" if geometry.task == "t2v" else None
        if geometry.task == "ti2v":
            return "wan2.2-ti2v-5b-finetune"
        if geometry.task == "i2v":
            return "wan2.1-i2v-14b-lora" if geometry.image_dim else None
        return "wan2.1-t2v-14b-lora" if geometry.dim >= 5120 else "wan2.1-t2v-1.3b-finetune"

    def expert_source(self, path, expert):
        return expert_folder(path, expert) if is_experts_folder(path) else None

    def load_released(self, path, ema: bool = False) -> WanDiT:
        """Built on the meta device and filled shard by shard: a 14B model is held once."""
        return layouts.load_wan(path, dtype=torch.float32)

    def export_released(self, fmt: str, geometry: WanGeometry, tensors):
        if fmt == "comfyui":   # ComfyUI's "Load Diffusion Model": one file, no config, named after the folder
            from videodit.models.wan.comfyui import check_comfyui_loadable
            check_comfyui_loadable(geometry)
            return dict(tensors), {}, "{folder}.safetensors"
        if fmt == "diffusers":
            layouts.check_diffusers_writable(geometry)
            return layouts.to_diffusers(tensors), {"config.json": json.dumps(layouts.diffusers_config(geometry),
                                                                             indent=2) + "\n"}, layouts.WEIGHTS_NAME
        return dict(tensors), {"config.json": json.dumps(layouts.wan_config(geometry), indent=2) + "\n"}, \
            layouts.WEIGHTS_NAME

    # ------------------------------------------------------------------ objective

    def model_inputs(self, x_t, t, cond: Conditions) -> tuple:
        """(x_t, t, context[, x_mask]): a dropped caption is an all-zero context, which is what Wan's
        model sees for an empty caption after its zero padding (every pad is text_embedding(0)).
        With frame conditioning, x_mask gives the given frames' tokens time 0 (TI2V's way); a model
        with CLIP features (Wan 2.1 I2V) takes them last."""
        y = cond.y if cond.drop is None else torch.where(cond.drop[:, None, None], torch.zeros_like(cond.y), cond.y)
        if cond.given is not None:   # i2v: the mask and the given frame's latents, after the noisy latents
            x_t = torch.cat([x_t, cond.given.to(x_t.dtype)], dim=1)
        if cond.image is not None:
            return (x_t, t, y, cond.x_mask, cond.image)
        return (x_t, t, y) if cond.x_mask is None else (x_t, t, y, cond.x_mask)

    def frame_mask_index(self) -> int:
        return 3

    def unconditional(self, cond: Conditions, negative=None) -> Conditions:
        """Wan samples its unconditional branch on a negative prompt (its default one unless set);
        without one, the dropped-caption context of training."""
        if negative is None:
            return dataclasses.replace(cond, drop=torch.ones_like(cond.drop))
        y, y_mask = negative
        n = cond.y.shape[0]
        return dataclasses.replace(cond, y=y.expand(n, *y.shape[1:]), y_mask=y_mask.expand(n, -1),
                                   drop=torch.zeros_like(cond.drop))

    # ------------------------------------------------------------------ blocks, parallelism

    def pipeline_stage(self, model, block_ids, *, first: bool, last: bool) -> nn.Module:
        return WanStage(model, block_ids, first=first, last=last)

    def stage_io(self, module, inputs, microbatches: int) -> dict:
        return stage_io(module, inputs, microbatches)

    def stage_latents(self, output, latent_shape, geometry):
        return unpatchify(output, latent_shape, geometry)

    def lora_target(self, name: str) -> str:
        """diffusers' names (``attn1.to_q``, ``attn2.to_out.0``, ``ffn.net.0.proj``, ``ffn.net.2`` inside a
        block; full paths such as ``blocks.3.attn1.to_k`` or ``condition_embedder.time_embedder.linear_1``)
        in Wan's (``self_attn.q``, ``cross_attn.o``, ``ffn.0``, ...), by ``layouts.py``'s name map."""
        full = layouts.wan_name(name)
        if full != name:
            return full
        return layouts.wan_name(f"blocks.0.{name}").removeprefix("blocks.0.")

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        # The text embedding is a column/row pair; the time MLPs and the head run in fp32 on
        # whole weights (they are small), so they stay replicated.
        return TensorParallelPlan(block=_block_plan,
                                  root={"text_embedding.0": "colwise", "text_embedding.2": "rowwise"},
                                  sharded_norms=("norm_q", "norm_k", "norm_k_img"))

    def dynamic_dims(self, args):
        """WanBlock(x [B, L, D], e0 [B, 6, D] or per token [B, L, 6, D], context, rope [L, ...]):
        batch and tokens, the modulation's and the text's batch, RoPE's rows."""
        x, e0, context, rope = args
        return [(x, [0, 1]), (e0, [0, 1] if e0.dim() == 4 else [0]), (context, [0]), (rope, [0])]

    def check_sequence_parallel(self, num_heads: int, *, tp: int, sp: int, ring: int) -> None:
        """sp = Ulysses x ring over all video tokens."""
        check_ulysses_ring(num_heads, tp=tp, sp=sp, ring=ring)

    # ------------------------------------------------------------------ FLOPs, memory

    def forward_flops(self, geometry, frames: int, positions: int, caption_tokens: int) -> FlopCount:
        return flops.grid_flops(geometry, frames * positions)

    def activation_dims(self, geometry: WanGeometry) -> ActivationDims:
        return ActivationDims(geometry.dim, geometry.num_heads, geometry.ffn_dim, geometry.text_dim)

    def activation_profile(self, geometry):
        """TI2V trains with its image frame at time 0: a time, so a modulation, per token."""
        from videodit.models.wan.activations import PER_TOKEN_PROFILE, PROFILE
        return PER_TOKEN_PROFILE if geometry.task == "ti2v" else PROFILE
