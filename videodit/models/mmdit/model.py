"""Open-Sora 2.0's MMDiT (hpcaitech/Open-Sora ``opensora/models/mmdit``, a Flux-style DiT), our own code.

Build a tiny one and call it::

    import torch
    from videodit.models.mmdit.model import MMDiT, MMDiTGeometry
    g = MMDiTGeometry(hidden_size=64, num_heads=2, depth=2, depth_single_blocks=2, latent_channels=4,
                      vec_in_dim=16, context_in_dim=32, axes_dim=(8, 12, 12))
    model = MMDiT(g)
    x = torch.randn(2, 4, 3, 8, 6)                  # latents [B, C, T, H, W]; H, W divisible by the patch
    v = model(x, torch.rand(2), torch.randn(2, 5, 32), torch.randn(2, 16),
              torch.randn(2, 5, 3, 8, 6))            # -> velocity [B, C, T, H, W]

Inputs, in order (``MMDiTSpec.model_inputs`` builds them): x_t, t in [0, 1] [B], the T5 caption y
[B, Lt, context_in_dim], the CLIP pooled vector [B, vec_in_dim] (None or [B, 0]: zeros), ``cond``
[B, 1 + C, T, H, W] (the given frames' mask then their masked latents; None: nothing given, the
all-zero condition) and last, only where the caption has one, its mask ``y_mask`` [B, Lt] (True: a
real token; None attends every token, as Open-Sora, which runs T5 and the model without a mask).
Optional inputs come last so that the inputs of a step are all tensors (pipeline stages).

Latents become tokens in (frame, row, column) order, each the (channel, row, column) values of a
1 x p x p patch (Open-Sora's ``pack``). The time (sinusoid of t*1000) and the pooled vector make
``vec``, which modulates every block. 19 double blocks (separate image and text weights, one
joint attention over [text; image]) are followed by 38 single blocks (one stream of [text;
image], attention and MLP in parallel); the final layer reads the image tokens.

Module names are Open-Sora 2.0's checkpoint names, so ``state_dict()`` is its
``Open_Sora_v2.safetensors`` layout. RoPE is rotate-half (Liger's, ``use_liger_rope=True``, the
layout of the released weights): head channels j and j + head_dim/2 turn together; the frequency
table is [frame axis, row axis, column axis] in ``axes_dim``. Text positions are 0 (identity), so
only image tokens are rotated and ``rope`` covers the image tokens alone.

Every block has one call, ``block(img, txt, vec, rope[, text_mask]) -> (img, txt)`` (the caption's
key mask only when the caption has one): FSDP, checkpointing, compile, pipeline stages and
sequence parallelism see ``model.blocks`` (the double blocks, then the single ones) as one
uniform list. Joint attention goes through ``block.backend.joint``; sequence parallelism swaps
the backend. Pure: no torch.distributed.

Precision: Open-Sora's ops in the weights' (or autocast's) dtype, as it runs them; the q/k norms
normalise in fp32 (Liger's llama casting), RoPE rotates in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from videodit.errors import UserError
from videodit.models.layers import SDPA, AttentionBackend, merge_heads, sinusoidal_embedding

TIME_FREQ_DIM = 256        # Open-Sora's timestep_embedding width
TIME_SCALE = 1000.0        # it embeds t * 1000
NORM_EPS = 1e-6


@dataclass(frozen=True)
class MMDiTGeometry:
    hidden_size: int
    num_heads: int
    depth: int                          # double-stream blocks
    depth_single_blocks: int
    latent_channels: int = 16
    mlp_ratio: float = 4.0
    patch_size: tuple[int, int, int] = (1, 2, 2)
    vec_in_dim: int = 768               # CLIP-L pooled
    context_in_dim: int = 4096          # T5-XXL
    axes_dim: tuple[int, int, int] = (16, 56, 56)
    theta: float = 10000.0
    qkv_bias: bool = True
    cond_embed: bool = True
    bf16_timesteps: bool = False        # round t and t*1000 to bf16 first, as Open-Sora trains in bf16

    def __post_init__(self):
        object.__setattr__(self, "patch_size", tuple(int(p) for p in self.patch_size))
        object.__setattr__(self, "axes_dim", tuple(int(a) for a in self.axes_dim))
        pt, ph, pw = self.patch_size
        if pt != 1 or ph != pw:
            raise UserError(f"the MMDiT patches 1 x p x p (temporal 1, square); model.patch_size="
                            f"{list(self.patch_size)} is not: use [1, 2, 2] (Open-Sora 2.0) or [1, 1, 1]")
        if self.hidden_size % self.num_heads:
            raise UserError(f"MMDiT hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                            "fix the model config")
        if len(self.axes_dim) != 3 or sum(self.axes_dim) != self.head_dim or any(a % 2 for a in self.axes_dim):
            raise UserError(f"MMDiT axes_dim={list(self.axes_dim)} must be 3 even sizes (frame, row, column) "
                            f"summing to the head size {self.head_dim}; fix the model config")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def patch(self) -> int:
        """The spatial patch side p."""
        return self.patch_size[1]

    @property
    def in_channels(self) -> int:
        """Values per token (Open-Sora's ``in_channels``: latent channels x p x p)."""
        return self.latent_channels * self.patch ** 2

    @property
    def cond_channels(self) -> int:
        """Values per token of ``cond`` (mask + masked latents, patched): ``cond_in``'s input."""
        return (self.latent_channels + 1) * self.patch ** 2


# ----------------------------------------------------------------------------- positions, time

def rope_table(grid: tuple[int, int, int], g: MMDiTGeometry, device=None) -> torch.Tensor:
    """[f*h*w, head_dim//2, 2] (cos, sin) of the image tokens in (frame, row, column) order.

    Frequency j of each axis is theta^(-2j/axis_dim); the halves of the table are the frame,
    row and column axes in turn (Open-Sora's ``liger_rope``, in fp32 as it computes them)."""
    per_axis = []
    for axis, (length, dim) in enumerate(zip(grid, g.axes_dim)):
        omega = 1.0 / g.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
        angles = torch.arange(length, dtype=torch.float32, device=device)[:, None] * omega[None]
        shape = [1, 1, 1, -1]
        shape[axis] = length
        per_axis.append(angles.view(shape).expand(*grid, -1))
    angles = torch.cat(per_axis, dim=-1).reshape(math.prod(grid), -1)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.float().chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)


