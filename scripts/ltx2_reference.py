"""Import Lightricks' LTX-2 code (a checkout of Lightricks/LTX-2) on a CPU machine, for the fixture
script ``scripts/make_ltx2_fixtures.py``. Never imported by videodit or its tests.

ltx-core is pure PyTorch (its flash-attention imports sit in try/except) and needs einops and
numpy. Its transformer is built from a release's metadata configuration by
``LTXModelConfigurator.from_metadata`` with PyTorch's SDPA as the attention (``PytorchAttention``
pinned to the math kernel, deterministic on every CPU), and called on its ``Modality`` inputs
(per-token timesteps, positions in seconds and pixels as ltx-trainer builds them).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

# The values ltx-core's configurator checks (``check_config_value``): a release's metadata
# carries them all, so a config without them is not one it builds.
CHECKED = dict(dropout=0.0, attention_bias=True, num_vector_embeds=None, activation_fn="gelu-approximate",
               num_embeds_ada_norm=1000, use_linear_projection=False, only_cross_attention=False,
               cross_attention_norm=True, double_self_attention=False, upcast_attention=False,
               standardization_norm="rms_norm", norm_elementwise_affine=False, qk_norm="rms_norm",
               positional_embedding_type="rope", use_audio_video_cross_attention=True, share_ff=False,
               av_cross_ada_norm=True, use_middle_indices_grid=True)


def import_ltx_core(checkout: str | Path):
    """The ltx_core package of a Lightricks/LTX-2 checkout (``packages/ltx-core/src``)."""
    src = Path(checkout) / "packages" / "ltx-core" / "src"
    if not (src / "ltx_core").is_dir():
        raise SystemExit(f"{checkout} is not a Lightricks/LTX-2 checkout (no packages/ltx-core/src/ltx_core)")
    sys.path.insert(0, str(src))
    import ltx_core
    return ltx_core


def transformer_config(**sizes) -> dict:
    """A release's ``config["transformer"]`` of the given sizes (the checked values added)."""
    return {**CHECKED, **sizes}


def build_model(config: dict, checkout: str | Path, video_only: bool = False):
    """ltx-core's LTXModel (or its video-only build) of a metadata ``{"transformer": ...}`` config,
    attention through SDPA's math kernel; off the meta device its tensors hold no set values (and
    ltx-core leaves its tables uninitialised anyway): randomise them."""
    import_ltx_core(checkout)
    from torch.nn.attention import SDPBackend

    from ltx_core.model.transformer.attention import PytorchAttention
    from ltx_core.model.transformer.model_configurator import (LTXModelConfigurator,
                                                               LTXVideoOnlyModelConfigurator)
    from ltx_core.model.transformer.transformer import TransformerOpsConfig

    sdpa = PytorchAttention(priority=[SDPBackend.MATH])
    ops = TransformerOpsConfig.from_functions(attention=sdpa, masked_attention=sdpa)
    configurator = LTXVideoOnlyModelConfigurator if video_only else LTXModelConfigurator
    model = configurator.from_metadata({"config": config}, ops=ops)
    if torch.empty(0).device.type != "meta" and any(p.is_meta for p in model.parameters()):
        # ltx-core builds the 2.0 caption projections on the meta device (a loader fills them):
        # give every tensor storage; the caller randomises them all anyway.
        model.to_empty(device="cpu")
    return model


def modality(checkout, *, latent, sigma, timesteps, positions, context, context_mask=None):
    import_ltx_core(checkout)
    from ltx_core.model.transformer.modality import Modality
    return Modality(latent=latent, sigma=sigma, timesteps=timesteps, positions=positions, context=context,
                    context_mask=context_mask)


def video_positions(checkout, frames: int, height: int, width: int, batch: int, fps: float) -> torch.Tensor:
    """[B, 3, T, 2] as ltx-trainer's ``_get_video_positions`` builds them."""
    import_ltx_core(checkout)
    from ltx_core.components.patchifiers import VideoLatentPatchifier, get_pixel_coords
    from ltx_core.types import SpatioTemporalScaleFactors, VideoLatentShape
    coords = VideoLatentPatchifier(patch_size=1).get_patch_grid_bounds(
        VideoLatentShape(frames=frames, height=height, width=width, batch=batch, channels=128))
    pixels = get_pixel_coords(coords, SpatioTemporalScaleFactors.default(), causal_fix=True).float()
    pixels[:, 0, ...] = pixels[:, 0, ...] / fps
    return pixels


def audio_positions(checkout, tokens: int, batch: int) -> torch.Tensor:
    """[B, 1, T, 2] as ltx-trainer's ``_get_audio_positions`` builds them."""
    import_ltx_core(checkout)
    from ltx_core.components.patchifiers import AudioPatchifier
    from ltx_core.types import AudioLatentShape
    return AudioPatchifier(patch_size=1).get_patch_grid_bounds(
        AudioLatentShape(frames=tokens, mel_bins=16, batch=batch, channels=8))


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, F, H, W] -> [B, F*H*W, C] (ltx-core's VideoLatentPatchifier at patch 1)."""
    return latents.flatten(2).transpose(1, 2)


def meta_parameter_count(config: dict, checkout: str | Path) -> int:
    """The parameters of ltx-core's own meta-device build of a configuration."""
    with torch.device("meta"):
        model = build_model(config, checkout)
    return sum(p.numel() for p in model.parameters())
