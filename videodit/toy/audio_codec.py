"""The toy world's audio VAE and vocoder (``audio.kind=toy``): weight-free, so a tiny audio-video
model can learn to make sound on a CPU with no file to download.

It takes the log-mel LTX-2's audio VAE takes (``data/audio.py``: stereo, 64 bins, 100 frames a
second) and gives tokens as LTX-2's does, 25 a second:

* **encode**: the two channels averaged (the toy's pan is not judged), normalised to about unit
  scale, and 4 consecutive mel frames folded into one token of 4 x 64 = 256 features (latents
  ``[B, 4, T', 64]``: the frame within the fold is the channel);
* **decode**: the fold undone (``4 T'`` mel frames), the same mel on both channels;
* **vocode**: additive synthesis: a sine at each bin's centre frequency whose amplitude follows
  that bin's mel, divided by the mel a unit sine at that frequency gives (measured once through
  ``log_mel`` itself). A tone comes back at the centre of its bin (within 23 Hz, far closer than the
  toy's pitches are to one another) and a click as a burst of the high bins, so the toy's ears
  (``toy/audio.py``) hear what the mel holds.

The interface is the one the trainer and the sampler use of LTX-2's audio VAE
(``models/ltx2/audio_vae.LTX2AudioVAE``): ``encode``, ``tokens``, ``untokens``, ``decode``,
``vocode``, ``latent_frames``, ``latent_size``, ``token_width``, ``output_sample_rate``.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from videodit.data.audio import HOP_LENGTH, LOG_FLOOR, MEL_BINS, SAMPLE_RATE, log_mel, mel_centres

FOLD = 4                     # mel frames per token: 100 / 4 = 25 tokens a second, as LTX-2's
LOG_MEL_CENTRE, LOG_MEL_SCALE = -6.0, 3.0   # silence (-11.5) -> -1.8; a loud tone (~+2) -> +2.7
_PHASE_SEED = 0


class ToyAudioCodec(nn.Module):
    """Log-mel <-> folded tokens, and mel -> waveform by additive synthesis (module docstring)."""

    in_channels, mel_bins = 2, MEL_BINS
    latent_channels, latent_mel_bins = FOLD, MEL_BINS
    token_width = FOLD * MEL_BINS
    sample_rate = output_sample_rate = SAMPLE_RATE
    hop_length = HOP_LENGTH
    latents_per_second = SAMPLE_RATE / HOP_LENGTH / FOLD
    vocoder = "additive"     # the sampler asks for a vocoder: this codec always has one

    def __init__(self):
        super().__init__()
        self.register_buffer("_anchor", torch.zeros(()), persistent=False)   # gives .to() a device to track

    def train(self, mode: bool = True) -> "ToyAudioCodec":
        return super().train(False)   # frozen, as every encoder

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self._anchor.device

    # ---------------------------------------------------------------- sizes

    def latent_frames(self, mel_frames: int) -> int:
        return -(-int(mel_frames) // FOLD)

    def mel_frames(self, latent_frames: int) -> int:
        return FOLD * int(latent_frames)

    def latent_size(self, *, seconds: float | None = None, mel_frames: int | None = None) -> tuple[int, int]:
        """(latent frames, latent mel bins) of ``mel_frames``, or of ``seconds`` (25 a second)."""
        if (seconds is None) == (mel_frames is None):
            raise ValueError("give exactly one of seconds and mel_frames")
        frames = round(seconds * self.latents_per_second) if seconds is not None else self.latent_frames(mel_frames)
        return frames, self.latent_mel_bins

    # ---------------------------------------------------------------- mel <-> latents <-> waveform

    @torch.no_grad()
    def encode(self, mel: Tensor) -> Tensor:
        """Log-mel ``[B, 2, T, 64]`` -> latents ``[B, 4, ceil(T / 4), 64]`` (the last fold padded with its last frame)."""
        if mel.ndim != 4 or mel.shape[1] != self.in_channels or mel.shape[3] != MEL_BINS:
            raise ValueError(f"the toy audio codec takes a mel [B, 2, T, {MEL_BINS}], got {tuple(mel.shape)}")
        mono = (mel.float().mean(1) - LOG_MEL_CENTRE) / LOG_MEL_SCALE                 # [B, T, 64]
        short = -mono.shape[1] % FOLD
        mono = torch.cat([mono, mono[:, -1:].expand(-1, short, -1)], 1) if short else mono
        return mono.unflatten(1, (-1, FOLD)).permute(0, 2, 1, 3).contiguous()      # [B, 4, T', 64]

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents ``[B, 4, T', 64]`` -> log-mel ``[B, 2, 4 T', 64]``."""
        if latents.ndim != 4 or latents.shape[1] != FOLD or latents.shape[3] != MEL_BINS:
            raise ValueError(f"the toy audio decoder takes latents [B, {FOLD}, T, {MEL_BINS}], got {tuple(latents.shape)}")
        mono = latents.float().permute(0, 2, 1, 3).flatten(1, 2) * LOG_MEL_SCALE + LOG_MEL_CENTRE
        return mono[:, None].expand(-1, 2, -1, -1).contiguous()

    @torch.no_grad()
    def vocode(self, mel: Tensor) -> Tensor:
        """Log-mel ``[B, C, T, 64]`` -> waveform ``[B, 2, T x 160]`` at 16 kHz (module docstring)."""
        if mel.ndim != 4 or mel.shape[3] != MEL_BINS:
            raise ValueError(f"the toy vocoder takes a mel [B, C, T, {MEL_BINS}], got {tuple(mel.shape)}")
        frames = mel.shape[2]
        amplitude = mel.float().mean(1).exp().clamp(max=1e3) / _unit_sine_mel().to(mel.device)   # [B, T, 64]
        samples = frames * HOP_LENGTH
        # mel frame t is centred on sample 160 t (log_mel's centred STFT): interpolate between centres
        envelope = F.interpolate(amplitude.transpose(1, 2), size=samples, mode="linear", align_corners=True)
        wave = (envelope * _carriers(samples).to(mel.device)).sum(1)                   # [B, samples]
        return wave.clamp(-1, 1)[:, None].expand(-1, 2, -1).contiguous()

    def tokens(self, latents: Tensor) -> Tensor:
        """Latents ``[B, 4, T', 64]`` -> the DiT's tokens ``[B, T', 256]``."""
        return latents.permute(0, 2, 1, 3).flatten(2)

    def untokens(self, tokens: Tensor) -> Tensor:
        """Tokens ``[B, T', 256]`` -> latents ``[B, 4, T', 64]``."""
        return tokens.unflatten(2, (FOLD, MEL_BINS)).permute(0, 2, 1, 3)


@functools.lru_cache(maxsize=1)
def _unit_sine_mel() -> Tensor:
    """``[64]``: the mel (linear) each bin reads for a unit sine at its own centre frequency."""
    t = torch.arange(SAMPLE_RATE, dtype=torch.float64) / SAMPLE_RATE
    centres = torch.from_numpy(mel_centres())
    readings = []
    for k, f in enumerate(centres):
        wave = torch.sin(2 * torch.pi * f * t).float().expand(2, -1)
        readings.append(log_mel(wave)[0, 50, k].exp())   # a frame well inside the second
    return torch.stack(readings).clamp_min(LOG_FLOOR)


def _carriers(samples: int) -> Tensor:
    """``[64, samples]``: a sine at each bin's centre, with a fixed random phase each (so a burst over
    many bins sounds as noise, not as one spike)."""
    phases = np.random.default_rng(_PHASE_SEED).uniform(0, 2 * np.pi, MEL_BINS)
    t = torch.arange(samples, dtype=torch.float64) / SAMPLE_RATE
    angles = 2 * torch.pi * torch.from_numpy(mel_centres())[:, None] * t + torch.from_numpy(phases)[:, None]
    return torch.sin(angles).float()
