"""The sample clips a run writes as it trains (every ``train.sample_every`` steps and at the end):
mp4s in ``samples/step-N/``, handed to the loggers (TensorBoard, W&B) too.

They are sampled with the run's ``sample.*`` settings, each prompt from noise that depends only on
(``train.seed``, its index), so the clips of successive steps start from the same noise. A run that
trains LTX-2's audio stream (``model.train_audio``) samples each clip's soundtrack beside it, as
``videodit sample`` of its checkpoint does (``sample.soundtrack_of``), and the mp4 carries it (AAC).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from videodit.data.video_write import audio_codec, write_video
from videodit.distill.collapse import collapse_metrics
from videodit.distill.schedule import StudentSchedule
from videodit.errors import UserError
from videodit.sample import clip_name, generate_batches, guidance_of, soundtrack_of, write_clips
from videodit.train.metrics import MetricsLogger

Sound = tuple[np.ndarray, int]   # (waveform float [channels, samples], sample rate)


class TrainingSamples:
    """Writes a step's sample clips; built once per run (a soundtrack's audio VAE and vocoder are
    built on the first write and kept). ``takes_image``: an i2v model, which has no image to start
    from here."""

    def __init__(self, cfg, run_dir: Path, vae, text, flow, device, *, takes_image: bool, is_main: bool):
        self.cfg, self.run_dir = cfg, run_dir
        self.vae, self.text, self.flow, self.device = vae, text, flow, device
        self.takes_image, self.is_main = takes_image, is_main
        self._soundtrack = None
        self._silent = False   # the soundtrack could not be built: clips go on without it (said once)

    def write(self, step: int, eval_model: Callable, metrics: MetricsLogger | None = None) -> list[Path]:
        """The clips of ``step`` as mp4s, also handed to ``metrics``'s loggers. ``eval_model``: the
        model to sample with on rank 0, None elsewhere (gathering it is a collective: every rank calls
        this)."""
        cfg = self.cfg
        if cfg.data.cache:   # no VAE or text encoder was built
            if self.is_main:
                print("no sample videos: training from data.cache builds no VAE or text encoder; sample with "
                      f"`videodit sample --ckpt {self.run_dir}`", flush=True)
            return []
        if self.takes_image:
            if self.is_main:
                print("no sample videos: an i2v model generates from an image; sample with "
                      f"`videodit sample --ckpt {self.run_dir} --ref IMAGE`", flush=True)
            return []
        model = eval_model()
        if model is None:
            return []
        student = StudentSchedule.of(cfg)   # a distilled model samples with its own few steps, unguided
        sample = functools.partial(self._sample, model, student, self._soundtrack_for(model))
        clips, sounds = sample(cfg.train.seed)
        sounds = None if sounds is None else [finite_or_none(sound, k, step) for k, sound in enumerate(sounds)]
        paths = write_step_clips(self.run_dir / "samples" / f"step-{step:07d}", cfg.sample.prompts, clips,
                                 cfg.sample.fps, sounds)
        if metrics is not None:
            metrics.log_samples(step, cfg.sample.prompts, clips, paths, cfg.sample.fps, sounds)
            if student:   # DMD's mode seeking shows as seeds that agree and clips that stand still
                metrics.log(step, collapse_metrics(clips, sample(cfg.train.seed + 1)[0]))
        return paths

    def _sample(self, model, student: StudentSchedule | None, soundtrack, seed: int
                ) -> tuple[np.ndarray, list[Sound] | None]:
        """(uint8 clips [N, T, H, W, 3], a soundtrack per clip or None without a ``soundtrack``)."""
        cfg = self.cfg
        batches = list(generate_batches(
            model, self.vae, self.text, self.flow, cfg.sample.prompts,
            num_frames=cfg.sample.num_frames or cfg.data.num_frames, height=cfg.sample.height or cfg.data.height,
            width=cfg.sample.width or cfg.data.width, steps=len(student.steps) if student else cfg.sample.steps,
            guidance=1.0 if student else guidance_of(cfg), fps=cfg.sample.fps, seed=seed, device=self.device,
            sampler=student or cfg.sample.sampler, negative_prompt=cfg.sample.negative_prompt, soundtrack=soundtrack))
        clips = np.concatenate([batch[1] for batch in batches])
        return clips, None if soundtrack is None else [sound for batch in batches for sound in batch[2]]

    def _soundtrack_for(self, model):
        """The audio stream's sampler (None for a video-only run). Training needs neither the vocoder
        nor an audio encoder in PyAV, so a run without one writes silent clips rather than stopping."""
        if self._soundtrack is None and not self._silent:
            try:
                self._soundtrack = soundtrack_of(self.cfg, self.text, model, self.device)
                if self._soundtrack is not None:
                    audio_codec()   # refused here, not after the clips were sampled
            except UserError as exc:
                self._soundtrack, self._silent = None, True
                print(f"warning: the sample clips are written without sound: {exc}", file=sys.stderr, flush=True)
        return self._soundtrack


def finite_or_none(sound: Sound, index: int, step: int) -> Sound | None:
    """A soundtrack the vocoder made NaN or infinite is dropped (its clip written silent), not the run."""
    if np.isfinite(sound[0]).all():
        return sound
    print(f"warning: sample clip {index} of step {step}: its soundtrack is not finite; written without sound",
          file=sys.stderr, flush=True)
    return None


def write_step_clips(out_dir: Path, prompts: list[str], clips: np.ndarray, fps: float,
                     sounds: list[Sound | None] | None) -> list[Path]:
    """``sample.write_clips``, each clip with its soundtrack where it has one."""
    if sounds is None:
        return write_clips(out_dir, prompts, clips, fps)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / clip_name(k, len(prompts), prompt) for k, prompt in enumerate(prompts)]
    for path, clip, sound in zip(paths, clips, sounds):
        write_video(path, clip, fps, audio=sound)
    return paths
