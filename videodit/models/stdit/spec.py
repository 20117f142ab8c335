"""STDiT (Open-Sora 1.2's STDiT3 family) behind the model-family seam (``models/spec.py``)."""

from __future__ import annotations

import dataclasses
import json

import torch
from torch import nn

from videodit.errors import UserError
from videodit.models.flop_count import FlopCount
from videodit.models.spec import ActivationDims, Conditions, ModelSpec, TensorParallelPlan
from videodit.models.stdit import flops, stage
from videodit.models.stdit.opensora_files import opensora_layout, opensora_state
from videodit.models.stdit.opensora_stdit import opensora_config, to_opensora
from videodit.models.stdit.model import (MODEL_TYPE, DiTGeometry, STDiT, geometry_config, geometry_from_config,
                                         unpatchify)


def _attention_plan(prefix: str, inputs: tuple) -> dict:
    return {prefix: ("inputs", inputs), f"{prefix}.q": "colwise", f"{prefix}.k": "colwise",
            f"{prefix}.v": "colwise", f"{prefix}.proj": "rowwise"}


def _block_plan(block: nn.Module) -> dict:
    """Megatron pairs inside every block: q, k, v column-wise (each rank owns heads / tp heads),
    the output projection row-wise; MLP fc1 column-wise, fc2 row-wise."""
    self_inputs = ("replicate", None) if block.temporal else ("replicate",)   # temporal also gets RoPE
    return {**_attention_plan("attn", self_inputs),
            **_attention_plan("cross_attn", ("replicate", "replicate", None)),   # x, caption, caption mask
            "mlp": ("inputs", ("replicate",)), "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _listing(values: list[int]) -> str:
    return ", ".join(map(str, values)) if values else "none"


class StditSpec(ModelSpec):
    family = "stdit"
    model_type = MODEL_TYPE
    geometry_type = DiTGeometry
    sequence_parallel = "stdit_frames"
    released_encoders = (4, 4096, 300)   # Open-Sora 1.2: its VAE, T5-XXL at 300 tokens

    def geometry(self, m, latent_channels: int, caption_channels: int, caption_length: int) -> DiTGeometry:
        return DiTGeometry(in_channels=latent_channels, caption_channels=caption_channels,
                           caption_length=caption_length, depth=m.depth, hidden_size=m.hidden_size,
                           num_heads=m.num_heads, mlp_ratio=m.mlp_ratio, patch_size=tuple(m.patch_size),
                           qk_norm=m.qk_norm, pos_base_grid=m.pos_base_grid,
                           temporal_pos_embed=m.temporal_pos_embed, pooled_caption=m.pooled_caption,
                           position_embedding=m.position_embedding, null_caption_mask=m.null_caption_mask,
                           bf16_timesteps=m.bf16_timesteps)

    def build(self, geometry: DiTGeometry) -> STDiT:
        return STDiT(geometry)

    def configure(self, model: STDiT, m) -> STDiT:
        if m.freeze_caption_embedder:
            model.caption_embedder.requires_grad_(False)
        if m.freeze_null_caption:
            model.caption_embedder.null_caption.requires_grad_(False)
        return model

    def geometry_config(self, geometry: DiTGeometry) -> dict:
        return geometry_config(geometry)

    def geometry_from_config(self, config: dict) -> DiTGeometry:
        return geometry_from_config(config)

    def latent_channels(self, tensors: dict[str, torch.Tensor]) -> int:
        return tensors["patch_embed.weight"].shape[1]

    def caption_channels(self, tensors: dict[str, torch.Tensor]) -> int:
        return tensors["caption_embedder.null_caption"].shape[1]

    vae_kinds = ("opensora-v1.2",)

    def build_vae(self, kind, path, subfolder, *, scaling_factor, micro_batch, temporal_micro_batch, dtype):
        if scaling_factor is not None:
            raise UserError("vae.scaling_factor does not apply to vae.kind=opensora-v1.2 (its latents are "
                            "normalised by the checkpoint's shift and scale); remove it")
        from videodit.models.stdit.opensora_vae import load_opensora_vae   # diffusers, only when asked
        return load_opensora_vae(path, subfolder, micro_batch=micro_batch,
                                 temporal_micro_batch=temporal_micro_batch, dtype=dtype)

    released_name = "Open-Sora STDiT3"
    released_format = "opensora-stdit3"
    released_short = "Open-Sora"
    released_takes_given_frames = True   # Open-Sora 1.2 trained image and video conditioning
    released_fix = "use model.preset=opensora-v1.2 (or its geometry)"
    export_formats = ("opensora",)

    def released_layout(self, path) -> bool:
        return opensora_layout(path) is not None

    def read_released(self, path, ema: bool = False):
        return opensora_state(path, ema=ema)

    # How a run places, masks and rounds (Open-Sora's or videodit's choices), not the network.
    run_fields = ("pos_base_grid", "position_embedding", "null_caption_mask", "bf16_timesteps")
    field_options = {"caption_length": "text.max_length"}

    def released_config(self, geometry, experts: bool = False) -> str | None:
        return "opensora-v1.2-stage3"

    def export_released(self, fmt: str, geometry, tensors):
        """Open-Sora's STDiT3 folder: its names and config; only models whose function STDiT3
        computes convert (``position_embedding=opensora``, ``null_caption_mask=prompt``, ...)."""
        config = json.dumps(opensora_config(geometry), indent=2) + "\n"
        return to_opensora(tensors, geometry), {"config.json": config}, "model.safetensors"

    # ------------------------------------------------------------------ objective

    def model_inputs(self, x_t, t, cond: Conditions) -> tuple:
        """(x_t, t, y, y_mask, fps, drop_caption, height, width[, x_mask]), as ``STDiT.forward``."""
        extra = () if cond.x_mask is None else (cond.x_mask,)
        return (x_t, t, cond.y, cond.y_mask, cond.fps, cond.drop, cond.height, cond.width, *extra)

    def unconditional(self, cond: Conditions, negative=None) -> Conditions:
        """The model's learned null caption (``drop``) stands for the unconditional branch."""
        return dataclasses.replace(cond, drop=torch.ones_like(cond.drop))

    def frame_mask_index(self) -> int:
        return stage.X_MASK

    # ------------------------------------------------------------------ blocks, parallelism

    def pipeline_stage(self, model, block_ids, *, first: bool, last: bool) -> nn.Module:
        return stage.DiTStage(model, block_ids, first=first, last=last)

    def stage_io(self, module, inputs, microbatches: int) -> dict:
        return stage.stage_io(module, inputs, microbatches)

    def stage_latents(self, output, latent_shape, geometry):
        return unpatchify(output, latent_shape, geometry)

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        # The caption MLP is a column/row pair too; the adaLN-single projection (t_block, 6 x hidden
        # outputs) is column-wise with its output gathered. The per-head q/k RMSNorm weights see
        # only their rank's heads: their gradients are partial sums.
        return TensorParallelPlan(block=_block_plan,
                                  root={"caption_embedder.proj.fc1": "colwise", "caption_embedder.proj.fc2": "rowwise",
                                        "t_block.1": "colwise_gathered"},
                                  partial=("q_norm", "k_norm"))

    def block_kind(self, block) -> str:
        return "temporal" if block.temporal else "spatial"

    def dynamic_dims(self, args):
        """STBlock(x [B, T, S, D], y, y_mask, t_mod [B, 6, D] or per frame [B, T, 6, D], rope): batch,
        frames and positions; the caption's and the modulation's batch (and frames); RoPE's rows
        (one per frame)."""
        x, y, y_mask, t_mod, *rest = args
        rope = rest[0] if rest else None
        dims = [(x, [0, 1, 2]), (t_mod, [0, 1] if t_mod.dim() == 4 else [0]), (y, [0]), (y_mask, [0])]
        return dims + ([(t, [0]) for t in rope] if rope is not None else [])

    def num_blocks(self, depth: int) -> int:
        return 2 * depth   # depth counts spatial + temporal pairs, as STDiT3 does

    def check_sequence_parallel(self, num_heads: int, *, tp: int, sp: int, ring: int) -> None:
        if ring != 1:
            raise UserError(f"parallel.sp_ring={ring}: STDiT's sequence parallelism splits frames and positions, "
                            "it has no ring attention; set parallel.sp_ring=1")
        if num_heads % sp:
            # Images and frame counts that do not split fall back to head-parallel attention.
            raise UserError(f"parallel.sp={sp} does not divide model.num_heads={num_heads}; valid: "
                            f"{_listing(_divisors(num_heads))}")
        if num_heads % (sp * tp):
            # Each TP rank holds heads/tp heads; head-parallel SP attention splits those again.
            raise UserError(f"parallel.sp={sp} x parallel.tp={tp} does not divide model.num_heads={num_heads}: "
                            f"with tp={tp} each rank has {num_heads // tp} heads; valid sp: "
                            f"{_listing(_divisors(num_heads // tp))}")

    # ------------------------------------------------------------------ FLOPs, memory

    def forward_flops(self, geometry, frames: int, positions: int, caption_tokens: int) -> FlopCount:
        return flops.grid_flops(geometry, frames, positions, caption_tokens)

    def activation_dims(self, geometry: DiTGeometry) -> ActivationDims:
        return ActivationDims(geometry.hidden_size, geometry.num_heads, int(geometry.hidden_size * geometry.mlp_ratio),
                              geometry.caption_channels)

    def activation_profile(self, geometry):
        from videodit.models.stdit.activations import PROFILE
        return PROFILE

