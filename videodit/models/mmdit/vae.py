"""Open-Sora 2.0's autoencoders: the family's VAE factory (``ModelSpec.build_vae`` calls it).

* ``vae.kind=hunyuan``: HunyuanVideo's causal VAE (16 channels, 4x8x8), Open-Sora's
  ``hunyuan_vae.safetensors`` or a diffusers ``AutoencoderKLHunyuanVideo`` folder
  (``models/mmdit/hunyuan_vae.py``);
* ``vae.kind=opensora-dc-ae``: Open-Sora's Video DC-AE ``dc-ae-f32t4c128`` (128 channels,
  4x32x32, not causal), ``F32T4C128_AE.safetensors`` (``models/mmdit/dc_ae_vae.py``).

Weights are read with safetensors only (never unpickled) and loaded strictly: a missing or
unexpected tensor is a one-line error naming it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from videodit.errors import UserError
from videodit.models.mmdit.vae_files import RELEASE_FILES

VAE_KINDS = ("hunyuan", "opensora-dc-ae")


def build_opensora2_vae(kind: str, path, subfolder=None, *, scaling_factor=None, micro_batch: int = 16,
                        temporal_micro_batch: int = 4, dtype: torch.dtype = torch.float32,
                        sample_posterior: bool = False):
    """The frozen adapter ``vae.kind=kind`` names (one of :data:`VAE_KINDS`), from ``path``
    joined with ``subfolder``. ``scaling_factor`` replaces the release's (hunyuan: latents =
    factor * posterior; opensora-dc-ae: latents = encoder output / factor, as Open-Sora writes
    both). ``sample_posterior`` (hunyuan only): latents are a posterior sample, as in Open-Sora's
    training, instead of its mode. ``temporal_micro_batch`` is not used by these VAEs."""
    del temporal_micro_batch
    if kind not in VAE_KINDS:
        raise UserError(f"vae.kind={kind!r} is not an Open-Sora 2.0 autoencoder; choose one of: {', '.join(VAE_KINDS)}")
    if path is None or not str(path).strip():
        raise UserError(f"vae.path is required for vae.kind={kind}: point it to Open-Sora 2.0's {RELEASE_FILES[kind]}"
                        + (" or to a diffusers AutoencoderKLHunyuanVideo folder" if kind == "hunyuan" else "")
                        + " (nothing is downloaded)")
    target = Path(path).expanduser() / (subfolder or "")
    where = f"vae.path='{path}'" + (f" (vae.subfolder='{subfolder}')" if subfolder else "")
    if kind == "hunyuan":
        from videodit.models.mmdit.hunyuan_vae import build_hunyuan_vae
        return build_hunyuan_vae(target, where, scaling_factor=scaling_factor, micro_batch=micro_batch, dtype=dtype,
                                 sample_posterior=sample_posterior)
    if sample_posterior:
        raise UserError("vae.sample_posterior=true does not apply to vae.kind=opensora-dc-ae (the DC-AE is a plain "
                        "autoencoder: it has no posterior); set it to false")
    from videodit.models.mmdit.dc_ae_vae import build_dc_ae
    return build_dc_ae(target, where, scaling_factor=scaling_factor, micro_batch=micro_batch, dtype=dtype)


__all__ = ["VAE_KINDS", "build_opensora2_vae"]
