"""A tiny, randomly initialised stand-in for LTX-2's audio VAE and vocoder, saved as a diffusers
LTX-2 folder (``audio_vae/`` + ``vocoder/``), for tests, benchmarks and the toy: it loads through
``build_ltx2_audio`` like the release's diffusers folder and keeps the release's time axis (16 kHz
mel, hop 160, 25 latent frames a second, 4 x 4 compression), so its tokens fit a tiny LTX-2 DiT
(``audio_in_channels`` = ``latent_channels x mel_bins / 4``: 8 by default, the ``ltx2-tiny`` preset's)."""

from __future__ import annotations

import math
from pathlib import Path

import torch


def _stft_bases(filter_length: int) -> torch.Tensor:
    """A causal STFT's bases as ltx-core stores them: [cos; -sin] rows of a periodic Hann-windowed DFT."""
    n = torch.arange(filter_length, dtype=torch.float64)
    k = torch.arange(filter_length // 2 + 1, dtype=torch.float64)[:, None]
    window = torch.hann_window(filter_length, periodic=True, dtype=torch.float64)
    angle = 2 * math.pi * k * n / filter_length
    return torch.cat([torch.cos(angle), -torch.sin(angle)]).mul(window).float()[:, None]


def save_ltx2_audio_vae(folder: Path, *, base_channels: int = 8, latent_channels: int = 2, mel_bins: int = 16,
                        num_res_blocks: int = 1, hidden_channels: int = 16, bwe: bool = False,
                        seed: int = 0) -> Path:
    """An AutoencoderKLLTX2Audio in ``folder/audio_vae`` and a vocoder in ``folder/vocoder``.

    The VAE: channels ``base_channels x (1, 2, 2)``, ``latent_channels`` x ``mel_bins / 4`` latent
    bins (tokens of their product, which ``base_channels`` must equal: the per-feature statistics),
    statistics 0.1 i / 1 + 0.25 i. The vocoder takes its stereo mel (2 x ``mel_bins`` channels): an
    LTX-2.0-style ``LTX2Vocoder`` (leaky ReLU, 240x to 24 kHz), or with ``bwe`` an LTX-2.3-style
    ``LTX2VocoderWithBWE`` (snake-beta, 160x to 16 kHz, then x3 to 48 kHz over a causal STFT of hop 80)."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2 import LTX2Vocoder, LTX2VocoderWithBWE

    width = latent_channels * (mel_bins // 4)
    if mel_bins % 4 or base_channels != width:
        raise ValueError(f"base_channels={base_channels} must equal latent_channels x mel_bins / 4 = {width} "
                         "(mel_bins a multiple of 4): the statistics are per token feature")
    folder = Path(folder)
    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Audio(base_channels=base_channels, ch_mult=(1, 2, 2), num_res_blocks=num_res_blocks,
                                 latent_channels=latent_channels, mel_bins=mel_bins, mid_block_add_attention=False)
    with torch.no_grad():
        vae.latents_mean.copy_(0.1 * torch.arange(width))
        vae.latents_std.copy_(1 + 0.25 * torch.arange(width))
    vae.save_pretrained(folder / "audio_vae")
    stage = dict(in_channels=2 * mel_bins, hidden_channels=hidden_channels, out_channels=2, resnet_kernel_sizes=[3],
                 resnet_dilations=[[1, 3, 5]])
    if not bwe:
        # 6 x 5 x 8 = 240 samples a mel frame: 24 kHz; kernel - stride even, as the release's
        vocoder = LTX2Vocoder(**stage, upsample_factors=[6, 5, 8], upsample_kernel_sizes=[12, 11, 16],
                              output_sampling_rate=24000)
    else:
        # first stage 5 x 4 x 8 = 160 (16 kHz); the BWE's mel of hop 80 upsampled 6 x 5 x 8 = 240 = 80 x 3 (48 kHz)
        vocoder = LTX2VocoderWithBWE(**stage, upsample_factors=[5, 4, 8], upsample_kernel_sizes=[11, 8, 16],
                                     bwe_in_channels=2 * mel_bins, bwe_hidden_channels=hidden_channels,
                                     bwe_upsample_factors=[6, 5, 8], bwe_upsample_kernel_sizes=[12, 11, 16],
                                     bwe_resnet_kernel_sizes=[3], bwe_resnet_dilations=[[1, 3, 5]],
                                     filter_length=128, hop_length=80, window_length=128, num_mel_channels=mel_bins,
                                     input_sampling_rate=16000, output_sampling_rate=48000)
        with torch.no_grad():   # diffusers starts them at zero (the release's file fills them)
            bases = _stft_bases(128)
            vocoder.mel_stft.stft_fn.forward_basis.copy_(bases)
            vocoder.mel_stft.stft_fn.inverse_basis.copy_(bases)
            vocoder.mel_stft.mel_basis.copy_(torch.rand(mel_bins, 65) / 65)
    vocoder.save_pretrained(folder / "vocoder")
    return folder


__all__ = ["save_ltx2_audio_vae"]
