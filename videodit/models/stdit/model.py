"""The spatial-temporal diffusion transformer (STDiT3 family, as in Open-Sora 1.2).

Latents [B, C, T, H, W] are cut into 3D patches, giving a token grid [B, T, S, D] with
S = H' * W' tokens per frame. Blocks alternate between spatial attention (the S tokens
of one frame attend to each other) and temporal attention (the T tokens at one spatial
position attend to each other, with rotary positions over time). Every block also
cross-attends to the caption tokens. The diffusion time (plus fps) conditions every block
through one shared adaLN projection (adaLN-single) and a learned per-block table.

Open-Sora 1.2 compatibility is a set of geometry options (``position_embedding="opensora"``,
``null_caption_mask="prompt"``, ``bf16_timesteps``) and the ``height``/``width``/``x_mask``
inputs of :meth:`STDiT.forward`; ``models/stdit/opensora_stdit.py`` converts the weights.

This file is pure: no torch.distributed. Parallelism and activation checkpointing are
applied from outside (``videodit.parallel``). ``save_pretrained`` / ``load_pretrained``
keep a model in a folder: ``config.json`` (its arguments) and ``model.safetensors``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from videodit.errors import UserError
from videodit.models.layers import (CrossAttention, Mlp, RotaryEmbedding, ScalarEmbedder, SelfAttention,
                                    modulate, opensora_sincos_2d, sincos_2d, sinusoidal_embedding)

MODEL_TYPE = "videodit-stdit"
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"


@dataclass(frozen=True)
class DiTGeometry:
    in_channels: int
    caption_channels: int
    caption_length: int
    depth: int
    hidden_size: int
    num_heads: int
    mlp_ratio: float = 4.0
    patch_size: tuple[int, int, int] = (1, 2, 2)
    qk_norm: bool = True
    pos_base_grid: int = 16
    temporal_pos_embed: bool = False
    pooled_caption: bool = False
    # Open-Sora 1.2 behaviour (see the module docstring); the defaults are videodit's own.
    position_embedding: str = "videodit"   # "opensora": the table from the clip's pixel size
    null_caption_mask: str = "full"        # "prompt": the null caption under the prompt's token mask
    bf16_timesteps: bool = False           # round t*1000 to bf16 before embedding, as Open-Sora in bf16

    def __post_init__(self):
        for name, allowed in (("position_embedding", POSITION_EMBEDDINGS), ("null_caption_mask", NULL_CAPTION_MASKS)):
            if getattr(self, name) not in allowed:
                raise UserError(f"{name}={getattr(self, name)!r} is not allowed; choose one of: {', '.join(allowed)}")
        if self.position_embedding == "opensora" and self.hidden_size % 4:   # sin/cos of rows and of columns
            raise UserError(f"position_embedding=opensora needs hidden_size a multiple of 4, not {self.hidden_size}")


POSITION_EMBEDDINGS = ("videodit", "opensora")
NULL_CAPTION_MASKS = ("full", "prompt")


class STBlock(nn.Module):
    """One transformer block; ``temporal`` picks the axis its self-attention runs over."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qk_norm: bool, temporal: bool):
        super().__init__()
        self.temporal = temporal
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = SelfAttention(dim, num_heads, qk_norm, kind="temporal" if temporal else "spatial")
        self.cross_attn = CrossAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        # adaLN-single: the time embedding is projected once for the whole model; each
        # block only learns an offset table for its shift/scale/gate of attention and MLP.
        self.scale_shift_table = nn.Parameter(torch.randn(6, dim) / dim**0.5)

    def forward(self, x, y, y_mask, t_mod, rope):
        """x: [B, T, S, D]; y: [B, L, D]; y_mask: [B, L]; t_mod: [B, 6, D], or [B, T, 6, D] with a
        modulation per frame (``x_mask``: given frames are modulated as at t=0)."""
        b, frames, spatial, dim = x.shape
        if t_mod.dim() == 3:
            t_mod = t_mod[:, None]   # one modulation for every frame
        # The table in t_mod's dtype: Open-Sora runs STDiT all in bf16, so under autocast the fp32
        # table must not lift the modulation, and through the gates the residual stream, to fp32.
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = \
            (self.scale_shift_table.to(t_mod.dtype) + t_mod).unsqueeze(-2).unbind(-3)   # each [B, T or 1, 1, D]

        h = modulate(self.norm1(x), shift_a, scale_a)
        if self.temporal:
            seqs = h.transpose(1, 2).reshape(b * spatial, frames, dim)
            h = self.attn(seqs, rope).view(b, spatial, frames, dim).transpose(1, 2)
        else:
            h = self.attn(h.reshape(b * frames, spatial, dim)).view(b, frames, spatial, dim)
        x = x + gate_a * h

        x = x + self.cross_attn(x.reshape(b, frames * spatial, dim), y, y_mask).view_as(x)
        x = x + gate_m * self.mlp(modulate(self.norm2(x), shift_m, scale_m))
        return x


