"""LTX-2's sampler for the dev (full, not distilled) model, as ltx-pipelines'
``TI2VidOneStagePipeline`` runs it (Lightricks/LTX-2 at 400fd31: ltx-core ``LTX2Scheduler``,
``EulerDiffusionStep``, ``MultiModalGuider``, ``VideoConditionByLatentIndex``; ltx-pipelines
``euler_denoising_loop``, ``FactoryGuidedDenoiser``). The two-stage pipelines run the same first
stage at half size before their upsampler and distilled second stage.

**Schedule** (:func:`sigmas`): ``linspace(1, 0, steps + 1)``; each non-zero sigma shifted by mu,
``e^mu / (e^mu + 1/sigma - 1)``, mu on the line of training's sigmas (:func:`ltx2_schedule.shift_mu`);
then stretched, ``1 - (1 - sigma) / scale``, so that the last non-zero sigma is ``terminal`` (0.1;
with one step that is the only one, so LTX's one-step schedule is [0.1, 0]).
The pipelines ask for it without a latent, so mu is the line's value at 4096 tokens (2.05) for every
clip size; only the HQ pipeline hands it its latent (F*H*W tokens): ``tokens`` does that.

**A step** at sigma s: the model's velocity v becomes the data estimate per token,
``x0 = x - sigma_token * v``; the branches' estimates are combined (``MultiModalGuider``),

    x0 = c + (cfg - 1)(c - u) + stg (c - p),    then    x0 *= rescale std(c)/std(x0) + 1 - rescale

with c the prompt's, u the negative prompt's and p the STG branch's (the prompt, self-attention
of one block skipped); the given tokens' estimate is put back to their clean latents; and Euler
steps ``x += (x - x0) / s * (s_next - s)``. Dev defaults (video): cfg 3, stg 1 on block 29 (2.0) or
28 (2.3), rescale 0.7; 40 steps (2.0) or 30 (2.3).

**First frame** (i2v, :class:`FirstFrame`): its latents replace the noise of latent frame 0 where
the denoise mask ``1 - strength`` says so (strength 1: kept exactly), those tokens see sigma
``mask * s`` and their estimate is blended back to the clean latents every step, so with strength 1
they come out as given.

Differences from the pipelines, by design: the loop state stays fp32 (theirs is bf16 between
steps); the rescale's standard deviations are taken per sample (theirs over the batch: they run one
sample, where the two agree); no modality guidance (its branch skips the audio<->video
cross-attentions: zero for a video-only model; left out with sound too) and no ``skip_step`` (0 in
every default).

**With sound** (:func:`sample_av`, a model whose audio stream trained): the audio tokens start from
their own noise and go through the same sigmas and Euler steps, every model call giving both
streams' velocities; the audio is guided with its own scales (LTX's audio guider: cfg 7, rescale
0.7; its STG is left out, as videodit's STG branch skips the video self-attention only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from videodit.diffusion.ltx2_schedule import MAX_TOKENS, from_tokens, per_token, shift_mu

TERMINAL = 0.1
STEPS = {"2.0": 40, "2.3": 30}          # the dev models' default step counts
STG_BLOCK = {"2.0": 29, "2.3": 28}      # the block whose video self-attention the STG branch skips

# (x [B, C, F, H, W], sigma per token [B, F*H*W], sigma per sample [B]) -> the model's velocity.
# LTX's model takes both sigmas: the tokens' modulate the blocks, the sample's (Modality.sigma)
# modulates 2.3's text cross-attention and the cross-modal gates.
Velocity = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sigmas(steps: int, tokens: int | None = None, *, stretch: bool = True, terminal: float = TERMINAL) -> torch.Tensor:
    """LTX-2's ``steps + 1`` sigmas (float32) from 1 to 0; ``tokens``: the clip's F*H*W (None: 4096,
    as the pipelines call it)."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be at least 1")
    mu = shift_mu(MAX_TOKENS if tokens is None else tokens)
    s = torch.linspace(1.0, 0.0, steps + 1)
    s = torch.where(s != 0, math.exp(mu) / (math.exp(mu) + (1 / s - 1)), 0)
    if stretch:
        nonzero = s != 0
        one_minus = 1.0 - s[nonzero]
        scale = one_minus[-1] / (1.0 - terminal)
        s[nonzero] = 1.0 - one_minus / scale
    return s.to(torch.float32)


