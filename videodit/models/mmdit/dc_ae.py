"""Open-Sora 2.0's Video DC-AE (``dc-ae-f32t4c128``) as a pure-torch network.

The module names are the checkpoint's (``F32T4C128_AE.safetensors``, Open-Sora's
``opensora/models/dc_ae``), so its tensors load strictly; the code is videodit's own. The
network: 6 stages of 3-D convolutions (widths 128..1024), the first three of residual conv
blocks, the last three of EfficientViT blocks (multi-scale ReLU linear attention + a gated
depthwise MLP); every stage but the last halves H and W (stages 3 and 4 also halve time) with a
strided conv plus a parameter-free pixel-unshuffle-and-average shortcut; the decoder mirrors it
with nearest upsampling + conv and a channel-duplicating pixel-shuffle shortcut. Padding is
zeros in all three dims (not causal). No posterior: the encoder's output is the latent.

Shapes: [B, 3, T, H, W] -> [B, 128, T/4, H/32, W/32]. A clip of one frame runs in "image mode"
(no temporal down- or upsampling); a latent of one frame decodes to one frame.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

RES = "ResBlock"
EVIT = "EViTS5_GLU"   # EfficientViT block: LiteMLA with one extra 5x5x5 scale, GLU MBConv
LINEAR_ATTENTION_DIM = 32   # channels per head of the linear attention
MLP_EXPAND = 4


@dataclass(frozen=True)
class DCAEConfig:
    """The architecture; the defaults are ``dc-ae-f32t4c128``'s (Open-Sora's ``dc_ae_f32``)."""
    latent_channels: int = 128
    encoder_widths: tuple[int, ...] = (128, 256, 512, 512, 1024, 1024)
    encoder_depths: tuple[int, ...] = (2, 2, 2, 3, 3, 3)
    decoder_widths: tuple[int, ...] = (128, 256, 512, 512, 1024, 1024)
    decoder_depths: tuple[int, ...] = (3, 3, 3, 3, 3, 3)
    block_types: tuple[str, ...] = (RES, RES, RES, EVIT, EVIT, EVIT)
    # Which stage transitions also halve (double) time; the encoder's and decoder's are equal.
    temporal: tuple[bool, ...] = (False, False, False, True, True, False)
    in_channels: int = 3

    @property
    def spatial_compression(self) -> int:
        return 2 ** (len(self.encoder_widths) - 1)

    @property
    def temporal_compression(self) -> int:
        return 2 ** sum(self.temporal[:-1])


# --------------------------------------------------------------------------- layers


class RMSNorm3d(nn.Module):
    """RMS over channels (in fp32, cast back), then a per-channel scale and bias."""

    def __init__(self, channels: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: Tensor) -> Tensor:
        x = (x / torch.sqrt(x.float().square().mean(dim=1, keepdim=True) + self.eps)).to(x.dtype)
        shape = (1, -1, 1, 1, 1)
        return x * self.weight.view(shape) + self.bias.view(shape)


class Conv(nn.Module):
    """A 3-D conv with "same" zero padding in T, H and W, then an optional norm and activation
    (the checkpoint's ``ConvLayer``: tensors ``conv.*`` and ``norm.*``)."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride=1, groups: int = 1, bias: bool = True,
                 norm: bool = False, act: str | None = None):
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=bias)
        self.norm = RMSNorm3d(cout) if norm else None
        self.act = {"silu": F.silu, "relu": F.relu, None: None}[act]

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(x)
        if self.norm is not None:
            x = self.norm(x)
        return self.act(x) if self.act is not None else x


class Ops(nn.Module):
    """An ordered list of layers (``op_list.{i}``)."""

    def __init__(self, ops: list[nn.Module]):
        super().__init__()
        self.op_list = nn.ModuleList(ops)

    def forward(self, x: Tensor) -> Tensor:
        for op in self.op_list:
            x = op(x)
        return x


class Residual(nn.Module):
    """``main(x) + shortcut(x)``; the shortcut has no weights (identity when None)."""

    def __init__(self, main: nn.Module, shortcut=None):
        super().__init__()
        self.main = main
        self.shortcut = shortcut

    def forward(self, x: Tensor) -> Tensor:
        return self.main(x) + (x if self.shortcut is None else self.shortcut(x))


