"""The audio stream of LTX-2 sampling (a run trained with ``model.train_audio``): what ``sample.py``
adds to a batch so that the DiT generates its soundtrack beside the video, and how the sampled
audio tokens become a waveform. Duck-typed on the encoders (nothing here knows a model class):
the text encoder's ``encode_streams`` (LTX-2's Gemma pass gives the audio stream's text too) and
the audio VAE's ``latent_size``, ``untokens``, ``decode``, ``vocode`` and ``output_sample_rate``
(``models/ltx2/audio_vae.py``, built with its vocoder).

As LTX's pipelines (diffusers' ``LTX2Pipeline``, ltx-pipelines): the audio latents of a clip of
``frames / fps`` seconds are ``round(25 s)`` frames (``latent_size(seconds=...)``), drawn as
Gaussian noise; both streams go through one schedule (``ltx2_sampler.sample_av``), the audio guided
by its own CFG scale (``sample.audio_cfg``, LTX's :data:`AUDIO_CFG` by default); the tokens decode to a mel (audio VAE) and a waveform
(vocoder), which is cut or padded with silence to the clip's length. Prompt k's audio noise, as its
video noise, depends only on (seed, k), from a stream of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from videodit.errors import UserError

AUDIO_CFG = 7.0   # ltx-pipelines' audio guider (DEFAULT_AUDIO_GUIDER_PARAMS) and diffusers' LTX2Pipeline default


@dataclass(frozen=True)
class AudioSampling:
    """One batch's audio stream: its starting noise tokens [N, Ta, C], the prompts' audio-stream
    text [N, L, C'], the negative prompt's [1, L, C'] (None: the dropped caption) and the CFG scale."""
    noise: torch.Tensor
    context: torch.Tensor
    negative: torch.Tensor | None = None
    cfg: float = AUDIO_CFG


def audio_noise(shape: tuple[int, ...], seed: int, index: int) -> torch.Tensor:
    """Prompt ``index``'s audio noise, from (``seed``, ``index``) alone, apart from its video noise."""
    mixed = np.random.SeedSequence((seed & (2**64 - 1), index, 1)).generate_state(1, np.uint64)[0]
    return torch.randn(shape, generator=torch.Generator().manual_seed(int(mixed)))


class Soundtrack:
    """A trained audio stream's sampling: its noise and text per batch (:meth:`start`) and the
    decoding of its tokens to waveforms (:meth:`waveforms`). ``encoder``: the audio VAE with vocoder."""

    def __init__(self, encoder, text, cfg: float = AUDIO_CFG):
        if not hasattr(text, "encode_streams"):
            raise UserError("this run trained the audio stream but its text encoder gives no audio-stream text "
                            "(text.kind=gemma3-ltx2 does); sample with --no-audio")
        if getattr(encoder, "vocoder", None) is None:
            raise UserError("the audio VAE was built without its vocoder; point audio.path to the release file or a "
                            "diffusers LTX-2 folder with vocoder/, or sample with --no-audio")
        self.encoder, self.text, self.cfg = encoder, text, cfg

    def tokens(self, seconds: float) -> int:
        frames = self.encoder.latent_size(seconds=seconds)[0]
        if frames < 1:
            raise UserError(f"a clip of {seconds:.3g} s is too short for a soundtrack (under one audio latent, "
                            "0.04 s); give more --num-frames or sample with --no-audio")
        return frames

    def start(self, prompts: list[str], indices, seed: int, seconds: float, negative_prompt: str | None,
              device) -> AudioSampling:
        """The audio stream of a batch of ``prompts`` (prompt numbers ``indices``) of ``seconds``."""
        shape = (self.tokens(seconds), self.encoder.token_width)
        noise = torch.stack([audio_noise(shape, seed, k) for k in indices]).to(device)
        _, context, _ = self.text.encode_streams(prompts)
        negative = None
        if negative_prompt is not None:
            negative = self.text.encode_streams([negative_prompt])[1].float().to(device)
        return AudioSampling(noise, context.float().to(device), negative, self.cfg)

    @torch.no_grad()
    def waveforms(self, tokens: torch.Tensor, seconds: float) -> list[tuple[np.ndarray, int]]:
        """(waveform float32 [2, samples], sample rate) per clip of sampled ``tokens`` [N, Ta, C]:
        decoded, vocoded, cut or padded with silence to ``seconds``."""
        rate = int(self.encoder.output_sample_rate)
        wave = self.encoder.vocode(self.encoder.decode(self.encoder.untokens(tokens.float())))
        length = round(seconds * rate)
        wave = wave[..., :length]
        if wave.shape[-1] < length:
            wave = torch.nn.functional.pad(wave, (0, length - wave.shape[-1]))
        return [(w.cpu().numpy().astype(np.float32), rate) for w in wave]