def initial_noise(shape: torch.Size | tuple[int, ...], generator: torch.Generator | None = None) -> torch.Tensor:
    """The starting noise for latents of ``shape`` [B, C, F, H, W] as the pipelines draw it
    (``GaussianNoiser``: a contiguous randn of their token layout [B, F*H*W, C]), laid out as latents."""
    b, c, frames, height, width = shape
    return from_tokens(torch.randn((b, frames * height * width, c), generator=generator), shape)


@dataclass(frozen=True)
class Guidance:
    """The video stream's guidance (LTX's ``MultiModalGuiderParams``; its dev defaults). ``cfg`` = 1
    and ``stg`` = 0 turn a branch off (its model call is not made); ``rescale`` = 0 turns off the
    rescale."""
    cfg: float = 3.0
    stg: float = 1.0
    rescale: float = 0.7


@dataclass(frozen=True)
class FirstFrame:
    """The given first latent frame (i2v): ``latents`` [B or 1, C, 1, H, W], the encoded image, and
    how strongly it holds (1: kept as given; LTX's ``VideoConditionByLatentIndex`` at index 0)."""
    latents: torch.Tensor
    strength: float = 1.0

    def clean_and_mask(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the clean latents: the frame, zeros after it, like ``like``; the denoise mask [B, F*H*W]
        float32: 1 - strength on frame 0, 1 after)."""
        b, _, frames, height, width = like.shape
        clean = torch.zeros_like(like)
        clean[:, :, :1] = self.latents.to(like.dtype)
        mask = torch.ones(b, frames * height * width, dtype=torch.float32, device=like.device)
        mask[:, :height * width] = 1.0 - self.strength
        return clean, mask


def _std_ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """std(num) / std(den) per sample, shaped to broadcast against them."""
    dims = tuple(range(1, num.dim()))
    return num.std(dim=dims, keepdim=True) / den.std(dim=dims, keepdim=True)


def guide(c: torch.Tensor, u: torch.Tensor | None, p: torch.Tensor | None, guidance: Guidance) -> torch.Tensor:
    """The guided data estimate from the branches' estimates (c: prompt, u: negative prompt,
    p: STG), LTX's ``MultiModalGuider.calculate`` for the video stream, in fp32."""
    pred = c
    if u is not None:
        pred = pred + (guidance.cfg - 1) * (c - u)
    if p is not None:
        pred = pred + guidance.stg * (c - p)
    if guidance.rescale != 0:
        factor = guidance.rescale * _std_ratio(c, pred) + (1 - guidance.rescale)
        pred = pred * factor
    return pred


def _start(noise: torch.Tensor, first_frame: FirstFrame | None):
    """(x, LTX's denoise mask per token, the given clean latents or None) before the first step:
    the noise, with a given first frame's tokens moved to it."""
    x = noise.float()
    b, _, frames, height, width = x.shape
    mask = torch.ones(b, frames * height * width, dtype=torch.float32, device=x.device)
    clean = None
    if first_frame is not None:
        clean, mask = first_frame.clean_and_mask(x)
        x = torch.lerp(clean, x, per_token(mask, x))
    return x, mask, clean


