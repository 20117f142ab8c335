"""Wan's DiT (Wan-AI/Wan2.1 and Wan2.2, ``wan/modules/model.py``), op for op in fp32.

Latents [B, C, T, H, W] become tokens with a Conv3d patchify, in (frame, row, column) order.
Every block runs full self-attention over all tokens with 3D RoPE, cross-attention to the text
tokens, and a GELU-tanh MLP; the diffusion time modulates the self-attention and the MLP of every
block (a shared projection of the time embedding plus a per-block ``modulation`` table).

The variants (``WanGeometry.task``, Wan's ``model_type``), one network:

- ``t2v``: text to video (Wan 2.1 T2V, each expert of Wan 2.2 T2V-A14B).
- ``i2v``: the input is the noisy latent, a 4-channel mask of the given frames and their latents,
  concatenated on channels (36 = 16 + 4 + 16; the caller concatenates). Wan 2.1's I2V-14B also
  embeds CLIP image features (``image_dim``: ``img_emb``) as 257 extra context tokens, which every
  cross-attention reads with its own ``k_img``/``v_img``; Wan 2.2's I2V-A14B experts do not.
- ``ti2v``: Wan 2.2 TI2V-5B, text or image to video in one model: the given image overwrites latent
  frame 0 and its tokens get time 0, so ``t`` comes per token ([B, L]); any model takes that.

Parameter names are Wan's original ones, so ``state_dict()`` is the Wan checkpoint layout;
``layouts.py`` converts to and from diffusers' ``WanTransformer3DModel`` names.

Precision follows Wan under autocast: the time embedding, the modulation, the norms, RoPE and the
head run in fp32 (the sinusoid and the RoPE angles in fp64, as Wan computes them); the linear
layers take their input in their weight's dtype, so autocast or bf16 weights both work. The
residual stream stays in the dtype :meth:`WanDiT.embed` gives it: fp32, as in Wan.

Pure: no torch.distributed. Sequence parallelism slices the block inputs and ``rope`` along the
token axis and swaps each attention's ``backend``; tensor parallelism sets
``RMSNormAcrossHeads.reduce_mean_square``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from videodit.errors import UserError
from videodit.models.layers import SDPA, AttentionBackend, merge_heads, split_heads


MODEL_TYPES = ("t2v", "i2v", "ti2v")
I2V_MASK_CHANNELS = 4    # the given-frame mask, one channel per frame of a 4-frame latent step
CLIP_TOKENS = 257        # Wan 2.1 I2V's CLIP ViT-H/14 penultimate-layer features per image


@dataclass(frozen=True)
class WanGeometry:
    dim: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    in_channels: int = 16
    out_channels: int = 16
    freq_dim: int = 256
    text_dim: int = 4096
    text_len: int = 512
    patch_size: tuple[int, int, int] = (1, 2, 2)
    qk_norm: bool = True
    cross_attn_norm: bool = True
    eps: float = 1e-6
    task: str = "t2v"                    # t2v | i2v | ti2v (Wan config.json's model_type)
    image_dim: int | None = None         # CLIP feature width embedded by img_emb (Wan 2.1 I2V: 1280)

    def __post_init__(self):
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        if self.task not in MODEL_TYPES:
            raise UserError(f"Wan model_type (task) {self.task!r} is not one videodit trains; choose one of "
                            f"{', '.join(MODEL_TYPES)}")
        if self.task == "i2v" and self.in_channels != 2 * self.out_channels + I2V_MASK_CHANNELS:
            raise UserError(f"a Wan i2v model takes the latent, a {I2V_MASK_CHANNELS}-channel mask and the given "
                            f"frames' latents: in_channels must be {2 * self.out_channels + I2V_MASK_CHANNELS}, "
                            f"not {self.in_channels}")
        if self.image_dim is not None and self.task != "i2v":
            raise UserError(f"image_dim (CLIP features) belongs to Wan's i2v models, not {self.task!r}")
        if self.dim % self.num_heads or self.head_dim % 2:
            raise UserError(f"Wan needs dim divisible by num_heads into heads of an even size; dim={self.dim} "
                            f"and num_heads={self.num_heads} do not: fix the model config")
        if self.freq_dim % 2:
            raise UserError(f"Wan's freq_dim must be even, not {self.freq_dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def image_tokens(self) -> int:
        """Context tokens of the image (CLIP ViT-H/14: 256 patches + the class token), or 0."""
        return CLIP_TOKENS if self.image_dim else 0

    @property
    def rope_split(self) -> tuple[int, int, int]:
        """Channels of each head rotated by frame, row and column position (Wan's split)."""
        d = self.head_dim
        return d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)