def _halves_time(temporal: bool, x: Tensor) -> bool:
    # A single frame (an image, or a latent of one frame) never changes length in time.
    return temporal and x.shape[2] != 1


def space_to_channels(x: Tensor, r: int, temporal: bool) -> Tensor:
    """[B, C, T, H, W] -> [B, C*r^k, T', H/r, W/r], each channel followed by its (t, h, w)
    sub-positions (k = 3 with time, T' = T/r; k = 2 per frame)."""
    b, c, t, h, w = x.shape
    if temporal:
        if t % r:
            raise ValueError(f"the DC-AE halves time here, but the clip has {t} frames at this stage")
        x = x.view(b, c, t // r, r, h // r, r, w // r, r).permute(0, 1, 3, 5, 7, 2, 4, 6)
        return x.reshape(b, c * r ** 3, t // r, h // r, w // r)
    x = x.view(b, c, t, h // r, r, w // r, r).permute(0, 1, 4, 6, 2, 3, 5)
    return x.reshape(b, c * r * r, t, h // r, w // r)


def channels_to_space(x: Tensor, r: int, temporal: bool) -> Tensor:
    """The inverse of :func:`space_to_channels`."""
    b, c, t, h, w = x.shape
    if temporal:
        x = x.view(b, c // r ** 3, r, r, r, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
        return x.reshape(b, c // r ** 3, t * r, h * r, w * r)
    x = x.view(b, c // (r * r), r, r, t, h, w).permute(0, 1, 4, 5, 2, 6, 3)
    return x.reshape(b, c // (r * r), t, h * r, w * r)


class AveragingShortcut(nn.Module):
    """Downsample without weights: pixel-unshuffle, then average groups of adjacent channels."""

    def __init__(self, cin: int, cout: int, factor: int, temporal: bool = False):
        super().__init__()
        self.cin, self.cout, self.factor, self.temporal = cin, cout, factor, temporal

    def forward(self, x: Tensor) -> Tensor:
        x = space_to_channels(x, self.factor, _halves_time(self.temporal, x))
        b, c, t, h, w = x.shape
        return x.view(b, self.cout, c // self.cout, t, h, w).mean(dim=2)


class DuplicatingShortcut(nn.Module):
    """Upsample without weights: repeat each channel, then pixel-shuffle."""

    def __init__(self, cin: int, cout: int, factor: int, temporal: bool = False):
        super().__init__()
        self.cin, self.cout, self.factor, self.temporal = cin, cout, factor, temporal

    def forward(self, x: Tensor) -> Tensor:
        temporal = _halves_time(self.temporal, x)
        repeats = self.cout * self.factor ** (3 if temporal else 2) // self.cin
        return channels_to_space(x.repeat_interleave(repeats, dim=1), self.factor, temporal)


class Upsample(nn.Module):
    """Nearest 2x in H and W (and T), then a conv (the checkpoint's ``InterpolateConv``)."""

    def __init__(self, cin: int, cout: int, temporal: bool):
        super().__init__()
        self.temporal = temporal
        self.conv = Conv(cin, cout)

    def forward(self, x: Tensor) -> Tensor:
        scale = (2 if _halves_time(self.temporal, x) else 1, 2, 2)
        return self.conv(F.interpolate(x, scale_factor=scale, mode="nearest"))


class LinearAttention(nn.Module):
    """EfficientViT's LiteMLA: q, k, v from a 1x1x1 conv plus a 5x5x5-aggregated copy, ReLU
    kernels, attention linear in the token count (``v k^T q`` normalised by ``1 k^T q``)."""

    def __init__(self, channels: int, eps: float = 1e-15):
        super().__init__()
        self.dim, self.eps = LINEAR_ATTENTION_DIM, eps
        heads = channels // self.dim
        qkv = 3 * channels
        self.qkv = Conv(channels, qkv, kernel=1, bias=False)
        self.aggreg = nn.ModuleList([nn.Sequential(
            nn.Conv3d(qkv, qkv, 5, padding=2, groups=qkv, bias=False),
            nn.Conv3d(qkv, qkv, 1, groups=3 * heads, bias=False),
        )])
        self.proj = Conv(2 * channels, channels, kernel=1, bias=False, norm=True)

    @torch.autocast("cuda", enabled=False)   # as Open-Sora: the attention ignores autocast
    def attend(self, qkv: Tensor) -> Tensor:
        b, _, t, h, w = qkv.shape
        if qkv.dtype == torch.float16:
            qkv = qkv.float()
        qkv = qkv.reshape(b, -1, 3 * self.dim, t * h * w)   # per head: q, k, v channels
        q, k, v = qkv.split(self.dim, dim=2)
        q, k = F.relu(q), F.relu(k)
        v = F.pad(v, (0, 0, 0, 1), value=1.0)   # a row of ones gives the normaliser
        out = (v @ k.transpose(-1, -2)) @ q
        if out.dtype == torch.bfloat16:
            out = out.float()
        out = out[:, :, :-1] / (out[:, :, -1:] + self.eps)
        return out.reshape(b, -1, t, h, w)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.qkv(x)
        qkv = torch.cat([qkv] + [op(qkv) for op in self.aggreg], dim=1)
        return self.proj(self.attend(qkv).to(qkv.dtype))


class GatedMLP(nn.Module):
    """GLUMBConv: 1x1x1 expand (SiLU), depthwise 3x3x3, SiLU-gated, 1x1x1 project, norm."""

    def __init__(self, channels: int):
        super().__init__()
        hidden = MLP_EXPAND * channels
        self.inverted_conv = Conv(channels, 2 * hidden, kernel=1, act="silu")
        self.depth_conv = Conv(2 * hidden, 2 * hidden, groups=2 * hidden)
        self.point_conv = Conv(hidden, channels, kernel=1, bias=False, norm=True)

    def forward(self, x: Tensor) -> Tensor:
        x, gate = self.depth_conv(self.inverted_conv(x)).chunk(2, dim=1)
        return self.point_conv(x * F.silu(gate))


class EfficientViTBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.context_module = Residual(LinearAttention(channels))
        self.local_module = Residual(GatedMLP(channels))

    def forward(self, x: Tensor) -> Tensor:
        return self.local_module(self.context_module(x))


class ResConvBlock(nn.Module):
    """conv (bias, SiLU) then conv (no bias, RMS norm)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = Conv(channels, channels, act="silu")
        self.conv2 = Conv(channels, channels, bias=False, norm=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv2(self.conv1(x))


def _block(kind: str, channels: int) -> nn.Module:
    if kind == RES:
        return Residual(ResConvBlock(channels))
    if kind == EVIT:
        return EfficientViTBlock(channels)
    raise ValueError(f"unknown DC-AE block type {kind!r}")


# --------------------------------------------------------------------------- encoder, decoder


class Encoder(nn.Module):
    def __init__(self, cfg: DCAEConfig):
        super().__init__()
        widths, depths, last = cfg.encoder_widths, cfg.encoder_depths, len(cfg.encoder_widths) - 1
        self.project_in = Conv(cfg.in_channels, widths[0])
        stages = []
        for i, (width, depth) in enumerate(zip(widths, depths)):
            ops = [_block(cfg.block_types[i], width) for _ in range(depth)]
            if i < last:
                stride = (2 if cfg.temporal[i] else 1, 2, 2)
                ops.append(Residual(Conv(width, widths[i + 1], stride=stride),
                                    AveragingShortcut(width, widths[i + 1], 2, cfg.temporal[i])))
            stages.append(Ops(ops))
        self.stages = nn.ModuleList(stages)
        self.project_out = Residual(Ops([Conv(widths[-1], cfg.latent_channels)]),
                                    AveragingShortcut(widths[-1], cfg.latent_channels, 1))

    def forward(self, x: Tensor) -> Tensor:
        x = self.project_in(x)
        for stage in self.stages:
            x = stage(x)
        return self.project_out(x)


class Decoder(nn.Module):
    def __init__(self, cfg: DCAEConfig):
        super().__init__()
        widths, depths, last = cfg.decoder_widths, cfg.decoder_depths, len(cfg.decoder_widths) - 1
        self.project_in = Residual(Conv(cfg.latent_channels, widths[-1]),
                                   DuplicatingShortcut(cfg.latent_channels, widths[-1], 1))
        stages = []
        for i, (width, depth) in enumerate(zip(widths, depths)):
            ops = []
            if i < last:
                ops.append(Residual(Upsample(widths[i + 1], width, cfg.temporal[i]),
                                    DuplicatingShortcut(widths[i + 1], width, 2, cfg.temporal[i])))
            ops += [_block(cfg.block_types[i], width) for _ in range(depth)]
            stages.append(Ops(ops))
        self.stages = nn.ModuleList(stages)   # stored shallow-first, run deep-first
        self.project_out = Ops([RMSNorm3d(widths[0]), nn.ReLU(), Conv(widths[0], cfg.in_channels)])

    def forward(self, z: Tensor) -> Tensor:
        x = self.project_in(z)
        for stage in reversed(self.stages):
            x = stage(x)
        return self.project_out(x)


class DCAE(nn.Module):
    """The autoencoder without scaling or tiling (``models/mmdit/dc_ae_vae.py`` adds both)."""

    def __init__(self, cfg: DCAEConfig = DCAEConfig()):
        super().__init__()
        if any(d < 1 for d in cfg.encoder_depths + cfg.decoder_depths):
            raise ValueError("every DC-AE stage needs at least one block")
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)


# --------------------------------------------------------------------------- architecture from tensors


def config_from_tensors(shapes: dict[str, tuple[int, ...]], temporal=DCAEConfig.temporal) -> DCAEConfig:
    """The architecture of a DC-AE checkpoint, read off its tensor names and shapes (the
    temporal stages are not visible in the tensors: ``temporal`` gives them, the release's by
    default). Raises ``KeyError``/``ValueError`` on tensors that do not form a DC-AE."""
    def ops(part: str, stage: int) -> dict[int, set[str]]:
        found: dict[int, set[str]] = {}
        for name in shapes:
            m = re.match(rf"{part}\.stages\.{stage}\.op_list\.(\d+)\.(.+)", name)
            if m:
                found.setdefault(int(m.group(1)), set()).add(m.group(2))
        return found

    def kind(names: set[str]) -> str | None:
        if any(n.startswith("context_module.") for n in names):
            return EVIT
        if any(n.startswith("main.conv1.") for n in names):
            return RES
        return None   # a down- or upsampling block

    stages = sorted({int(m.group(1)) for n in shapes for m in [re.match(r"encoder\.stages\.(\d+)\.", n)] if m})
    if not stages or stages != list(range(len(stages))) or len(stages) != len(temporal):
        raise ValueError(f"found encoder stages {stages}; the DC-AE has {len(temporal)}")
    enc_widths, enc_depths, dec_widths, dec_depths, types = [], [], [], [], []
    for i in stages:
        enc, dec = ops("encoder", i), ops("decoder", i)
        enc_kinds = [kind(enc[j]) for j in sorted(enc)]
        dec_kinds = [kind(dec[j]) for j in sorted(dec)]
        blocks = [k for k in enc_kinds if k]
        if not blocks or len(set(blocks + [k for k in dec_kinds if k])) != 1:
            raise ValueError(f"stage {i} mixes block types or has none")
        types.append(blocks[0])
        enc_depths.append(len(blocks))
        dec_depths.append(sum(1 for k in dec_kinds if k))
        prefix = 0 if i == len(stages) - 1 else 1   # the decoder's upsampler comes first
        first = "main.conv1.conv.weight" if blocks[0] == RES else "context_module.main.qkv.conv.weight"
        enc_widths.append(shapes[f"encoder.stages.{i}.op_list.0.{first}"][1])
        dec_widths.append(shapes[f"decoder.stages.{i}.op_list.{prefix}.{first}"][1])
    latent = shapes["encoder.project_out.main.op_list.0.conv.weight"][0]
    return DCAEConfig(latent_channels=latent, encoder_widths=tuple(enc_widths), encoder_depths=tuple(enc_depths),
                      decoder_widths=tuple(dec_widths), decoder_depths=tuple(dec_depths), block_types=tuple(types),
                      temporal=tuple(temporal), in_channels=shapes["encoder.project_in.conv.weight"][1])


__all__ = ["DCAE", "DCAEConfig", "Decoder", "Encoder", "config_from_tensors"]