class CaptionEmbedder(nn.Module):
    """Projects caption tokens to the model width; holds the learned null caption for CFG."""

    def __init__(self, caption_channels: int, length: int, dim: int, null_mask: str = "full"):
        super().__init__()
        self.proj = Mlp(caption_channels, dim, dim)
        self.null_caption = nn.Parameter(torch.randn(length, caption_channels) / caption_channels**0.5)
        self.null_mask = null_mask

    def forward(self, y, y_mask, drop):
        if drop is not None:
            y = torch.where(drop[:, None, None], self.null_caption.to(y.dtype)[None], y)
            if self.null_mask == "full":   # videodit: the null caption uses all of its tokens
                y_mask = y_mask | drop[:, None]
            # "prompt" (Open-Sora): it keeps the prompt's mask, in training and in CFG alike
        # An empty caption would mask every key (NaN attention); let it attend to its padding.
        y_mask = y_mask | ~y_mask.any(dim=1, keepdim=True)
        return self.proj(y), y_mask


class PooledCaption(nn.Module):
    """One global caption vector per sample, added to the timestep embedding.

    The mean of the embedded caption tokens over the valid ones (the null caption's when the
    caption is dropped), through a small MLP. Added to ``cond``, it reaches every block's
    adaLN shift/scale/gate and the final layer, as the pooled text embedding does in
    PixArt/SD3: a caption word can then switch what the whole network does, instead of
    only adding what each token fetches through cross-attention.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, y, y_mask):
        """y: embedded caption tokens [B, L, D]; y_mask: [B, L] bool (at least one True per row)."""
        weights = y_mask.to(y.dtype)[..., None]
        pooled = (y * weights).sum(dim=1) / weights.sum(dim=1)
        return self.mlp(pooled)


class FinalLayer(nn.Module):
    """adaLN-modulated norm and the projection from tokens back to patches."""

    def __init__(self, dim: int, patch_values: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.table = nn.Parameter(torch.randn(2, dim) / dim**0.5)
        self.proj = nn.Linear(dim, patch_values)

    def forward(self, tokens, cond, x_mask=None):
        """tokens: [B, T', S, D]; cond: [B, D] -> [B, T', S, patch_values]. With ``x_mask``
        [B, T'] (True: generated), cond is [B, 2, D]: generated frames', given frames' (t=0)."""
        if x_mask is None:
            return self.proj(modulate(self.norm(tokens), *self._shift_scale(cond)))
        out = modulate(self.norm(tokens), *self._shift_scale(cond[:, 0]))
        # Open-Sora's T2IFinalLayer normalises the *already modulated* tokens for given frames
        # (it reassigns x first); its weights were trained so, hence reproduced here.
        given = modulate(self.norm(out), *self._shift_scale(cond[:, 1]))
        return self.proj(torch.where(x_mask[:, :, None, None], out, given))

    def _shift_scale(self, cond):
        return (self.table[None] + cond[:, None])[:, :, None, None].unbind(1)   # each [B, 1, 1, D]


class STDiT(nn.Module):
    def __init__(self, geometry: DiTGeometry):
        super().__init__()
        g = self.geometry = geometry
        dim = g.hidden_size
        self.patch_embed = nn.Conv3d(g.in_channels, dim, kernel_size=g.patch_size, stride=g.patch_size)
        # t in [0, 1] -> DiT's [0, 1000] range
        self.t_embedder = ScalarEmbedder(dim, scale=1000.0, round_to=torch.bfloat16 if g.bf16_timesteps else None)
        self.fps_embedder = ScalarEmbedder(dim)
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.caption_embedder = CaptionEmbedder(g.caption_channels, g.caption_length, dim, g.null_caption_mask)
        self.caption_pool = PooledCaption(dim) if g.pooled_caption else None
        self.rope = RotaryEmbedding(dim // g.num_heads)
        self.spatial_blocks = nn.ModuleList(
            STBlock(dim, g.num_heads, g.mlp_ratio, g.qk_norm, temporal=False) for _ in range(g.depth))
        self.temporal_blocks = nn.ModuleList(
            STBlock(dim, g.num_heads, g.mlp_ratio, g.qk_norm, temporal=True) for _ in range(g.depth))
        self.final_layer = FinalLayer(dim, g.in_channels * g.patch_size[0] * g.patch_size[1] * g.patch_size[2])
        self._init_weights()

    def _init_weights(self):
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.xavier_uniform_(self.patch_embed.weight.flatten(1))
        for embedder in (self.t_embedder, self.fps_embedder, self.caption_pool):
            if embedder is not None:
                for layer in embedder.mlp[0::2]:
                    nn.init.normal_(layer.weight, std=0.02)
        nn.init.normal_(self.t_block[1].weight, std=0.02)
        # Start as identity blocks with zero output, as DiT does: the caption path and the
        # final projection begin at zero so early training is stable.
        for block in [*self.spatial_blocks, *self.temporal_blocks]:
            nn.init.zeros_(block.cross_attn.proj.weight)
        nn.init.zeros_(self.final_layer.proj.weight)

    @property
    def blocks(self) -> list[STBlock]:
        """Blocks in execution order: spatial 0, temporal 0, spatial 1, temporal 1, ..."""
        return [b for pair in zip(self.spatial_blocks, self.temporal_blocks) for b in pair]

    def forward(self, x, t, y, y_mask, fps=None, drop_caption=None, height=None, width=None, x_mask=None):
        """Predict the rectified-flow velocity.

        x: latents [B, C, T, H, W] (T=1 for images); t: [B] in [0, 1]; y: caption tokens
        [B, L, caption_channels]; y_mask: [B, L] bool; fps: [B] (optional);
        drop_caption: [B] bool, replace those captions by the null caption;
        height, width: the clip's pixel size, a number or [B] (``position_embedding="opensora"``
        needs it; ignored otherwise); x_mask: [B, T'] bool over patched frames, True where
        generated, False where given (conditioning frames, modulated as at t=0).
        """
        if x_mask is not None:
            x_mask = x_mask.to(device=x.device, dtype=torch.bool)
        tokens, y, y_mask, t_mod, cond = self.embed(x, t, y, y_mask, fps, drop_caption, height, width, x_mask)
        rope = self.rope(torch.arange(tokens.shape[1], device=x.device))
        for block in self.blocks:
            tokens = block(tokens, y, y_mask, t_mod, rope)
        return self.unpatchify(self.final_layer(tokens, cond, x_mask), x.shape)

    def embed(self, x, t, y, y_mask, fps=None, drop_caption=None, height=None, width=None, x_mask=None):
        """Everything before the blocks: the token grid [B, T', S, D], the embedded caption
        and its mask, the per-block adaLN input ``t_mod`` [B, 6, D] and ``cond`` [B, D]
        (with ``x_mask``: ``t_mod`` [B, T', 6, D] per frame, ``cond`` [B, 2, D], see FinalLayer)."""
        b, _, frames, height_lat, width_lat = x.shape
        pt, ph, pw = self.geometry.patch_size
        pad = (0, -width_lat % pw, 0, -height_lat % ph, 0, -frames % pt)
        tokens = self.patch_embed(F.pad(x, pad))                      # [B, D, T', H', W']
        _, dim, tp, hp, wp = tokens.shape
        tokens = tokens.flatten(3).transpose(1, 2).transpose(2, 3)    # [B, T', S, D]
        tokens = tokens + self.positions(hp, wp, height, width, b, x.device).to(tokens.dtype)
        if self.geometry.temporal_pos_embed:   # absolute frame index, on top of temporal RoPE
            frame_pos = sinusoidal_embedding(torch.arange(tp, device=x.device), dim)
            tokens = tokens + frame_pos[None, :, None, :].to(tokens.dtype)

        y, y_mask = self.caption_embedder(y, y_mask, drop_caption)
        extra = [self.fps_embedder(fps)] if fps is not None else []
        if self.caption_pool is not None:
            extra.append(self.caption_pool(y, y_mask))

        def condition(times):   # Open-Sora's order of additions: t, then fps
            return sum(extra, self.t_embedder(times))

        cond = condition(t)
        t_mod = self.t_block(cond).view(b, 6, dim)
        if x_mask is not None:
            if tuple(x_mask.shape) != (b, tp):
                raise ValueError(f"x_mask is {tuple(x_mask.shape)}; it needs one flag per patched frame, {(b, tp)}")
            cond_given = condition(torch.zeros_like(t))
            t_mod = torch.where(x_mask[:, :, None, None], t_mod[:, None],
                                self.t_block(cond_given).view(b, 1, 6, dim))
            cond = torch.stack([cond, cond_given], dim=1)
        return tokens, y, y_mask, t_mod, cond

    def positions(self, hp: int, wp: int, height, width, batch: int, device) -> torch.Tensor:
        """The 2D position table of an H' x W' patch grid: [H'*W', D], or [B, 1, H'*W', D] when
        the pixel sizes differ within the batch (Open-Sora would use the first sample's)."""
        g = self.geometry
        if g.position_embedding == "videodit":
            return sincos_2d(hp, wp, g.hidden_size, g.pos_base_grid, device)
        if height is None or width is None:
            raise UserError("position_embedding=opensora needs the clip's pixel size: pass height= and width= "
                            "to STDiT.forward")
        sizes = list(zip(_per_sample(height, batch), _per_sample(width, batch)))
        tables = {size: opensora_sincos_2d(hp, wp, g.hidden_size, *size, device) for size in dict.fromkeys(sizes)}
        if len(tables) == 1:
            return next(iter(tables.values()))
        return torch.stack([tables[size] for size in sizes])[:, None]   # [B, 1, S, D]: every frame

    def unpatchify(self, tokens, latent_shape):
        return unpatchify(tokens, latent_shape, self.geometry)

    # ------------------------------------------------------------------ weights on disk

    def save_pretrained(self, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
        """Write ``config.json`` (the model's arguments only, diffusers' convention) and
        ``model.safetensors`` into ``folder``; ``videodit.models.load_pretrained(folder)`` rebuilds the model."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG_NAME).write_text(json.dumps(geometry_config(self.geometry), indent=1) + "\n")
        tensors = {name: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
                   for name, t in self.state_dict().items()}
        save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        return folder


def _per_sample(size, batch: int) -> list:
    """A pixel size given as a number, or one per sample ([B] tensor or list), as B Python numbers."""
    values = size.tolist() if isinstance(size, torch.Tensor) else size
    values = values if isinstance(values, (list, tuple)) else [values]
    return list(values) * batch if len(values) == 1 else list(values)


def unpatchify(tokens: torch.Tensor, latent_shape, geometry: DiTGeometry) -> torch.Tensor:
    """[B, T', S, pt*ph*pw*C] -> [B, C, T, H, W] of ``latent_shape`` (padding dropped)."""
    frames, height, width = latent_shape[-3:]
    pt, ph, pw = geometry.patch_size
    tp, hp, wp = -(-frames // pt), -(-height // ph), -(-width // pw)
    b, c = tokens.shape[0], geometry.in_channels
    x = tokens.reshape(b, tp, hp, wp, pt, ph, pw, c)
    x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.reshape(b, c, tp * pt, hp * ph, wp * pw)[:, :, :frames, :height, :width]


def geometry_config(geometry: DiTGeometry) -> dict:
    """The ``config.json`` of a model folder: its type and arguments, nothing else."""
    return {"model_type": MODEL_TYPE, **dataclasses.asdict(geometry)}


def geometry_from_config(config: dict) -> DiTGeometry:
    fields = dataclasses.fields(DiTGeometry)
    required = {f.name for f in fields if f.default is dataclasses.MISSING}
    if not isinstance(config, dict) or config.get("model_type") != MODEL_TYPE or not required <= config.keys():
        raise UserError(f"config.json is not a videodit STDiT config (it needs model_type {MODEL_TYPE!r} and "
                        f"{', '.join(sorted(required))}); write it with STDiT.save_pretrained")
    args = {f.name: config[f.name] for f in fields if f.name in config}
    args["patch_size"] = tuple(args.get("patch_size", (1, 2, 2)))
    return DiTGeometry(**args)
