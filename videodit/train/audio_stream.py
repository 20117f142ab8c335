"""The audio stream of a training step (``model.train_audio``, LTX-2): what the trainer adds to a
video step when both streams train, kept here so the loop stays one loop.

Per micro-batch (:meth:`AudioStream.noised`, called right after the video's draws): the batch's
log-mel (``Batch.audio``) through the frozen audio VAE, each clip cut at its own
``latent_frames(length)``, as the DiT's tokens; the objective's audio sigma, noise, x_t and target
from the batch's generator (ltx-trainer's ``flexible`` order: after the video's); the audio
stream's text (the text encoder's ``encode_streams``). The model gets them as
``Conditions.audio``. Its loss (:meth:`AudioStream.loss`): ltx-trainer's, per sample the video's
masked MSE plus the audio's, averaged over the batch; a clip without a soundtrack
(``Batch.audio_mask`` False: silence) is fed as silence and contributes no audio loss. The step's
audio loss is logged as ``audio_loss``.

LTX-2's audio stream has no padding mask: every clip of a batch must give the same number of audio
tokens (a bucket's clips of one frame rate do); a batch mixing lengths is refused in one line.
The target and mask of the micro-batch in flight are held here between ``noised`` and the loss
(the parallel layer hands the loss the video target alone). Under pipeline parallelism the parallel
layer takes them (:meth:`AudioStream.extra_targets`) and its schedule cuts them with the video's
target, so that the last stage's loss gets each micro-batch's own as keywords
(``models/ltx2/stage.py`` carries the audio stream through the stages).

With ``data.cache`` the cache stores each clip's audio latents and the audio stream's caption tokens
(data/feature_cache/audio.py): no audio VAE is built (its stand-in gives the token layout and width)
and a cached batch (``CachedBatch.audio_latents``) is read in place of encoding; a cache without
them is refused in one line naming ``videodit cache build``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from videodit.components import build_audio_encoder, check_audio_model, check_audio_training
from videodit.data.feature_cache.audio import CachedAudioEncoder, require_audio
from videodit.data.feature_cache.format import read_manifest
from videodit.errors import UserError
from videodit.models.spec import AudioInputs


class AudioStream:
    """The audio VAE, the text encoder's audio stream and the objective's audio draws and loss of a
    ``model.train_audio`` run (module docstring)."""

    def __init__(self, encoder, text, objective, device: torch.device, grad_accum: int = 1):
        self.encoder, self.text, self.objective, self.device = encoder, text, objective, device
        self.grad_accum = grad_accum
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None   # (target, loss mask) of the micro-batch
        self.batch = 0   # the samples of the micro-batch in flight
        self.losses: list[torch.Tensor] = []   # the last step's micro-batches' audio losses (detached)

    @classmethod
    def of(cls, cfg, text, objective, device: torch.device) -> "AudioStream | None":
        """The audio stream of a ``model.train_audio`` run (None otherwise), refused in one line
        where the run cannot train it."""
        check_audio_training(cfg)
        if not cfg.model.train_audio:
            return None
        cannot = [(cfg.distill.method, f"distill.method={cfg.distill.method}"),
                  (cfg.diffusion.mask_ratios is not None, "diffusion.mask_ratios (Open-Sora 1.2's frame masks)"),
                  (not cfg.data.cache and not hasattr(text, "encode_streams"),   # a cache stores its result
                   f"text.kind={cfg.text.kind} (it gives no audio-stream text; text.kind=gemma3-ltx2 does)")]
        for refused, why in cannot:
            if refused:
                raise UserError(f"model.train_audio does not run with {why}; set model.train_audio=false or drop that")
        if not hasattr(objective, "noised_audio"):
            raise UserError(f"model.train_audio: the {cfg.model.family} objective has no audio stream")
        encoder = _cached_audio_encoder(cfg.data.cache) if cfg.data.cache else build_audio_encoder(cfg, device)
        return cls(encoder, text, objective, device, cfg.train.grad_accum)

    # ------------------------------------------------------------------ a micro-batch

    def tokens(self, batch) -> torch.Tensor:
        """The clean audio tokens [B, Ta, C] of the batch's mel, each clip cut at its own length (a
        cached batch: its stored latents)."""
        if getattr(batch, "audio_latents", None) is not None:
            _one_length({int(n) for n in batch.audio_frames})
            latents = batch.audio_latents[:, :, :int(batch.audio_frames[0])].to(self.device, non_blocking=True)
            return self.encoder.tokens(latents).contiguous()
        if getattr(batch, "audio", None) is None:
            raise UserError("model.train_audio: the batch carries no soundtracks (the loader was built without audio)")
        lengths = [int(n) for n in batch.audio_lengths]
        _one_length({self.encoder.latent_frames(n) for n in lengths})
        mel = batch.audio.to(self.device, non_blocking=True)
        if len(set(lengths)) == 1:
            latents = self.encoder.encode(mel[:, :, :lengths[0]])
        else:   # equal latent lengths from unequal mels: each clip encoded alone, as LTX encodes it
            latents = torch.cat([self.encoder.encode(mel[i:i + 1, :, :n]) for i, n in enumerate(lengths)])
        return self.encoder.tokens(latents).contiguous()

    def noised(self, batch, generator: torch.Generator, encoding=contextlib.nullcontext) -> AudioInputs:
        """The audio stream's inputs of one micro-batch (module docstring); its target and loss mask
        wait here for the loss (:meth:`loss_fn`). ``encoding``: the frozen encoders' context (bf16 autocast)."""
        with torch.no_grad(), encoding():
            tokens = self.tokens(batch).float()
            cached = getattr(batch, "audio_context", None)
            context = cached.to(self.device, non_blocking=True) if cached is not None else \
                self.text.encode_streams(batch.text)[1]
        drawn = self.objective.noised_audio(tokens, generator)
        present = batch.audio_mask.to(self.device, non_blocking=True)
        self.pending = (drawn.target, present[:, None].expand(tokens.shape[:2]))
        self.batch = tokens.shape[0]
        return AudioInputs(drawn.x_t, drawn.sigma, context.float())

    def loss_fn(self, model):
        """The training loss of both streams, for ``parallelize``: (model output (video, audio), x_t,
        t, video target, x_mask) -> the batch mean of ltx-trainer's per-sample video + audio loss;
        a pipeline's last stage passes each micro-batch's audio target and mask as keywords
        (:meth:`extra_targets`). ``model`` must take the audio VAE's tokens (one line if not)."""
        check_audio_model(model, self.encoder)

        def both(output, x_t, t, target, x_mask=None, audio_target=None, audio_mask=None):
            if audio_target is None:   # not through a pipeline: the micro-batch's, waiting here
                taken = self.extra_targets()
                audio_target, audio_mask = taken["audio_target"], taken["audio_mask"]
            video, audio = output
            total, audio_loss = self.objective.joint_losses(video, target, x_mask, audio, audio_target, audio_mask)
            pieces = self.batch // len(audio)   # a pipeline's loss sees each micro-batch in pieces
            self.losses = (self.losses + [audio_loss.detach().mean()])[-self.grad_accum * pieces:]
            return total.mean()
        both.extra_targets = self.extra_targets
        return both

    def extra_targets(self) -> dict[str, torch.Tensor]:
        """The audio target and loss mask of the micro-batch in flight, taken (each serves one loss),
        as the loss's keywords."""
        if self.pending is None:
            raise RuntimeError("the audio stream's loss without its noised inputs")
        (target, mask), self.pending = self.pending, None
        return {"audio_target": target, "audio_mask": mask}

    def metrics(self, ctx) -> dict:
        """``audio_loss``: the last step's audio loss (its micro-batches' mean, over the ranks; a
        pipeline's last stage alone computes it); a collective, as the step's other metrics."""
        local = float(torch.stack(self.losses).mean()) if self.losses else 0.0
        if ctx.dims.pp > 1:
            local = ctx.sum_over("pp", local)
        return {"audio_loss": ctx.mean(local)}


def _one_length(frames: set[int]) -> None:
    """Refuse, in one line, a batch whose clips give different numbers of audio latent frames."""
    if len(frames) > 1:
        raise UserError(f"model.train_audio: a batch holds soundtracks of {' and '.join(map(str, sorted(frames)))} "
                        "latent frames; LTX-2's audio stream has no padding mask, so a batch takes clips of one "
                        "length: give the clips of a bucket one frame rate, or use train.batch_size=1")


def _cached_audio_encoder(folder: str) -> CachedAudioEncoder:
    """The audio VAE's stand-in of an audio cache (refused in one line: a cache without audio latents)."""
    manifest = read_manifest(Path(folder))
    require_audio(manifest, folder)
    return CachedAudioEncoder(manifest)