def sample(cond: Velocity, noise: torch.Tensor, schedule: torch.Tensor, guidance: Guidance = Guidance(), *,
           uncond: Velocity | None = None, perturbed: Velocity | None = None,
           first_frame: FirstFrame | None = None) -> torch.Tensor:
    """Latents [B, C, F, H, W] (fp32) from ``noise`` (:func:`initial_noise` draws LTX's numbers) by
    Euler steps over ``schedule`` (:func:`sigmas`), guided by ``uncond`` (the negative prompt's
    velocity; needed unless cfg = 1) and ``perturbed`` (the STG branch's; needed unless stg = 0),
    keeping ``first_frame``."""
    if guidance.cfg != 1 and uncond is None:
        raise ValueError(f"cfg={guidance.cfg} needs the negative prompt's velocity (uncond)")
    if guidance.stg != 0 and perturbed is None:
        raise ValueError(f"stg={guidance.stg} needs the STG branch's velocity (perturbed)")
    branches = [cond, uncond if guidance.cfg != 1 else None, perturbed if guidance.stg != 0 else None]
    x, mask, clean = _start(noise, first_frame)
    b = x.shape[0]
    schedule = schedule.to(device=x.device, dtype=torch.float32)
    for s, s_next in zip(schedule[:-1], schedule[1:]):
        sigma_tokens = mask * s
        sigma = s.expand(b)
        # each branch's data estimate (LTX's X0Model), in its operations and order
        estimates = [None if f is None else x - f(x, sigma_tokens, sigma).float() * per_token(sigma_tokens, x)
                     for f in branches]
        x0 = guide(*estimates, guidance)
        if clean is not None:            # the given tokens' estimate back to the clean latents
            m = per_token(mask, x)
            x0 = x0 * m + clean * (1 - m)
        x = x + (x - x0) / s * (s_next - s)
    return x


# (x, audio tokens [B, Ta, C], sigma per video token, sigma per sample) -> (video velocity, audio velocity)
JointVelocity = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def sample_av(cond: JointVelocity, noise: torch.Tensor, audio_noise: torch.Tensor, schedule: torch.Tensor,
              guidance: Guidance = Guidance(), audio_guidance: Guidance = Guidance(cfg=7.0, stg=0.0), *,
              uncond: JointVelocity | None = None, perturbed: JointVelocity | None = None,
              first_frame: FirstFrame | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(video latents, audio tokens), fp32, from ``noise`` and ``audio_noise`` [B, Ta, C] as the
    pipelines denoise both streams (diffusers' ``LTX2Pipeline``, ltx-pipelines' A/V loop): one
    schedule, each branch's model call gives both velocities, each stream turned into its data
    estimate (the audio tokens at the sample's sigma: no given audio), guided with its own scales
    (``audio_guidance``) and stepped by the same Euler step. :func:`sample`'s other rules hold."""
    def on(g: Guidance) -> tuple[bool, bool]:
        return g.cfg != 1, g.stg != 0
    (v_cfg, v_stg), (a_cfg, a_stg) = on(guidance), on(audio_guidance)
    if (v_cfg or a_cfg) and uncond is None:
        raise ValueError("cfg != 1 needs the negative prompt's velocity (uncond)")
    if (v_stg or a_stg) and perturbed is None:
        raise ValueError("stg != 0 needs the STG branch's velocity (perturbed)")
    branches = [cond, uncond if v_cfg or a_cfg else None, perturbed if v_stg or a_stg else None]
    (x, mask, clean), a = _start(noise, first_frame), audio_noise.float()
    b = x.shape[0]
    schedule = schedule.to(device=x.device, dtype=torch.float32)
    for s, s_next in zip(schedule[:-1], schedule[1:]):
        sigma_tokens = mask * s
        sigma = s.expand(b)
        outs = [None if f is None else f(x, a, sigma_tokens, sigma) for f in branches]
        video = [None if o is None else x - o[0].float() * per_token(sigma_tokens, x) for o in outs]
        audio = [None if o is None else a - o[1].float() * s for o in outs]
        x0 = guide(video[0], video[1] if v_cfg else None, video[2] if v_stg else None, guidance)
        a0 = guide(audio[0], audio[1] if a_cfg else None, audio[2] if a_stg else None, audio_guidance)
        if clean is not None:
            m = per_token(mask, x)
            x0 = x0 * m + clean * (1 - m)
        x = x + (x - x0) / s * (s_next - s)
        a = a + (a - a0) / s * (s_next - s)
    return x, a
