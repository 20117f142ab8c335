"""LTX-2's objective and sampler as the trainer and ``sample.py`` run them: the seam between
videodit's loop and the pure functions of ``ltx2_schedule.py`` (training) and ``ltx2_sampler.py``
(sampling). A family names it with ``ModelSpec.objective = "ltx2"`` (``objectives.py`` maps the
name); nothing here knows a model class.

**Training** (:class:`LTX2Objective`, the trainer's ``objective``): ``noised`` draws a batch's
sigma (LTX's token-shifted logit-normal, the clip's F*H*W latent tokens at patch 1), noise and
first-frame choice (``diffusion.first_frame_p``) from the batch's generator in ltx-trainer's order
(:func:`ltx2_schedule.noised`), and hands the model the per-sample sigma as ``t`` and the per-token
sigma as ``t`` plus the frame mask ``x_mask`` (False: latent frame 0 given, its tokens at sigma 0):
the form the spec's ``model_inputs`` and LTX-2's model take. ``loss`` is LTX's per-sample masked MSE
(:func:`ltx2_schedule.masked_mse`) over the generated frames, averaged over the batch. The caption
dropout videodit draws after these (``diffusion.caption_dropout``) zeroes the text (the spec's).

**Sampling** (:func:`denoise`): LTX's dev schedule (``ltx2_sampler.sigmas``, as its pipelines ask
for it), CFG with the run's scale, STG (``diffusion.stg_scale``; one block's video self-attention
skipped, ``ModelSpec.skip_self_attention``) and the rescale (``diffusion.guidance_rescale``); a
given first frame (``--ref IMAGE``) is kept as LTX's ``VideoConditionByLatentIndex`` keeps it
(strength 1). A model whose audio stream trained samples both streams (``audio``,
``ltx2_sampler.sample_av``; its noise, text and decoding: ``ltx2_audio_sampling.py``).

**Clip sizes** (:func:`check_clips`): LTX-2's video VAE (8 x 32 x 32, causal) takes 8k+1 frames
and sides that are multiples of 32 pixels; every bucket of a run is checked against the VAE the
run has (a stand-in VAE's own strides), in one line, before a model is built.
"""

from __future__ import annotations

from typing import Callable

import torch

from videodit.diffusion import ltx2_sampler, ltx2_schedule
from videodit.errors import UserError

RELEASE_DEPTH = 48   # the released models' blocks: a shallower model's STG block sits at the same relative depth