# ----------------------------------------------------------------------------- position and time

def rope_table(grid: tuple[int, int, int], geometry: WanGeometry, device=None) -> torch.Tensor:
    """[f*h*w, head_dim//2, 2] (cos, sin) for the token grid, tokens in (f, h, w) order.

    Interleaved pairs (channels 2i, 2i+1 rotate together); the first pairs turn with the frame
    index, the next with the row, the last with the column, each axis with its own frequencies
    theta^(-2j/axis_channels). Angles in fp64 as Wan computes them; stored in fp32.
    """
    f, h, w = grid
    per_axis = []
    for axis, (length, channels) in enumerate(zip(grid, geometry.rope_split)):
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, channels, 2, dtype=torch.float64, device=device) / channels)
        angles = torch.arange(length, dtype=torch.float64, device=device)[:, None] * inv_freq[None]
        shape = [1, 1, 1, -1]
        shape[axis] = length
        per_axis.append(angles.view(shape).expand(f, h, w, -1))
    angles = torch.cat(per_axis, dim=-1).reshape(f * h * w, -1)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, L, head_dim] by rope [L, head_dim//2, 2], in fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs.unbind(-1)
    cos, sin = rope.float().unbind(-1)
    out = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


def time_sinusoid(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    """Timesteps in [0, 1000] of any shape [...] -> [..., dim] [cos, sin] features, computed in fp64
    (as Wan)."""
    half = dim // 2
    position = timesteps.double()
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=position.device) / half)
    angles = position[..., None] * freqs
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def fp32_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` in fp32 whatever the weights' dtype: Wan runs these under autocast(fp32)."""
    with torch.autocast(x.device.type, enabled=False):
        bias = None if layer.bias is None else layer.bias.float()
        return F.linear(x.float(), layer.weight.float(), bias)


def to_weight_dtype(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    return x.to(next(layer.parameters()).dtype)


# ----------------------------------------------------------------------------- norms

class RMSNormAcrossHeads(nn.Module):
    """RMSNorm over the whole q or k projection (all heads at once), in fp32 (Wan's WanRMSNorm).

    ``reduce_mean_square`` sees the per-token mean of squares [..., 1] before the rsqrt: identity
    here; tensor parallelism, where each rank holds dim/tp channels, sets it to an all-reduce
    average so the norm still spans all heads."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.reduce_mean_square = _identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        mean_square = self.reduce_mean_square(x32.pow(2).mean(dim=-1, keepdim=True))
        return (x32 * torch.rsqrt(mean_square + self.eps) * self.weight.float()).to(x.dtype)


def _identity(x):
    return x


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 and returned in the input's dtype (Wan's WanLayerNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


# ----------------------------------------------------------------------------- attention

class WanAttention(nn.Module):
    """Self- (``kind="self"``, with RoPE) or cross-attention (``kind="cross"``, to the text).

    Separate q/k/v projections (Wan's own layout) so tensor parallelism can shard them by heads.
    With ``text_len`` (Wan 2.1 I2V's cross-attention), the context is image tokens followed by
    ``text_len`` text tokens: the queries attend to the image's through ``k_img``/``v_img``
    separately and the two results are summed before ``o``. The image's token count is whatever
    the encoder gives (257 for CLIP ViT-H/14 at 224 px; Wan hard-codes 257, diffusers does not)."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool, eps: float, kind: str, text_len: int = 0):
        super().__init__()
        self.head_dim = dim // num_heads
        self.kind = kind
        self.text_len = text_len
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = RMSNormAcrossHeads(dim, eps) if qk_norm else nn.Identity()
        self.norm_k = RMSNormAcrossHeads(dim, eps) if qk_norm else nn.Identity()
        if text_len:
            self.k_img, self.v_img = nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.norm_k_img = RMSNormAcrossHeads(dim, eps) if qk_norm else nn.Identity()
        self.backend: AttentionBackend = SDPA

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                rope: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, L, D]; context: [B, L_image + L_text, D] for cross-attention (None: self-attention)."""
        x = to_weight_dtype(x, self.q)
        source = x if context is None else to_weight_dtype(context, self.k)
        if self.text_len:
            image, source = source[:, :-self.text_len], source[:, -self.text_len:]
        q = split_heads(self.norm_q(self.q(x)), self.head_dim)
        k = split_heads(self.norm_k(self.k(source)), self.head_dim)
        v = split_heads(self.v(source), self.head_dim)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.backend(q, k, v, kind=self.kind)
        if self.text_len:
            k_img = split_heads(self.norm_k_img(self.k_img(image)), self.head_dim)
            out = out + self.backend(q, k_img, split_heads(self.v_img(image), self.head_dim), kind=self.kind)
        return self.o(to_weight_dtype(merge_heads(out), self.o))   # not .weight: fp8 storage would dequantise it


# ----------------------------------------------------------------------------- blocks

def split_modulation(table: torch.Tensor, e: torch.Tensor) -> list[torch.Tensor]:
    """table [1, n, D] + e [B, n, D] or per token [B, L, n, D], in fp32 -> n tensors [B, 1 or L, D]
    that broadcast over the tokens."""
    mod = table.float() + e.float()
    if mod.dim() == 3:
        mod = mod.unsqueeze(1)
    return list(mod.unbind(2))


class WanBlock(nn.Module):
    def __init__(self, g: WanGeometry):
        super().__init__()
        self.norm1 = FP32LayerNorm(g.dim, g.eps, elementwise_affine=False)
        self.self_attn = WanAttention(g.dim, g.num_heads, g.qk_norm, g.eps, kind="self")
        # Wan's names: norm3 is the (affine) norm before cross-attention, norm2 the one before the MLP.
        self.norm3 = FP32LayerNorm(g.dim, g.eps, elementwise_affine=True) if g.cross_attn_norm else nn.Identity()
        self.cross_attn = WanAttention(g.dim, g.num_heads, g.qk_norm, g.eps, kind="cross",
                                       text_len=g.text_len if g.image_dim else 0)
        self.norm2 = FP32LayerNorm(g.dim, g.eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(g.dim, g.ffn_dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(g.ffn_dim, g.dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, g.dim) / g.dim**0.5)

    def forward(self, x: torch.Tensor, e0: torch.Tensor, context: torch.Tensor, rope: torch.Tensor):
        """x: [B, L, D]; e0: [B, 6, D] or per token [B, L, 6, D]; context: [B, L_image + L_text, D];
        rope: [L, head_dim//2, 2]."""
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = split_modulation(self.modulation, e0)
        h = self.norm1(x).float() * (1 + scale_a) + shift_a
        x = (x.float() + self.self_attn(h, rope=rope).float() * gate_a).to(x.dtype)
        x = x + self.cross_attn(self.norm3(x), context).to(x.dtype)
        h = self.norm2(x).float() * (1 + scale_f) + shift_f
        y = self.ffn(to_weight_dtype(h, self.ffn))
        return (x.float() + y.float() * gate_f).to(x.dtype)


class WanHead(nn.Module):
    """Modulated norm and the projection back to patches, all in fp32 (as Wan's Head)."""

    def __init__(self, g: WanGeometry):
        super().__init__()
        self.norm = FP32LayerNorm(g.dim, g.eps, elementwise_affine=False)
        self.head = nn.Linear(g.dim, math.prod(g.patch_size) * g.out_channels)
        self.modulation = nn.Parameter(torch.randn(1, 2, g.dim) / g.dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """x: [B, L, D]; e: [B, D] (or [B, L, D] per token) -> [B, L, prod(patch) * C_out] fp32."""
        shift, scale = split_modulation(self.modulation, e.unsqueeze(-2))
        return fp32_linear(self.head, self.norm(x).float() * (1 + scale) + shift)


class ImageEmbedding(nn.Module):
    """CLIP features [B, 257, image_dim] -> context tokens [B, 257, dim] (Wan's ``MLPProj``)."""

    def __init__(self, image_dim: int, dim: int):
        super().__init__()
        self.proj = nn.Sequential(FP32LayerNorm(image_dim), nn.Linear(image_dim, image_dim), nn.GELU(),
                                  nn.Linear(image_dim, dim), FP32LayerNorm(dim))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.proj(to_weight_dtype(image, self.proj[1]))


class WanDiT(nn.Module):
    def __init__(self, geometry: WanGeometry):
        super().__init__()
        g = self.geometry = geometry
        self.patch_embedding = nn.Conv3d(g.in_channels, g.dim, kernel_size=g.patch_size, stride=g.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(g.text_dim, g.dim), nn.GELU(approximate="tanh"),
                                            nn.Linear(g.dim, g.dim))
        self.time_embedding = nn.Sequential(nn.Linear(g.freq_dim, g.dim), nn.SiLU(), nn.Linear(g.dim, g.dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(g.dim, 6 * g.dim))
        if g.image_dim:
            self.img_emb = ImageEmbedding(g.image_dim, g.dim)
        self.blocks = nn.ModuleList(WanBlock(g) for _ in range(g.num_layers))
        self.head = WanHead(g)
        self.init_weights()

    def init_weights(self):
        """Wan's initialisation: xavier linears, small embedders, a zero output projection."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.xavier_uniform_(self.patch_embedding.weight.flatten(1))
        for layer in (*self.text_embedding[0::2], *self.time_embedding[0::2]):
            nn.init.normal_(layer.weight, std=0.02)
        nn.init.zeros_(self.head.head.weight)

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, x_mask: torch.Tensor | None = None,
                image: torch.Tensor | None = None) -> torch.Tensor:
        """The flow-matching velocity (noise - data) of latents x [B, C_in, T, H, W] at times t in
        [0, 1] ([B], or per token [B, L]), given text embeddings context [B, L <= text_len, text_dim]
        (zero-padded captions); ``x_mask`` bool [B, T'] over patched frames, False where a frame is
        given (its tokens get time 0: TI2V's image, or any frame conditioning); for a model with
        ``image_dim``, CLIP image features image [B, 257, image_dim]. Returns [B, C_out, T, H, W]."""
        tokens, e0, e, context, rope = self.embed(x, t, context, x_mask, image)
        for block in self.blocks:
            tokens = block(tokens, e0, context, rope)
        return self.unpatchify(self.head(tokens, e), x.shape).to(x.dtype)

    def embed(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, x_mask: torch.Tensor | None = None,
              image: torch.Tensor | None = None):
        """Everything before the blocks: tokens [B, L, D] (fp32), the block modulation input e0
        [B, 6, D] and the head's e [B, D] (both fp32; [B, L, 6, D] and [B, L, D] for per-token t),
        the embedded context [B, image_tokens + text_len, D] and rope [L, head_dim//2, 2]."""
        g = self.geometry
        grid = self.token_grid(x.shape)
        t = token_times(t, x_mask, grid)
        tokens = self.patch_embedding(to_weight_dtype(x, self.patch_embedding))
        # Contiguous: a transposed view would keep the whole residual stream strided, and every
        # LayerNorm would copy it (benchmarks/wan_step.py measured 4% of a CPU step).
        tokens = tokens.flatten(2).transpose(1, 2).float().contiguous()
        # Wan is fed t*1000 in the caller's fp32 and widens it to fp64 for the sinusoid.
        e = self.time_embedding_fp32(time_sinusoid(t.float() * 1000, g.freq_dim))
        e0 = fp32_linear(self.time_projection[1], F.silu(e)).unflatten(-1, (6, g.dim))
        context = self.text_embedding(to_weight_dtype(self.pad_context(context), self.text_embedding))
        if g.image_dim:
            if image is None:
                raise UserError("this Wan i2v model embeds CLIP image features; give the image encoder's output")
            context = torch.cat([self.img_emb(image).to(context.dtype), context], dim=1)
        return tokens, e0, e, context, rope_table(grid, g, x.device)

    def time_embedding_fp32(self, features: torch.Tensor) -> torch.Tensor:
        return fp32_linear(self.time_embedding[2], F.silu(fp32_linear(self.time_embedding[0], features)))

    def pad_context(self, context: torch.Tensor) -> torch.Tensor:
        """Zero-pad the captions to text_len tokens, as Wan does: the pad positions are attended
        (no mask), as text_embedding(0) tokens."""
        text_len = self.geometry.text_len
        if context.shape[1] > text_len:
            raise UserError(f"the text embeddings have {context.shape[1]} tokens; Wan takes at most "
                            f"text_len={text_len}: set the text encoder's max length to {text_len}")
        return F.pad(context, (0, 0, 0, text_len - context.shape[1]))

    def token_grid(self, latent_shape) -> tuple[int, int, int]:
        return token_grid(latent_shape, self.geometry)

    def unpatchify(self, tokens: torch.Tensor, latent_shape) -> torch.Tensor:
        return unpatchify(tokens, latent_shape, self.geometry)


def token_times(t: torch.Tensor, x_mask: torch.Tensor | None, grid: tuple[int, int, int]) -> torch.Tensor:
    """t [B] or per token [B, L]; with ``x_mask`` [B, frames of the grid], per token, 0 on the tokens
    of given frames (as Wan 2.2's TI2V builds its ``temp_ts``)."""
    tokens = math.prod(grid)
    if t.dim() == 2 and t.shape[1] != tokens:
        raise UserError(f"per-token times t have {t.shape[1]} entries for {tokens} tokens")
    if x_mask is None:
        return t
    if x_mask.shape[-1] != grid[0]:
        raise UserError(f"x_mask covers {x_mask.shape[-1]} frames; the latents have {grid[0]} patched frames")
    per_token = x_mask.to(t.dtype)[:, :, None].expand(-1, -1, tokens // grid[0]).flatten(1)
    return (t[:, None] if t.dim() == 1 else t) * per_token


def token_grid(latent_shape, geometry: WanGeometry) -> tuple[int, int, int]:
    """(frames, rows, columns) of patches of latents of ``latent_shape`` [..., T, H, W]."""
    sizes = tuple(latent_shape[-3:])
    if any(s % p for s, p in zip(sizes, geometry.patch_size)):
        raise UserError(f"latent grid {sizes} (frames, height, width) is not divisible by Wan's patch "
                        f"{geometry.patch_size}; choose a video size that is")
    return tuple(s // p for s, p in zip(sizes, geometry.patch_size))


def unpatchify(tokens: torch.Tensor, latent_shape, geometry: WanGeometry) -> torch.Tensor:
    """[B, f*h*w, pt*ph*pw*C] (channels last within a patch, as Wan) -> [B, C, T, H, W]."""
    f, h, w = token_grid(latent_shape, geometry)
    pt, ph, pw = geometry.patch_size
    x = tokens.reshape(tokens.shape[0], f, h, w, pt, ph, pw, geometry.out_channels)
    x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.reshape(tokens.shape[0], -1, f * pt, h * ph, w * pw)