class _RotateHalf(torch.autograd.Function):
    """The rotation and its adjoint (the rotation by -angle), as Liger's fused kernel: autograd
    keeps only the table, not the rotated halves."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def rotate_half(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, L, head_dim] by rope [L, head_dim//2, 2]: channel j pairs with j + head_dim/2."""
    cos, sin = rope.float().unbind(-1)
    return _RotateHalf.apply(x, cos, sin)


def joint_rope(rope: torch.Tensor, text_tokens: int) -> torch.Tensor:
    """The image tokens' table with the text's in front: position 0, the identity rotation."""
    identity = torch.zeros(text_tokens, *rope.shape[1:], dtype=rope.dtype, device=rope.device)
    identity[..., 0] = 1
    return torch.cat([identity, rope])


def time_embedding_input(t: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """t [B] in [0, 1] -> [B, 256] [cos, sin] features of t*1000 (Open-Sora's timestep_embedding).
    ``bf16``: as Open-Sora computes it in bf16 training, where t arrives in bf16, t*1000 is a bf16
    product (872, not 870.9, for t = 0.8709) and the features are cast to bf16."""
    if not bf16:
        return sinusoidal_embedding(t * TIME_SCALE, TIME_FREQ_DIM)
    values = t.to(torch.bfloat16) * TIME_SCALE
    return sinusoidal_embedding(values, TIME_FREQ_DIM).to(torch.bfloat16)


# ----------------------------------------------------------------------------- layers

class RMSNorm(nn.Module):
    """Per-head RMSNorm with Liger's "llama" casting: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + NORM_EPS)).to(x.dtype)
        return normed * self.scale


class QKNorm(nn.Module):
    def __init__(self, head_dim: int):
        super().__init__()
        self.query_norm = RMSNorm(head_dim)
        self.key_norm = RMSNorm(head_dim)


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, hidden: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden)
        self.out_layer = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class Modulation(nn.Module):
    """vec [B, D] -> ``count`` tensors [B, 1, D] (shift, scale, gate, ...)."""

    def __init__(self, dim: int, count: int):
        super().__init__()
        self.count = count
        self.lin = nn.Linear(dim, count * dim)

    def forward(self, vec: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.lin(F.silu(vec))[:, None, :].chunk(self.count, dim=-1)


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    """The blocks' LayerNorm: no affine weights, eps 1e-6."""
    return F.layer_norm(x, x.shape[-1:], eps=NORM_EPS)


def heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, L, H*Dh] -> [B, L, H, Dh] (the layout the q/k norms run on)."""
    return x.unflatten(-1, (-1, head_dim))


class StreamAttention(nn.Module):
    """The q/k/v projections, the per-head q/k norms and the output projection of one stream of
    a double block (Open-Sora's ``SelfAttention`` with ``fused_qkv=False``)."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool):
        super().__init__()
        self.head_dim = dim // num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=qkv_bias) for _ in range(3))
        self.norm = QKNorm(self.head_dim)
        self.proj = nn.Linear(dim, dim)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, L, D] -> q, k, v [B, H, L, Dh] (q and k normalised, not rotated)."""
        v = heads(self.v_proj(x), self.head_dim)
        q = self.norm.query_norm(heads(self.q_proj(x), self.head_dim)).to(v.dtype)
        k = self.norm.key_norm(heads(self.k_proj(x), self.head_dim)).to(v.dtype)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def joint_attention(backend: AttentionBackend, q, k, v, text_tokens: int, rope: torch.Tensor,
                    text_mask: torch.Tensor | None) -> torch.Tensor:
    """Attention over [text; image] of q, k, v [B, H, Lt + Li, Dh], q and k rotated by ``rope``
    of the image tokens (text positions are 0: no rotation). Returns [B, Lt + Li, D]."""
    table = joint_rope(rope, text_tokens)
    q, k = rotate_half(q, table), rotate_half(k, table)
    return merge_heads(backend.joint(q, k, v, text_tokens=text_tokens, text_mask=text_mask))


class DoubleStreamBlock(nn.Module):
    """Image and text each with their own modulation, attention projections and MLP; one
    attention over both."""

    def __init__(self, g: MMDiTGeometry):
        super().__init__()
        d = g.hidden_size
        for stream in ("img", "txt"):
            setattr(self, f"{stream}_mod", Modulation(d, 6))
            setattr(self, f"{stream}_attn", StreamAttention(d, g.num_heads, g.qkv_bias))
            setattr(self, f"{stream}_mlp", nn.Sequential(nn.Linear(d, g.mlp_hidden), nn.GELU(approximate="tanh"),
                                                         nn.Linear(g.mlp_hidden, d)))
        self.backend: AttentionBackend = SDPA

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor, rope: torch.Tensor,
                text_mask: torch.Tensor | None = None):
        """img [B, Li, D], txt [B, Lt, D], vec [B, D], rope [Li, Dh/2, 2], text_mask None or [B, Lt]
        bool (True: attended) -> (img, txt)."""
        img_mod, txt_mod = self.img_mod(vec), self.txt_mod(vec)
        img_in = (1 + img_mod[1]) * layer_norm(img) + img_mod[0]
        txt_in = (1 + txt_mod[1]) * layer_norm(txt) + txt_mod[0]
        q, k, v = (torch.cat(pair, dim=2) for pair in zip(self.txt_attn.qkv(txt_in), self.img_attn.qkv(img_in)))
        out = joint_attention(self.backend, q, k, v, txt.shape[1], rope, text_mask)
        txt_out, img_out = out[:, :txt.shape[1]], out[:, txt.shape[1]:]
        img = self._stream_rest(img, img_out, img_mod, self.img_attn, self.img_mlp)
        txt = self._stream_rest(txt, txt_out, txt_mod, self.txt_attn, self.txt_mlp)
        return img, txt

    @staticmethod
    def _stream_rest(x, attn_out, mod, attn: StreamAttention, mlp: nn.Sequential) -> torch.Tensor:
        _, _, gate1, shift2, scale2, gate2 = mod
        x = x + gate1 * attn.proj(attn_out)
        return x + gate2 * mlp((1 + scale2) * layer_norm(x) + shift2)


class SingleStreamBlock(nn.Module):
    """One stream over [text; image]: q, k and (v | MLP input) from the modulated input, attention
    and the GELU MLP in parallel, one output projection ``linear2`` over both."""

    def __init__(self, g: MMDiTGeometry):
        super().__init__()
        d = self.hidden_size = g.hidden_size
        self.head_dim = g.head_dim
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.v_mlp = nn.Linear(d, d + g.mlp_hidden)
        self.linear2 = nn.Linear(d + g.mlp_hidden, d)
        self.norm = QKNorm(g.head_dim)
        self.modulation = Modulation(d, 3)
        self.backend: AttentionBackend = SDPA

    def forward(self, img: torch.Tensor, txt: torch.Tensor, vec: torch.Tensor, rope: torch.Tensor,
                text_mask: torch.Tensor | None = None):
        """Same call as :class:`DoubleStreamBlock`; [txt; img] joined here and split at the end."""
        text_tokens = txt.shape[1]
        x = torch.cat([txt, img], dim=1)
        shift, scale, gate = self.modulation(vec)
        x_in = (1 + scale) * layer_norm(x) + shift
        q, k, v_mlp = self.q_proj(x_in), self.k_proj(x_in), self.v_mlp(x_in)
        # v is as wide as q: this rank's heads under tensor parallelism, which splits v_mlp per part
        v, mlp = v_mlp.split([q.shape[-1], v_mlp.shape[-1] - q.shape[-1]], dim=-1)
        v = heads(v, self.head_dim)
        q = self.norm.query_norm(heads(q, self.head_dim)).to(v.dtype)
        k = self.norm.key_norm(heads(k, self.head_dim)).to(v.dtype)
        q, k, v = (u.transpose(1, 2) for u in (q, k, v))
        attn = joint_attention(self.backend, q, k, v, text_tokens, rope, text_mask)
        x = x + gate * self.linear2(torch.cat([attn, F.gelu(mlp, approximate="tanh")], dim=-1))
        return x[:, text_tokens:], x[:, :text_tokens]


class LastLayer(nn.Module):
    def __init__(self, g: MMDiTGeometry):
        super().__init__()
        self.linear = nn.Linear(g.hidden_size, g.in_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(g.hidden_size, 2 * g.hidden_size))

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(vec)[:, None, :].chunk(2, dim=-1)
        return self.linear((1 + scale) * layer_norm(x) + shift)


# ----------------------------------------------------------------------------- the model

class MMDiT(nn.Module):
    def __init__(self, geometry: MMDiTGeometry):
        super().__init__()
        g = self.geometry = geometry
        d = g.hidden_size
        self.img_in = nn.Linear(g.in_channels, d)
        self.time_in = MLPEmbedder(TIME_FREQ_DIM, d)
        self.vector_in = MLPEmbedder(g.vec_in_dim, d)
        if g.cond_embed:
            self.cond_in = nn.Linear(g.cond_channels, d)
        self.txt_in = nn.Linear(g.context_in_dim, d)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(g) for _ in range(g.depth))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(g) for _ in range(g.depth_single_blocks))
        self.final_layer = LastLayer(g)
        self.init_weights()

    @property
    def blocks(self) -> list[nn.Module]:
        """The double blocks then the single blocks: one list of blocks with one call."""
        return [*self.double_blocks, *self.single_blocks]

    def init_weights(self):
        """Open-Sora 2.0 starts from Flux's weights; from scratch: xavier linears, zero biases, and
        zero ``cond_in`` (as Open-Sora), so given frames start as no condition at all."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        if self.geometry.cond_embed:
            nn.init.zeros_(self.cond_in.weight)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, pooled: torch.Tensor | None = None,
                cond: torch.Tensor | None = None, y_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The velocity [B, C, T, H, W] of latents x at times t; see the module docstring."""
        img, txt, vec, rope = self.embed(x, t, y, pooled, cond)
        mask = () if y_mask is None else (y_mask.bool(),)   # the four-argument call when unmasked
        for block in self.blocks:
            img, txt = block(img, txt, vec, rope, *mask)
        return self.unpatchify(self.final_layer(img, vec), x.shape).to(x.dtype)

    def embed(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, pooled: torch.Tensor | None = None,
              cond: torch.Tensor | None = None):
        """Everything before the blocks: img [B, Li, D], txt [B, Lt, D], vec [B, D], rope [Li, Dh/2, 2]."""
        g = self.geometry
        grid = self.token_grid(x.shape)
        img = self.img_in(pack(x, g.patch).to(self.img_in.weight.dtype))
        if g.cond_embed:
            if cond is None:   # no frame given: an all-zero condition, whose embedding is the bias
                img = img + self.cond_in.bias.to(img.dtype)   # an fp32 bias would lift the stream to fp32
            else:
                if cond.shape[1] != g.latent_channels + 1 or cond.shape[2:] != x.shape[2:]:
                    raise UserError(f"cond has shape {list(cond.shape)}; the MMDiT takes the given frames' mask and "
                                    f"latents, [B, {g.latent_channels + 1}, {', '.join(map(str, x.shape[2:]))}]")
                img = img + self.cond_in(pack(cond, g.patch).to(self.cond_in.weight.dtype))
        vec = self.time_in(time_embedding_input(t, g.bf16_timesteps).to(self.time_in.in_layer.weight.dtype))
        if pooled is None or pooled.shape[-1] == 0:   # none (an encoder without one): the zero vector
            pooled = x.new_zeros(x.shape[0], g.vec_in_dim)
        vec = vec + self.vector_in(pooled.to(self.vector_in.in_layer.weight.dtype))
        txt = self.txt_in(y.to(self.txt_in.weight.dtype))
        return img, txt, vec, rope_table(grid, g, x.device)

    def token_grid(self, latent_shape) -> tuple[int, int, int]:
        return token_grid(latent_shape, self.geometry)

    def unpatchify(self, tokens: torch.Tensor, latent_shape) -> torch.Tensor:
        return unpatchify(tokens, latent_shape, self.geometry)


def token_grid(latent_shape, g: MMDiTGeometry) -> tuple[int, int, int]:
    frames, height, width = latent_shape[-3:]
    if height % g.patch or width % g.patch:
        raise UserError(f"latent grid {height}x{width} is not divisible by the MMDiT's {g.patch}x{g.patch} patch; "
                        f"choose a video size whose latents are")
    return frames, height // g.patch, width // g.patch


def pack(x: torch.Tensor, p: int) -> torch.Tensor:
    """[B, C, T, H, W] -> [B, T*(H/p)*(W/p), C*p*p] (channel, row, column within a patch)."""
    b, c, t, h, w = x.shape
    x = x.reshape(b, c, t, h // p, p, w // p, p).permute(0, 2, 3, 5, 1, 4, 6)
    return x.reshape(b, t * (h // p) * (w // p), c * p * p)


def unpatchify(tokens: torch.Tensor, latent_shape, g: MMDiTGeometry) -> torch.Tensor:
    """[B, T*(H/p)*(W/p), C*p*p] -> [B, C, T, H, W] (the inverse of :func:`pack`)."""
    t, h, w = token_grid(latent_shape, g)
    p, b = g.patch, tokens.shape[0]
    x = tokens.reshape(b, t, h, w, -1, p, p).permute(0, 4, 1, 2, 5, 3, 6)
    return x.reshape(b, -1, t, h * p, w * p)