class LTX2Objective:
    """LTX-2's training objective (module docstring); ``cfg``: ``diffusion.*``."""

    def __init__(self, cfg):
        self.cfg = cfg
        check_options(cfg)
        self.first_frame_p = float(cfg.first_frame_p)

    def noised(self, x0: torch.Tensor, size, generator: torch.Generator, device=None,
               time_range: tuple[float, float] | None = None):
        """(x_t, sigma [B], velocity target, x_mask [B, F]: False on a given first frame) of clean
        latents ``x0`` [B, C, F, H, W]; ``size``, the clip's pixel size, is not needed (LTX shifts by
        latent tokens)."""
        if time_range is not None:
            raise UserError("LTX-2's objective draws sigma over [0, 1] (no two-expert timestep ranges); "
                            "remove diffusion.timestep_range")
        drawn = ltx2_schedule.noised(x0, generator, self.first_frame_p)
        return drawn.x_t, drawn.sigma, drawn.target, drawn.generated_frames

    def loss(self, output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, target: torch.Tensor,
             x_mask: torch.Tensor | None = None) -> torch.Tensor:
        """LTX's loss of a micro-batch: per sample the squared error over the generated frames'
        tokens (``x_mask`` [B, F], True = generated; None: all), then the batch mean (fp32)."""
        b, _, frames, height, width = output.shape
        if x_mask is None:
            tokens = torch.ones(b, frames * height * width, dtype=torch.bool, device=output.device)
        else:
            tokens = x_mask.bool()[:, :, None].expand(b, frames, height * width).reshape(b, -1)
        return ltx2_schedule.masked_mse(output, target, tokens).mean()

    # -------------------------------------------------------------- the audio stream (model.train_audio)

    def noised_audio(self, tokens: torch.Tensor, generator: torch.Generator) -> ltx2_schedule.NoisedTokens:
        """The audio stream's x_t, velocity target and own sigma [B] of clean audio tokens [B, Ta, C],
        drawn after the video's (:meth:`noised`) from the same generator, as ltx-trainer's ``flexible``."""
        return ltx2_schedule.noised_tokens(tokens, generator)

    def joint_losses(self, output: torch.Tensor, target: torch.Tensor, x_mask: torch.Tensor | None,
                     audio_output: torch.Tensor, audio_target: torch.Tensor,
                     audio_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ltx-trainer's loss of both streams, per sample [B]: (video + audio, audio). Each stream's
        masked MSE on LTX's tokens (``ltx2_schedule.token_mse``: the video's generated frames,
        ``audio_mask`` [B, Ta] the audio tokens in the loss); the trainer averages the sum over the batch."""
        b, _, frames, height, width = output.shape
        generated = torch.ones(b, frames, dtype=torch.bool, device=output.device) if x_mask is None else x_mask.bool()
        tokens = generated[:, :, None].expand(b, frames, height * width).reshape(b, -1)
        # LTX's token views: the model's output tokens as it made them, the target's as its patchifier
        # views the latents (the layouts set the order of the sums)
        video = ltx2_schedule.token_mse(ltx2_schedule.to_tokens(output), ltx2_schedule.to_tokens(target), tokens)
        audio = ltx2_schedule.token_mse(audio_output, audio_target, audio_mask)
        return video + audio, audio


def check_options(cfg) -> None:
    """One line for ``diffusion.*`` settings LTX-2's objective cannot honour."""
    if cfg.prediction != "velocity" or cfg.loss_space != "velocity":
        raise UserError(f"LTX-2's objective trains the velocity (noise - x0) with LTX's masked MSE; "
                        f"diffusion.prediction={cfg.prediction} and diffusion.loss_space={cfg.loss_space} do not apply: "
                        "set diffusion.prediction=velocity diffusion.loss_space=velocity")
    if cfg.sigma_min:
        raise UserError(f"LTX-2's objective has no noise floor; set diffusion.sigma_min=0 (not {cfg.sigma_min})")
    if cfg.timestep_range is not None:
        raise UserError("LTX-2's objective draws sigma over [0, 1] (no two-expert timestep ranges); "
                        "remove diffusion.timestep_range")
    if cfg.first_frame_p and cfg.mask_ratios is not None:
        raise UserError("diffusion.first_frame_p (LTX's first-frame conditioning) and diffusion.mask_ratios (Open-Sora "
                        "1.2's frame masks) both choose the given frames; keep one")


def check_clips(vae, buckets) -> None:
    """Refuse, in one line, the first bucket (``num_frames``, ``height``, ``width`` in pixels) whose
    clip does not fit the VAE's grid: ``r``k+1 frames, sides multiples of ``s`` (LTX-2's VAE:
    r = 8, s = 32; 960x544x49 fits)."""
    r, s = int(vae.temporal_compression), int(vae.spatial_compression)
    for bucket in buckets:
        frames, height, width = bucket.num_frames, bucket.height, bucket.width
        if (frames - 1) % r == 0 and height % s == 0 and width % s == 0:
            continue
        low = (frames - 1) // r * r + 1
        near_frames = f"{low} or {low + r}" if low != frames else str(frames)
        near = [f"{near_frames} frames"] if low != frames else []
        near += [f"{side} -> {max(s, round(side / s) * s)}" for side in (height, width) if side % s]
        raise UserError(f"LTX-2 with this VAE ({r} x {s} x {s}) takes clips of {r}k+1 frames with sides that are "
                        f"multiples of {s} pixels; the bucket of {width}x{height} (width x height), {frames} frames does "
                        f"not fit (nearest: {', '.join(near)}): fix data.num_frames/height/width or data.bucket_config")


# ---------------------------------------------------------------------- sampling

VelocityOf = Callable[[object], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]


