"""Inference: prompts in, videos out (Euler sampling with classifier-free guidance)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
from typing import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from videodit.components import first_frame_features, first_frame_given
from videodit.data.prompts import prepare_prompts
from videodit.data.video_write import write_video
from videodit.diffusion import flow_unipc, opensora2_sampler
from videodit.diffusion.objectives import family_sampler
from videodit.diffusion.opensora2_sampler import ThreeWayGuidance
from videodit.diffusion.visual_condition import FrameRule, ReferenceCondition, reference_condition
from videodit.diffusion.rectified_flow import RectifiedFlow
from videodit.distill.schedule import StudentSchedule
from videodit.errors import UserError
from videodit.models.families import get_spec, spec_of
from videodit.models.spec import AudioInputs, Conditions


Guidance = float | Callable[[torch.Tensor], float]   # a CFG scale, or one by time (two experts)


# Bounds of what one call samples (the CLI's options and Pipeline's arguments): far beyond any
# released model's (Wan: 81 frames, 50 steps, guidance 5; Open-Sora 2.0: 129 frames, guidance 7.5),
# so that a typo (30000000 steps, --cfg 1e308) is refused instead of running for days or overflowing.
MAX_FRAMES = 1024
MAX_SIDE = 8192
MAX_STEPS = 1000
MAX_GUIDANCE = 100.0


class NonFiniteLatents(UserError):
    """The sampler's latents (or the model's output) became NaN or infinite: no clip is made of them."""


@torch.no_grad()
def generate(model, vae, text, flow: RectifiedFlow, prompts: list[str], *, num_frames: int,
             height: int, width: int, steps: int, guidance: Guidance, fps: float, seed: int,
             device: torch.device, batch_size: int = 16, reference: torch.Tensor | None = None,
             sampler: str = "euler", negative_prompt: str | None = None, image_encoder=None,
             three_way: ThreeWayGuidance | None = None, ref_mode: str = "i2v_head",
             reference_end: torch.Tensor | None = None) -> np.ndarray:
    """Sample one clip per prompt: uint8 [N, T, H, W, 3] (:func:`generate_batches`, all at once)."""
    return np.concatenate([clips for _, clips in generate_batches(
        model, vae, text, flow, prompts, num_frames=num_frames, height=height, width=width, steps=steps,
        guidance=guidance, fps=fps, seed=seed, device=device, batch_size=batch_size, reference=reference,
        sampler=sampler, negative_prompt=negative_prompt, image_encoder=image_encoder, three_way=three_way,
        ref_mode=ref_mode, reference_end=reference_end)])


@torch.no_grad()
def generate_batches(model, vae, text, flow: RectifiedFlow, prompts: list[str], *, num_frames: int,
                     height: int, width: int, steps: int, guidance: Guidance, fps: float, seed: int,
                     device: torch.device, batch_size: int = 16, reference: torch.Tensor | None = None,
                     sampler: str = "euler", negative_prompt: str | None = None, image_encoder=None,
                     three_way: ThreeWayGuidance | None = None, ref_mode: str = "i2v_head",
                     reference_end: torch.Tensor | None = None, indices: Sequence[int] | None = None,
                     prepare: Callable[[list[str]], list[str]] | None = None, soundtrack=None):
    """Sample one clip per prompt, a batch at a time: yields (prompt indices, uint8 [n, T, H, W, 3])
    as each batch is made, so a caller writes clips while the next ones are sampled. ``indices``:
    the prompts to sample (default: all), e.g. those whose clips a resumed run has not written;
    ``prepare``: turns a batch's prompts into what the text encoder reads (``prepare_prompts``).
    ``reference``: pixel frames
    [3, T_ref, height, width] in [-1, 1] that open every clip (image-to-video, continuation).
    ``sampler``: euler or unipc (Wan's); ``negative_prompt``: CFG's unconditional branch for
    families that sample with one (Wan); ``image_encoder``: the reference frame's image features for a
    model that embeds them (Wan 2.1 I2V's CLIP), in both CFG branches as Wan does. Prompt k's noise depends only on (``seed``, k)
    (:func:`prompt_noise`), not on the other prompts, the batch size or which prompts are sampled. A model given frames as
    input channels (``takes_condition``: Open-Sora 2.0's) samples with ``three_way`` guidance (its
    text scale ``guidance``), ``reference`` (and ``reference_end``) giving frames as ``ref_mode`` says.
    Latents or decoded frames that are NaN or infinite stop it with :class:`NonFiniteLatents`,
    before that batch yields anything. ``soundtrack``: a trained audio stream's
    (``ltx2_audio_sampling.Soundtrack``): each batch then also yields a (waveform, rate) per clip."""
    model.eval()
    t_lat, h_lat, w_lat = vae.latent_size(num_frames, height, width)
    spec = spec_of(model)
    ratio = flow.shift_ratio(height, width, t_lat, (h_lat, w_lat), spec.patch_size(model.geometry)[1])
    channels = image = condition = None
    if takes_condition(model):   # Open-Sora 2.0: the reference's frames enter as cond channels
        three_way = three_way or ThreeWayGuidance(text=guidance)
        if reference is not None:
            end = None if reference_end is None else reference_end.to(device)
            condition = reference_condition(ref_mode, t_lat, FrameRule.of(vae), lambda clip: vae.encode(clip.to(device)),
                                            reference.to(device), end)
        reference = None
    if spec.takes_first_frame(model.geometry):   # Wan i2v: the reference's first frame enters as channels
        if reference is None:
            raise UserError("this model generates from an image (an i2v model): give one with --ref IMAGE")
        clip = torch.zeros(1, 3, num_frames, height, width, device=device)
        clip[:, :, 0] = reference[:, 0].to(device)
        channels, image, reference = first_frame_given(model, vae, clip), first_frame_features(image_encoder, clip), None
    given = None if reference is None else given_latents(model, vae, reference, t_lat, device)
    negative = negative_condition(text, negative_prompt)
    order = list(range(len(prompts)) if indices is None else indices)
    for start in range(0, len(order), batch_size):
        chunk_indices = order[start : start + batch_size]
        chunk = [prompts[k] for k in chunk_indices]
        if prepare is not None:
            chunk = prepare(chunk)
        n = len(chunk)
        y, y_mask = text.encode(chunk)
        pooled = text.encode_pooled(chunk)
        fps_t = torch.full((n,), float(fps), device=device)
        noise = torch.stack([prompt_noise((vae.latent_channels, t_lat, h_lat, w_lat), seed, k)
                             for k in chunk_indices]).to(device)
        fresh = None
        if isinstance(sampler, StudentSchedule):   # prompt k's re-noising, like its noise, depends on (seed, k)
            fresh = functools.partial(_renoising, noise.shape[1:], seed, chunk_indices, device)
        audio = None if soundtrack is None else soundtrack.start(chunk, chunk_indices, seed, num_frames / fps,
                                                                 negative_prompt, device)
        try:
            latents = denoise(model, flow, noise, y, y_mask, steps=steps, guidance=guidance, ratio=ratio, fps=fps_t,
                              height=height, width=width, given=given, sampler=sampler, negative=negative, fresh=fresh,
                              channels=None if channels is None else channels.expand(n, *channels.shape[1:]),
                              image=None if image is None else image.expand(n, *image.shape[1:]), pooled=pooled,
                              three_way=three_way, condition=condition, audio=audio)
            if audio is not None:
                latents, sound = latents
                require_finite(sound, "the sampled audio latents")
            require_finite(latents, "the sampled latents")
            video = vae.decode(latents, num_frames)                      # [N, 3, T, H, W] in [-1, 1]
            require_finite(video, "the decoded frames")
        except NonFiniteLatents as exc:
            raise NonFiniteLatents(non_finite_message(exc, chunk_indices, prompts, guidance, steps)) from None
        frames = ((video.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        clips = frames.permute(0, 2, 3, 4, 1).cpu().numpy()
        yield (chunk_indices, clips) if audio is None else (chunk_indices, clips, soundtrack.waveforms(sound, num_frames / fps))


def _renoising(shape: tuple[int, ...], seed: int, indices: Sequence[int], device, step: int) -> torch.Tensor:
    """The fresh noise a student's sampler adds after ``step`` to the prompts of ``indices``."""
    return torch.stack([prompt_noise(shape, seed + 1 + step, k) for k in indices]).to(device)


def require_finite(x: torch.Tensor, what: str, step: int | None = None) -> None:
    """Raise :class:`NonFiniteLatents` (its args: what, step, the first bad sample of the batch)
    if ``x`` [N, ...] holds a NaN or an infinity."""
    finite = torch.isfinite(x.reshape(x.shape[0], -1)).all(1)
    if not bool(finite.all()):
        raise NonFiniteLatents(what, step, int((~finite).nonzero()[0, 0]))


def non_finite_message(exc: NonFiniteLatents, indices: list[int], prompts: list[str], guidance: Guidance,
                       steps: int) -> str:
    """One line: which prompt, where it broke, that nothing was written of it, and what to change."""
    what, step, sample = exc.args if len(exc.args) == 3 else (str(exc), None, 0)
    k = indices[sample] if sample < len(indices) else indices[0]
    prompt = prompts[k] if len(prompts[k]) <= 40 else prompts[k][:37] + "..."
    at = f" at step {step} of {steps}" if step is not None else ""
    scale = guidance if isinstance(guidance, (int, float)) else None
    fix = (f"the guidance scale {scale:g} is far too large: lower --cfg (sample.cfg; 3 to 8 is usual)"
           if scale is not None and scale > 20 else
           "the model's weights or config hold NaN or infinite values (a diverged run, or a bad import): sample an "
           "earlier checkpoint (`videodit ckpt list RUN` lists them) or another model")
    return (f"sampling prompt {k} ({prompt!r}) gave NaN or infinite values in {what}{at}, so no clip was written "
            f"for it; {fix}")


def negative_condition(text, negative_prompt: str | None) -> tuple[torch.Tensor, ...] | None:
    """The encoded negative prompt, (y, y_mask), or None without one. An encoder with a pooled
    vector (Open-Sora 2.0's T5 + CLIP) always has one, "" unless set (Open-Sora's sampler encodes
    "" for both unconditional branches, as its training drops captions to ""): (y, y_mask, pooled)."""
    pooled_encoder = getattr(text, "pooled_dim", None) is not None
    if negative_prompt is None and not pooled_encoder:
        return None
    prompt = [negative_prompt or ""]
    y, y_mask = text.encode(prompt)
    return (y, y_mask, text.encode_pooled(prompt)) if pooled_encoder else (y, y_mask)


def prompt_noise(shape: tuple[int, ...], seed: int, index: int) -> torch.Tensor:
    """The starting noise of prompt ``index``, from (``seed``, ``index``) alone: sample k of a
    training run starts from the same noise at every step, so its clips show what the steps changed."""
    mixed = np.random.SeedSequence((seed & (2**64 - 1), index)).generate_state(1, np.uint64)[0]
    return torch.randn(shape, generator=torch.Generator().manual_seed(int(mixed)))


def denoise(model, flow: RectifiedFlow, noise: torch.Tensor, y: torch.Tensor, y_mask: torch.Tensor, *, steps: int,
            guidance: Guidance, ratio: float = 1.0, fps: torch.Tensor | None = None, height=None,
            width=None, given: "GivenFrames | None" = None, sampler: str = "euler",
            negative: tuple[torch.Tensor, torch.Tensor] | None = None,
            channels: torch.Tensor | None = None, image: torch.Tensor | None = None,
            pooled: torch.Tensor | None = None, three_way: ThreeWayGuidance | None = None,
            condition: ReferenceCondition | None = None,
            fresh: Callable[[int], torch.Tensor] | None = None, audio=None) -> torch.Tensor:
    """Latents from ``noise`` [N, C, T, H, W]: Euler steps (``sampler="unipc"``: Wan's UniPC, with
    ``ratio`` its shift; a :class:`StudentSchedule`: a distilled model's few steps, unguided, ``fresh(i)``
    its re-noising after step i) with classifier-free guidance (the unconditional branch is the family's:
    STDiT's learned null caption, or ``negative``, the encoded negative prompt). ``height``/``width``: the clip's pixel size, which Open-Sora's
    position table needs. ``given``: conditioning frames, kept as given at every step and marked
    for the model by ``x_mask``; ``channels``: the given first frame's input channels of an i2v
    model (``Conditions.given``) and ``image`` its image features (``Conditions.image``), both in
    both CFG branches as Wan does; ``pooled``: the prompts' pooled caption vectors
    (``Conditions.pooled``; with them ``negative`` is (y, y_mask, pooled), :func:`negative_condition`);
    ``audio``: LTX-2's audio stream (``ltx2_audio_sampling.AudioSampling``): then (latents, audio tokens)."""
    spec = spec_of(model)
    n = noise.shape[0]
    keep = torch.zeros(n, dtype=torch.bool, device=noise.device)
    x_mask = None if given is None else given.x_mask.expand(n, -1)
    cond = Conditions(y, y_mask, keep, fps, height, width, x_mask, image=image, given=channels, pooled=pooled)
    uncond = spec.unconditional(cond, negative)
    if three_way is not None:
        return denoise_three_way(model, flow, noise, cond, uncond, steps=steps, alpha=ratio, guidance=three_way,
                                 condition=condition)

    step = _StepCounter(steps)   # the step a non-finite value shows up at

    def velocity(conditions):
        def v(x, t, tokens=None, context=None):   # tokens: the audio stream's (both velocities come back)
            step.at(t)
            require_finite(x, "the latents", step.step)   # a guidance scale that overflowed the last step
            if tokens is not None:
                return model(*spec.model_inputs(x, t, dataclasses.replace(conditions, audio=AudioInputs(tokens, t, context))))
            out = model(*spec.model_inputs(x, t, conditions))
            require_finite(out, "the model's output", step.step)
            return flow.model_velocity(out.float(), x, t)
        return v

    if isinstance(sampler, StudentSchedule):
        return sampler.sample(velocity(cond), noise, fresh)
    own = family_sampler(spec)   # a family's own sampler (LTX-2's: its schedule, CFG + STG, first frame)
    if own is not None:
        return own(model, spec, velocity, cond, uncond, noise, steps=steps, guidance=guidance, diffusion=flow.cfg,
                   given=given, **({} if audio is None else {"audio": audio}))
    solve = flow_unipc.sample if sampler == "unipc" else flow.sample
    return solve(velocity(cond), noise, steps, ratio, guidance, velocity(uncond),
                 given=None if given is None else given.put_back)


class _StepCounter:
    """The sampling step of a velocity call: a new timestep is a new step (guidance evaluates the
    model more than once at one timestep)."""

    def __init__(self, steps: int):
        self.steps, self.step, self._t = steps, 0, None

    def at(self, t) -> None:
        value = float(t.reshape(-1)[0]) if isinstance(t, torch.Tensor) else float(t)
        if value != self._t:
            self._t, self.step = value, min(self.step + 1, self.steps)


def takes_condition(model) -> bool:
    """Whether a model takes given frames as input channels (Open-Sora 2.0's ``cond_in``)."""
    return bool(getattr(getattr(model, "geometry", None), "cond_embed", False))


def denoise_three_way(model, flow: RectifiedFlow, noise: torch.Tensor, cond: Conditions, uncond: Conditions, *,
                      steps: int, alpha: float, guidance: ThreeWayGuidance,
                      condition: ReferenceCondition | None = None) -> torch.Tensor:
    """Open-Sora 2.0's sampler (``diffusion/opensora2_sampler.py``) over the branches [prompt and
    given frames, frames only, neither]; with nothing given the last two are one (one call less)."""
    spec = spec_of(model)
    given = None if condition is None else condition.cond.to(noise.device).expand(noise.shape[0], -1, -1, -1, -1)
    branches = [dataclasses.replace(cond, given=given), dataclasses.replace(uncond, given=given)]
    if given is not None:
        branches.append(dataclasses.replace(uncond, given=torch.zeros_like(given)))

    step = _StepCounter(steps)

    def velocities(x, t):
        step.at(t)
        require_finite(x, "the latents", step.step)
        outputs = [model(*spec.model_inputs(x, t, c)) for c in branches]
        for out in outputs:
            require_finite(out, "the model's output", step.step)
        v = [flow.model_velocity(out.float(), x, t) for out in outputs]
        return v[0], v[1], v[-1]

    x = opensora2_sampler.sample(velocities, noise.float(), steps, alpha, guidance)
    return x if condition is None else condition.restore(x)


@dataclass
class GivenFrames:
    """Latent frames that open every clip: ``latents`` [1, C, T, H, W] (zeros after the given
    ones), ``x_mask`` [1, T'] over patched frames (False = given), ``latent_given`` [1, 1, T, 1, 1]."""
    latents: torch.Tensor
    x_mask: torch.Tensor
    latent_given: torch.Tensor

    def put_back(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.latent_given, self.latents.to(x.dtype), x)


def given_latents(model, vae, reference: torch.Tensor, latent_frames: int, device) -> GivenFrames:
    """Encode ``reference`` [3, T_ref, H, W] and place it at the start of a clip of
    ``latent_frames``; only whole patched frames count as given (the rest is generated)."""
    encoded = vae.encode(reference[None].to(device)).float()          # [1, C, T_given, h, w]
    per_patch = spec_of(model).patch_size(model.geometry)[0]
    patched = -(-latent_frames // per_patch)
    given = encoded.shape[2] // per_patch
    if given == 0 or given >= patched:
        raise UserError(f"the reference gives {encoded.shape[2]} of {latent_frames} latent frames; it must give at "
                        "least one whole patched frame and leave some to generate: change --ref-frames or "
                        "--num-frames")
    x_mask = torch.ones(1, patched, dtype=torch.bool, device=device)
    x_mask[:, :given] = False
    latents = torch.zeros(1, encoded.shape[1], latent_frames, *encoded.shape[3:], device=device)
    latents[:, :, :given * per_patch] = encoded[:, :, :given * per_patch]
    latent_given = ~x_mask.repeat_interleave(per_patch, 1)[:, :latent_frames]
    return GivenFrames(latents, x_mask, latent_given[:, None, :, None, None])


def read_reference(path: str, frames: int | None, height: int, width: int,
                   max_pixels: int | None = None, last: bool = False) -> torch.Tensor:
    """The first (``last``: the last) ``frames`` frames of an image or video file (all of an image),
    resized and centre-cropped to ``height`` x ``width``: [3, T_ref, H, W] in [-1, 1].

    A file whose frames (by its header) have more than ``max_pixels`` pixels (default: the
    default of ``data.max_pixels``) is refused before it is decoded; larger frames than needed
    are shrunk as they are read (a JPEG decoded at 1/2..1/8 scale, video frames scaled while
    their colours are converted), never held at full size in RGB."""
    from videodit.data.dataset import clip_tensor
    from videodit.data.video import MAX_PIXELS, FrameTooLarge, VideoReadError, read_video

    limit = MAX_PIXELS if max_pixels is None else max_pixels
    try:
        clip, _ = read_video(path, indices=(lambda total: list(range(total))[-(frames or total):] if last
                                            else list(range(min(frames or total, total)))),
                             max_pixels=limit, fit=(height, width))
    except FrameTooLarge as exc:
        size = f"is {exc.width}x{exc.height} (width x height), {exc.pixels} pixels" if exc.width else \
            f"has {exc.pixels} pixels"
        raise UserError(f"the reference {path!r} {size}, more than the {limit} a reference may have "
                        "(data.max_pixels); shrink it first, e.g. ffmpeg -i IN -vf scale=1280:-2 OUT") from None
    except VideoReadError as exc:
        fix = "" if "; give " in exc.reason else "; give an image or a video file"   # the reason's own fix
        raise UserError(f"cannot read the reference {path!r}: {exc.reason}{fix}") from None
    return clip_tensor(clip, height, width)


def trained_with_frame_masks(cfg, export_info: dict | None = None) -> bool:
    """Whether the model learnt to take given frames (``x_mask``): its run set
    ``diffusion.mask_ratios`` (Open-Sora 1.2's frame masks), or its weights, or the weights its
    run started from (``model.init_from``, a LoRA's base), are Open-Sora 1.2's STDiT3 imported
    with ``videodit ckpt import`` (``export_info``: the folder's export.json) of a release its
    family says was trained with them (``ModelSpec.released_takes_given_frames``)."""
    from videodit.models.families import families

    if cfg.diffusion.mask_ratios is not None or cfg.diffusion.condition_config is not None or \
            cfg.diffusion.first_frame_p:   # LTX-2's first-frame training
        return True
    formats = [(export_info or {}).get("format")]
    if cfg.model.init_from:
        formats.append(_export_format(Path(cfg.model.init_from)))
    return any(spec.released_format in formats and spec.released_takes_given_frames
               for spec in families().values())


def guidance_of(cfg) -> float | Callable[[torch.Tensor], float]:
    """A run's CFG scale: ``sample.cfg``, or for a ``model.expert=both`` run each expert's own
    (``sample.expert_cfg`` = [low, high], else ``sample.cfg`` for both) by time."""
    if cfg.model.expert != "both":
        return cfg.sample.cfg
    low, high = cfg.sample.expert_cfg or (cfg.sample.cfg, cfg.sample.cfg)
    return get_spec(cfg.model.family).expert_guidance(cfg.model.expert_boundary, (low, high))


def expert_boundary(high_cfg, low_cfg, high_path, low_path) -> float:
    """Where two experts trained apart meet: the lower edge of the high-noise run's
    ``diffusion.timestep_range`` ([boundary, 1]), which the low-noise run's (if set) must end at."""
    high_range, low_range = high_cfg.diffusion.timestep_range, low_cfg.diffusion.timestep_range
    if high_range is None or high_range[1] != 1.0 or not 0 < high_range[0] < 1:
        raise UserError(f"{high_path} was not trained as a high-noise expert (its diffusion.timestep_range is "
                        f"{high_range}, not [boundary, 1.0]); pass the high-noise expert's run first")
    boundary = high_range[0]
    if low_range is not None and (low_range[0] != 0.0 or low_range[1] != boundary):
        raise UserError(f"the low-noise expert {low_path} was trained on timesteps {low_range}, which do not meet the "
                        f"high-noise expert's at {boundary}; pass the pair that was trained together")
    if high_cfg.model.family != low_cfg.model.family:
        raise UserError(f"{high_path} and {low_path} are of different model families; pass two experts of one model")
    return boundary


def _export_format(folder: Path) -> str | None:
    """The ``format`` in a model folder's export.json (what ``ckpt import`` read), or None."""
    from videodit.user_files import read_user_json

    try:
        info = read_user_json(folder / "export.json", max_bytes=2**20)
    except (OSError, ValueError):
        return None
    return info.get("format") if isinstance(info, dict) else None


def slug(prompt: str, max_len: int = 48) -> str:
    return re.sub(r"[^a-z0-9]+", "_", prompt.lower()).strip("_")[:max_len] or "prompt"


def clip_name(index: int, count: int, prompt: str, suffix: str = ".mp4") -> str:
    """``07-a_red_circle.mp4``: prompt ``index`` of ``count``, numbered wide enough that the
    files sort in prompt order (two digits at least)."""
    return f"{index:0{max(2, len(str(count - 1)))}d}-{slug(prompt)}{suffix}"


def write_clips(out_dir: Path, prompts: list[str], clips: np.ndarray, fps: float, suffix: str = ".mp4") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (prompt, clip) in enumerate(zip(prompts, clips)):
        path = out_dir / clip_name(i, len(prompts), prompt, suffix)
        write_video(path, clip, fps)
        paths.append(path)
    return paths


def check_student_sampling(student: StudentSchedule, steps: int | None, guidance: float | None) -> None:
    """A distilled model samples with the schedule it was trained on: other steps or guidance are
    refused (30 guided steps of a 4-step student give a blur, not a clip)."""
    if steps not in (None, len(student.steps)) or guidance not in (None, 1.0):
        raise UserError(f"this model was distilled to sample with {student.describe()}; drop --steps and --cfg "
                        "(its schedule is read from the run's distill.* settings)")


def check_sampling(size: dict[str, int], steps: int, guidance: float, image_guidance: float | None = None) -> None:
    """One line for numbers a sampling call cannot use: sizes of 1 to MAX_FRAMES frames and MAX_SIDE
    pixels, 1 to MAX_STEPS steps, guidance scales finite in [0, MAX_GUIDANCE]."""
    problems = []
    if not 1 <= size["num_frames"] <= MAX_FRAMES:
        problems.append(f"{size['num_frames']} frames (1 to {MAX_FRAMES})")
    for side in ("height", "width"):
        if not 1 <= size[side] <= MAX_SIDE:
            problems.append(f"{side} {size[side]} (1 to {MAX_SIDE} pixels)")
    if not 1 <= steps <= MAX_STEPS:
        problems.append(f"{steps} steps (1 to {MAX_STEPS})")
    for name, scale in (("guidance", guidance), ("image guidance", image_guidance)):
        if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)
                                      and 0 <= scale <= MAX_GUIDANCE):
            problems.append(f"{name} {scale} (a finite scale from 0 to {MAX_GUIDANCE:g}; 1 = none)")
    if problems:
        raise UserError(f"cannot sample with {', '.join(problems)}; give values in those ranges")


def soundtrack_of(cfg, text, model, device):
    """The audio stream's sampler of a run that trained it (``model.train_audio``): its audio VAE
    with vocoder; None for a video-only run."""
    from videodit.components import build_audio_encoder, check_audio_model
    from videodit.diffusion.ltx2_audio_sampling import Soundtrack

    if not cfg.model.train_audio:
        return None
    encoder = build_audio_encoder(cfg, device, vocoder=True)
    check_audio_model(model, encoder)
    return Soundtrack(encoder, text, cfg.sample.audio_cfg)


class Pipeline:
    """A trained model with its encoders and config, loaded from a checkpoint for sampling."""

    def __init__(self, ckpt_path: str | Path, device: str = "auto", use_ema: bool = True,
                 low_noise: str | Path | None = None, audio: bool = False):
        """``low_noise``: the low-noise expert's run (or export) when ``ckpt_path`` is the high-noise
        expert of a two-expert model (Wan 2.2 A14B): they switch at the lower edge of the high
        run's ``diffusion.timestep_range``, each guided by its own run's ``sample.cfg``. ``audio``: a
        run that trained the audio stream (``model.train_audio``) samples its soundtrack (default: video only)."""
        from videodit.checkpoint import LoadedCheckpoint
        from videodit.components import build_encoders, build_image_encoder
        from videodit.config import from_yaml
        from videodit.parallel.distributed import pick_device

        ckpt = LoadedCheckpoint(ckpt_path)
        self.cfg = from_yaml(ckpt.config_yaml(), f"the config of {ckpt.path}")
        self.device = pick_device(device)
        self.vae, self.text = build_encoders(self.cfg, self.device)
        self.image_encoder = build_image_encoder(self.cfg, self.device)   # Wan 2.1 I2V's CLIP, else None
        self.model, self.weights = self._load(ckpt, self.cfg, use_ema)
        self.flow = RectifiedFlow(self.cfg.diffusion)
        self.checkpoint = ckpt.path
        guidance = guidance_of(self.cfg)   # two experts trained in one run: each its own scale
        self.expert_guidance = None if isinstance(guidance, float) else guidance
        if low_noise is not None:
            self._add_low_noise_expert(LoadedCheckpoint(low_noise), use_ema)
        # A Wan i2v/ti2v model was trained with an image: it takes a reference natively, one frame;
        # any other model learnt given frames only from frame-mask training.
        self.image_model = getattr(getattr(self.model, "geometry", None), "task", "t2v") != "t2v"
        self.frame_masks = self.image_model or trained_with_frame_masks(self.cfg, getattr(ckpt, "export_info", None))
        self.soundtrack = soundtrack_of(self.cfg, self.text, self.model, self.device) if audio else None

    def _load(self, ckpt, cfg, use_ema: bool):
        """(the model of ``ckpt``, on this device in eval mode, and which weights: "ema" or "model")."""
        from videodit.components import build_model
        from videodit.models import load_pretrained

        stem = "ema" if use_ema and ckpt.has("ema") else "model"
        if ckpt.is_model_folder:   # an export: config.json (the model's arguments) + model.safetensors
            model = load_pretrained(ckpt.path, self.device)
        elif cfg.lora.rank:   # a LoRA run's checkpoint: its adapters (peft) on the base it started from
            from videodit.checkpoint.lora import adapted_model
            model = adapted_model(ckpt, stem)
        else:
            model = build_model(cfg, self.vae, self.text)
            model.load_state_dict(ckpt.tensors(stem))
        return model.to(self.device).eval(), stem

    def _add_low_noise_expert(self, ckpt, use_ema: bool) -> None:
        """Pair this (high-noise) expert with the low-noise one of ``ckpt``, split where the runs'
        timestep ranges meet."""
        from videodit.config import from_yaml

        if self.cfg.model.expert == "both":
            raise UserError(f"{self.checkpoint} holds both experts already (model.expert=both); drop --low-noise-ckpt")
        cfg = from_yaml(ckpt.config_yaml(), f"the config of {ckpt.path}")
        boundary = expert_boundary(self.cfg, cfg, self.checkpoint, ckpt.path)
        low, _ = self._load(ckpt, cfg, use_ema)
        spec = spec_of(self.model)
        self.model = spec.combine_experts(self.model, low, boundary)
        self.expert_guidance = spec.expert_guidance(boundary, (cfg.sample.cfg, self.cfg.sample.cfg))

    def resolve(self, num_frames: int | None = None, height: int | None = None,
                width: int | None = None) -> dict[str, int]:
        """The clip size a call samples: what is given, else ``sample.*``, else ``data.*``."""
        data, sample = self.cfg.data, self.cfg.sample

        def pick(given, *defaults):
            return given if given is not None else next(d for d in defaults if d is not None)
        return {"num_frames": pick(num_frames, sample.num_frames, data.num_frames),
                "height": pick(height, sample.height, data.height), "width": pick(width, sample.width, data.width)}

    def __call__(self, prompts: list[str], **options) -> np.ndarray:
        """Clips for ``prompts``: uint8 [N, T, H, W, 3] (:meth:`batches`, all at once)."""
        return np.concatenate([clips for _, clips, *_ in self.batches(prompts, **options)])

    def batches(self, prompts: list[str], *, num_frames: int | None = None, height: int | None = None,
                width: int | None = None, steps: int | None = None, guidance: float | None = None,
                fps: float | None = None, seed: int = 0, reference: str | None = None,
                reference_frames: int | None = None, ref_mode: str | None = None, reference_end: str | None = None,
                image_guidance: float | None = None, indices: Sequence[int] | None = None, batch_size: int = 16):
        """Clips for ``prompts`` (those of ``indices``, default all), a batch at a time: yields
        (prompt indices, uint8 [n, T, H, W, 3][, soundtracks: with :attr:`soundtrack`]) as each batch is made. ``reference``: an image or video file whose first
        ``reference_frames`` frames (default: an image, the first frame for an image-to-video
        model, or the first half of the clip) open them. A model given frames as input channels
        (Open-Sora 2.0's) takes from it what ``ref_mode`` (default ``sample.ref_mode``) says, the
        i2v_loop's last frame from ``reference_end`` if given, and guides with ``image_guidance``
        (default ``sample.image_cfg``). Every number is checked before anything is sampled."""
        sample = self.cfg.sample
        size = self.resolve(num_frames, height, width)
        student = StudentSchedule.of(self.cfg)   # a distilled model: its own steps, unguided
        if student is not None:
            check_student_sampling(student, steps, guidance)
            steps, guidance = len(student.steps), 1.0
        steps = sample.steps if steps is None else steps
        scale = sample.cfg if guidance is None else guidance
        check_sampling(size, steps, scale, image_guidance)
        if self.expert_guidance is not None and guidance is None:   # two experts: each its own scale
            scale = self.expert_guidance
        fps = fps or sample.fps

        def prepare(chunk: list[str]) -> list[str]:   # per batch: 20,000 prompts start at once
            return prepare_prompts(chunk, sample.prompt_style, sample.aesthetic_score, fps=fps,
                                   motion=sample.motion_score)
        mode, ref_end, three_way = ref_mode or sample.ref_mode, None, None
        if takes_condition(self.model):
            three_way = ThreeWayGuidance(scale, sample.image_cfg if image_guidance is None else image_guidance,
                                         sample.text_oscillation, sample.image_oscillation,
                                         sample.image_cfg_ramp and mode.startswith("i2v"))
        if reference is not None and takes_condition(self.model):
            ref, ref_end = self._condition_reference(reference, reference_end, mode, size)
        else:
            ref = None if reference is None else read_reference(
                reference, reference_frames or (1 if self.image_model else max(1, size["num_frames"] // 2)),
                size["height"], size["width"],
                self.cfg.data.max_pixels)
        if reference is not None and not self.frame_masks:
            print(f"warning: {self.checkpoint} was not trained with frame masks (its diffusion.mask_ratios is "
                  "unset), so it was never taught to continue given frames; the reference is kept as given but "
                  "what follows may not match it (train with diffusion.mask_ratios, e.g. {image_head: 0.1})",
                  file=sys.stderr, flush=True)
        yield from generate_batches(self.model, self.vae, self.text, self.flow, prompts, **size, steps=steps,
                                    guidance=scale, fps=fps, seed=seed, device=self.device, reference=ref,
                                    sampler=student or sample.sampler, negative_prompt=sample.negative_prompt,
                                    image_encoder=self.image_encoder, three_way=three_way, ref_mode=mode,
                                    reference_end=ref_end, indices=indices, prepare=prepare, batch_size=batch_size,
                                    soundtrack=self.soundtrack)

    def _condition_reference(self, path: str, end_path: str | None, mode: str, size: dict):
        """(frames of ``path``, frames of ``end_path`` or None) that ``mode`` takes, as Open-Sora
        2.0 reads its references: the first frame (head), the last (tail; the loop's end from
        ``end_path`` or ``path``), the first / last 32 or 64 (+1 causal) frames (v2v)."""
        read = functools.partial(read_reference, height=size["height"], width=size["width"],
                                 max_pixels=self.cfg.data.max_pixels)
        if mode.startswith("v2v"):
            return read(path, FrameRule.of(self.vae).v2v_pixel_frames(mode), last="tail" in mode), None
        if mode == "i2v_tail":
            return read(end_path or path, 1, last=True), None
        return read(path, 1), (read(end_path or path, 1, last=True) if mode == "i2v_loop" else None)
