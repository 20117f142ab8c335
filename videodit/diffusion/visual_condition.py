"""Open-Sora 2.0's image and video conditioning (``opensora/utils/train.py``
``prepare_visual_condition_causal`` / ``_uncausal``, ``utils/inference.py``).

The model takes ``cond = cat(mask, mask * latents)`` [B, 1 + C, T, H, W] beside x_t (its
``cond_in``, packed with x_t's patch): the mask is 1 on the given latent frames, the latents are
those frames' clean latents. Each sample of a batch gets one mode, drawn by weight from
``diffusion.condition_config`` (written as in Open-Sora's configs):

* ``t2v``: nothing given (cond all zero);
* ``i2v_head`` / ``i2v_tail`` / ``i2v_loop``: the first / last / both latent frames, each the
  latent of that one pixel frame encoded on its own;
* ``v2v_head`` / ``v2v_tail``: the first / last 32 pixel frames (33 with a causal VAE), 64 (65)
  for the ``_easy`` modes: with a causal VAE those frames encoded on their own, (32 - 1)/4 + 1 = 9
  latent frames; otherwise the clip's own first / last 32/4 = 8 latent frames.

Frames "encoded on their own" differ from the clip's latents of the same frames: the Hunyuan
VAE's group norms and attention see the whole clip, so the clip's first latent frame knows the
rest ("information leakage", Open-Sora's comment). This module encodes them on their own when it
has the pixels; from a feature cache (latents only) it takes the clip's latents of those frames,
which is exact only for the non-causal v2v modes. A clip of one latent frame (an image) is never
conditioned, and v2v modes are left out for clips too short to leave a frame to generate.

Differences kept from Open-Sora: draws come from a torch generator (``random.choices``' rule:
cumulative weights, a uniform times their sum, bisect), so a resumed run draws the same modes;
Open-Sora removes short-clip v2v modes from its config dict in place, so once one short clip is
seen they are never drawn again in that run; here they are left out for that clip only.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from videodit.errors import UserError

MODES = ("t2v", "i2v_head", "i2v_tail", "i2v_loop", "v2v_head", "v2v_tail", "v2v_head_easy", "v2v_tail_easy")
# Pixel frames a v2v mode gives (one more with a causal VAE).
V2V_PIXEL_FRAMES = {"v2v_head": 32, "v2v_tail": 32, "v2v_head_easy": 64, "v2v_tail_easy": 64}

HEAD, TAIL = slice(0, 1), slice(-1, None)
Encode = Callable[[torch.Tensor], torch.Tensor]   # pixel clip [1, 3, T, H, W] -> latents [1, C, T', H', W']


def check_condition_config(weights) -> dict[str, float]:
    """``diffusion.condition_config`` as {mode: weight}, or a UserError naming what is wrong."""
    if not isinstance(weights, dict) or not weights:
        raise UserError(f"diffusion.condition_config must be a mapping of mode -> weight, e.g. "
                        f"{{t2v: 1, i2v_head: 5, i2v_loop: 1, i2v_tail: 1}}; got {weights!r}")
    unknown = sorted(set(map(str, weights)) - set(MODES))
    if unknown:
        raise UserError(f"diffusion.condition_config has unknown mode(s) {', '.join(unknown)}; choose from "
                        f"{', '.join(MODES)}")
    bad = {k: v for k, v in weights.items()
           if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0}
    if bad or not sum(weights.values()) > 0:
        raise UserError(f"diffusion.condition_config weights must be numbers >= 0, not all 0; got {weights}")
    return {k: float(v) for k, v in weights.items()}


@dataclass(frozen=True)
class FrameRule:
    """How a VAE maps pixel frames to latent frames: ``ratio`` pixel frames per latent frame,
    ``causal`` when the first pixel frame is a latent frame of its own (T' = (T - 1)/ratio + 1)."""
    ratio: int
    causal: bool

    @classmethod
    def of(cls, vae) -> "FrameRule":
        """A VAE's rule: causal when 1 + 2 ratio frames make 3 latent frames (a non-causal VAE, as
        Open-Sora's DC-AE, takes whole groups of ``ratio`` frames, or refuses that length)."""
        ratio = int(getattr(vae, "temporal_compression", 1))
        side = vae.spatial_compression
        try:
            causal = vae.latent_size(1 + 2 * ratio, side, side)[0] == 3
        except UserError:
            causal = False
        return cls(ratio, causal)

    def v2v_pixel_frames(self, mode: str) -> int:
        return V2V_PIXEL_FRAMES[mode] + int(self.causal)

    def given_frames(self, mode: str) -> int:
        """Latent frames a mode gives (at the head, the tail, or one at each end for i2v_loop)."""
        if mode == "t2v":
            return 0
        if mode.startswith("i2v"):
            return 2 if mode == "i2v_loop" else 1
        pixels = self.v2v_pixel_frames(mode)
        return (pixels - 1) // self.ratio + 1 if self.causal else pixels // self.ratio


def usable(weights: dict[str, float], latent_frames: int, rule: FrameRule) -> dict[str, float]:
    """The modes a clip of ``latent_frames`` can take: v2v only where frames are left to
    generate (Open-Sora's bounds: more than 32/4 (+1 causal) latent frames, 64/4 (+1) for _easy)."""
    return {mode: w for mode, w in weights.items()
            if not mode.startswith("v2v") or latent_frames > rule.given_frames(mode)}


def pick(weights: dict[str, float], uniform: float) -> str:
    """``random.choices(modes, weights)`` given its uniform draw in [0, 1)."""
    modes = list(weights)
    cumulative = list(itertools.accumulate(weights.values()))
    return modes[bisect.bisect(cumulative, uniform * (cumulative[-1] + 0.0), 0, len(modes) - 1)]


def draw_modes(weights: dict[str, float], batch: int, latent_frames: int, rule: FrameRule,
               generator: torch.Generator) -> list[str]:
    """One mode per sample; images (one latent frame) are never conditioned."""
    if latent_frames <= 1:
        return ["t2v"] * batch
    allowed = usable(weights, latent_frames, rule)
    if not any(allowed.values()):
        return ["t2v"] * batch
    uniforms = torch.rand(batch, generator=generator, dtype=torch.float64).tolist()
    return [pick(allowed, u) for u in uniforms]


def given_slices(mode: str, rule: FrameRule) -> list[slice]:
    """The latent frames ``mode`` gives, as slices of the clip (one at each end for i2v_loop)."""
    if mode == "t2v":
        return []
    if mode.startswith("i2v"):
        return {"i2v_head": [HEAD], "i2v_tail": [TAIL], "i2v_loop": [HEAD, TAIL]}[mode]
    k = rule.given_frames(mode)
    return [slice(0, k) if "head" in mode else slice(-k, None)]


def given_mask(modes: list[str], latent_frames: int, rule: FrameRule) -> torch.Tensor:
    """bool [B, T]: True on the latent frames each sample is given."""
    mask = torch.zeros(len(modes), latent_frames, dtype=torch.bool)
    for i, mode in enumerate(modes):
        for frames in given_slices(mode, rule):
            mask[i, frames] = True
    return mask


def _given_latents(mode: str, x0: torch.Tensor, rule: FrameRule, video: torch.Tensor | None,
                   encode: Encode | None) -> list[tuple[slice, torch.Tensor]]:
    """(latent frame slice, its latents [C, k, H, W]) of one sample's given frames."""
    own = video is not None and encode is not None
    if mode.startswith("v2v") and own and rule.causal:   # those pixel frames encoded on their own
        pixels = rule.v2v_pixel_frames(mode)
        clip = video[None, :, :pixels] if "head" in mode else video[None, :, -pixels:]
        return [(frames, encode(clip)[0].to(x0.dtype)) for frames in given_slices(mode, rule)]
    if mode.startswith("i2v") and own:                   # the one pixel frame encoded on its own
        return [(end, encode(video[None, :, end])[0].to(x0.dtype)) for end in given_slices(mode, rule)]
    # Open-Sora copies a non-causal VAE's v2v frames from the clip's latents; from a cache, all
    return [(frames, x0[:, frames]) for frames in given_slices(mode, rule)]


def build_condition(modes: list[str], x0: torch.Tensor, rule: FrameRule, video: torch.Tensor | None = None,
                    encode: Encode | None = None) -> torch.Tensor:
    """``cat(mask, mask * latents)`` [B, 1 + C, T, H, W] for ``x0`` [B, C, T, H, W]; ``video``
    [B, 3, T_pixels, H, W] and ``encode`` give the given frames' own latents (else x0's)."""
    b, c, t, h, w = x0.shape
    mask = given_mask(modes, t, rule).to(x0.device)
    latents = torch.zeros_like(x0)
    for i, mode in enumerate(modes):
        for frames, value in _given_latents(mode, x0[i], rule, None if video is None else video[i], encode):
            latents[i, :, frames] = value
    mask = mask.to(x0.dtype)[:, None, :, None, None].expand(b, 1, t, h, w)
    return torch.cat([mask, mask * latents], dim=1)


def loss_frames(modes: list[str], latent_frames: int) -> torch.Tensor:
    """bool [B, T]: the frames ``no_i2v_ref_loss`` keeps in the loss (Open-Sora's
    ``get_batch_loss``: an i2v sample loses its given first and/or last frame; other modes keep all)."""
    keep = torch.ones(len(modes), latent_frames, dtype=torch.bool)
    for i, mode in enumerate(modes):
        if latent_frames > 1 and mode in ("i2v_head", "i2v_loop"):
            keep[i, 0] = False
        if latent_frames > 1 and mode in ("i2v_tail", "i2v_loop"):
            keep[i, -1] = False
    return keep


@dataclass
class ReferenceCondition:
    """The condition of a sampling run: ``cond`` [1, 1 + C, T, H, W] and, for the i2v modes,
    the given frames put back into the result (Open-Sora replaces them before decoding; the v2v
    modes keep what was generated)."""
    mode: str
    cond: torch.Tensor

    def restore(self, x: torch.Tensor) -> torch.Tensor:
        if not self.mode.startswith("i2v"):
            return x
        cond = self.cond.to(x.device)
        return torch.where(cond[:, :1].bool(), cond[:, 1:].to(x.dtype), x)


def reference_condition(mode: str, latent_frames: int, rule: FrameRule, encode: Encode, reference: torch.Tensor,
                        reference_end: torch.Tensor | None = None) -> ReferenceCondition:
    """The condition of ``mode`` from pixel frames ``reference`` [3, T_ref, H, W] (and for the
    end of i2v_loop / i2v_tail, ``reference_end``, default ``reference``), as Open-Sora's
    ``collect_references_batch`` encodes them: the one frame, or the first / last 32 (+1 causal,
    64 for _easy) frames, on their own."""
    if mode == "t2v" or mode not in MODES:
        raise UserError(f"reference mode {mode!r} is not one of {', '.join(MODES[1:])}")
    end = reference if reference_end is None else reference_end
    k = rule.given_frames(mode)
    if latent_frames <= k:
        raise UserError(f"{mode} gives {k} latent frame(s) of a clip of {latent_frames}: nothing is left to generate; "
                        "sample more frames (--num-frames)")
    if mode.startswith("v2v"):
        need = rule.v2v_pixel_frames(mode)
        if reference.shape[1] < need:
            raise UserError(f"{mode} needs at least {need} reference frames, the reference has {reference.shape[1]}; "
                            "give a longer clip (or a v2v mode without _easy)")
        clips = [reference[:, :need] if "head" in mode else reference[:, -need:]]
    else:   # the head from the reference's first frame, the tail from the end's last
        clips = [reference[:, :1] if frames is HEAD else end[:, -1:] for frames in given_slices(mode, rule)]
    parts = list(zip(given_slices(mode, rule), clips))
    encoded = [(frames, encode(clip[None])) for frames, clip in parts]
    c, h, w = encoded[0][1].shape[1], *encoded[0][1].shape[-2:]
    cond = torch.zeros(1, 1 + c, latent_frames, h, w, device=encoded[0][1].device, dtype=torch.float32)
    for frames, latents in encoded:
        n = len(range(latent_frames)[frames])
        at_head = frames.start == 0
        cond[:, :1, frames] = 1.0    # Open-Sora takes the head's first n latent frames, the tail's last n
        cond[:, 1:, frames] = (latents[:, :, :n] if at_head else latents[:, :, -n:]).float()
    return ReferenceCondition(mode, cond)


class VisualConditioning:
    """Training with ``diffusion.condition_config``: per micro-batch, draw the modes and build
    ``cond``; with ``no_i2v_ref_loss``, the frames its loss keeps (``kept_frames``, for :meth:`loss`)."""

    def __init__(self, weights: dict, rule: FrameRule, no_i2v_ref_loss: bool = False):
        self.weights = check_condition_config(weights)
        self.rule = rule
        self.no_i2v_ref_loss = no_i2v_ref_loss
        self.kept_frames: torch.Tensor | None = None

    def apply(self, x0: torch.Tensor, seed: int, video: torch.Tensor | None = None,
              encode: Encode | None = None) -> torch.Tensor:
        """cond [B, 1 + C, T, H, W] of a micro-batch, its modes drawn from ``seed`` (the batch's noise
        seed, on a stream of its own); the given frames encoded on their own from ``video`` with
        ``encode``, else (a feature cache) taken from ``x0``."""
        generator = torch.Generator().manual_seed(seed ^ 0xC0D1)
        modes = draw_modes(self.weights, x0.shape[0], x0.shape[2], self.rule, generator)
        if self.no_i2v_ref_loss:
            self.kept_frames = loss_frames(modes, x0.shape[2])
        return build_condition(modes, x0, self.rule, video, encode)

    def loss(self, loss_fn):
        """``loss_fn(output, x_t, t, target, frame_mask)`` over the frames of the last :meth:`apply`."""
        if not self.no_i2v_ref_loss:
            return loss_fn
        return lambda out, x_t, t, target, *_: loss_fn(out, x_t, t, target, self.kept_frames.to(out.device))


def visual_conditioning(diffusion, vae, takes_condition: bool, family: str, pp: int) -> VisualConditioning | None:
    """Open-Sora 2.0's conditioning of a run (``diffusion.condition_config``), or None."""
    if diffusion.condition_config is None:
        return None
    if not takes_condition:
        raise UserError(f"diffusion.condition_config gives frames as input channels (Open-Sora 2.0's cond_in), which "
                        f"this {family} model does not take: use an MMDiT preset with model.cond_embed, or remove "
                        "diffusion.condition_config")
    if diffusion.no_i2v_ref_loss and pp > 1:
        raise UserError("diffusion.no_i2v_ref_loss is not supported with parallel.pp > 1 (the last stage's loss "
                        "sees micro-batches); remove one of them")
    return VisualConditioning(diffusion.condition_config, FrameRule.of(vae), diffusion.no_i2v_ref_loss)