def stg_block(geometry, chosen: int | None) -> int:
    """The block STG's branch perturbs: ``chosen`` (``diffusion.stg_block``), else the release's
    (29 in LTX-2.0, 28 in 2.3) at the same relative depth in a model of fewer blocks."""
    layers = geometry.num_layers
    if chosen is not None:
        if not 0 <= chosen < layers:
            raise UserError(f"diffusion.stg_block={chosen} is not a block of this {layers}-block LTX-2; "
                            f"choose 0 to {layers - 1}")
        return chosen
    block = ltx2_sampler.STG_BLOCK[geometry.version]
    return block if layers >= RELEASE_DEPTH else block * layers // RELEASE_DEPTH


def first_frame(given) -> ltx2_sampler.FirstFrame | None:
    """LTX's first-frame condition of ``sample.py``'s given frames (``latents`` [1, C, T, H, W],
    ``x_mask`` [1, T] False on the given ones), or None; only latent frame 0 may be given."""
    if given is None:
        return None
    x_mask = given.x_mask.reshape(-1)
    if x_mask[0] or not x_mask[1:].all():
        raise UserError(f"LTX-2 samples from one given first frame; the reference gives {int((~x_mask).sum())} latent "
                        "frames: give an image, or --ref-frames 1")
    return ltx2_sampler.FirstFrame(given.latents[:, :, :1])


def denoise(model, spec, velocity: VelocityOf, cond, uncond, noise: torch.Tensor, *, steps: int, guidance: float,
            diffusion, given=None, audio=None):
    """LTX-2's dev sampler (module docstring) from ``noise`` [N, C, F, H, W]. ``velocity(conditions)``
    gives ``v(x, sigma [N])``, the model's velocity with those conditions (their ``x_mask`` marks the
    given first frame, whose tokens the model sees at sigma 0, as LTX's per-token sigma has them);
    ``guidance``: the CFG scale; ``diffusion``: ``diffusion.*`` (STG, rescale). ``audio``: the audio
    stream's :class:`ltx2_audio_sampling.AudioSampling`; then ``v(x, sigma, tokens, context)`` gives
    both velocities and this returns (latents, audio tokens) (:func:`ltx2_sampler.sample_av`)."""
    if callable(guidance):
        raise UserError("LTX-2 has no two-expert models; give one guidance scale")
    scales = ltx2_sampler.Guidance(cfg=float(guidance), stg=float(diffusion.stg_scale),
                                   rescale=float(diffusion.guidance_rescale))
    prompt, negative = velocity(cond), velocity(uncond)
    block = stg_block(model.geometry, diffusion.stg_block) if scales.stg else None

    def perturbed(x, sigma_tokens, sigma):
        with spec.skip_self_attention(model, block):
            return prompt(x, sigma)
    if audio is not None:
        return _denoise_av(prompt, negative, noise, audio, steps, scales, spec, model, block, given)
    return ltx2_sampler.sample(lambda x, sigma_tokens, sigma: prompt(x, sigma), noise, ltx2_sampler.sigmas(steps),
                               scales, uncond=lambda x, sigma_tokens, sigma: negative(x, sigma),
                               perturbed=perturbed, first_frame=first_frame(given))


def _denoise_av(prompt, negative, noise, audio, steps: int, scales, spec, model, block, given):
    """:func:`denoise` of both streams: the audio guided by LTX's audio CFG scale (``audio.cfg``; none
    where the video's is off) and the run's rescale; the negative branch hears the negative prompt's
    audio text (a dropped caption: zeros, as the spec drops it)."""
    audio_scales = ltx2_sampler.Guidance(cfg=audio.cfg if scales.cfg != 1 else 1.0, stg=0.0, rescale=scales.rescale)
    context = audio.context
    negative_context = context if audio.negative is None else audio.negative.expand(context.shape[0], -1, -1)

    def perturbed(x, a, sigma_tokens, sigma):
        with spec.skip_self_attention(model, block):
            return prompt(x, sigma, a, context)
    return ltx2_sampler.sample_av(lambda x, a, sigma_tokens, sigma: prompt(x, sigma, a, context), noise, audio.noise,
                                  ltx2_sampler.sigmas(steps), scales, audio_scales,
                                  uncond=lambda x, a, sigma_tokens, sigma: negative(x, sigma, a, negative_context),
                                  perturbed=perturbed, first_frame=first_frame(given))
