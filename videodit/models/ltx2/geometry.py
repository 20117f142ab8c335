"""The arguments of an LTX-2 DiT (Lightricks' ``LTXModel``), as one frozen dataclass.

Both releases share one shape: 48 blocks, a video stream (32 heads x 128) and an audio stream
(32 heads x 64). What tells them apart:

- LTX-2.0 (``ltx-2-19b-*``): the text enters the DiT as Gemma's 3840-wide connector output, which
  the DiT projects per stream (``caption_projection``, ``audio_caption_projection``):
  ``caption_channels=3840``.
- LTX-2.3 (``ltx-2.3-22b-*``): the connectors already give each stream its width
  (``caption_channels=None``); every attention has per-head gates (``gated_attention``) and the text
  cross-attention is modulated by the time too (``cross_attention_adaln``: 9 rows of modulation per
  block instead of 6, plus the text keys/values by sigma through ``prompt_adaln_single``).

The release's own configuration (JSON in the safetensors metadata) maps onto these fields in
``release_config.py``. Sizes the released layout cannot express are refused here: both streams
have the same number of heads (ltx-core checks it), and each stream's text context is as wide as
the stream (ltx-core reshapes the context to the stream's width).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from videodit.errors import UserError

# The VAEs' strides, which turn latent positions into pixels and seconds (RoPE's units): the video
# VAE compresses 8 frames x 32 x 32 pixels (its first latent frame holds one pixel frame), the
# audio VAE 4 mel frames of a 16 kHz spectrogram with hop 160 (25 latent frames per second).
VIDEO_SCALE = (8, 32, 32)
AUDIO_SAMPLE_RATE = 16000
AUDIO_HOP = 160
AUDIO_DOWNSAMPLE = 4
CAUSAL_OFFSET = 1
DEFAULT_FPS = 24.0          # ltx-trainer's, when a clip's fps is unknown

# Bounds on sizes read from files or configs: far above any release (48 blocks of 4096), small
# enough that a meta-device build and the shape checks stay cheap, so a header asking for 10^12
# blocks is refused before anything is built.
MAX_LAYERS = 1024
MAX_WIDTH = 1 << 16
MAX_HEADS = 1024
MAX_CHANNELS = 1 << 16


@dataclass(frozen=True)
class LTX2Geometry:
    num_layers: int = 48
    num_heads: int = 32                   # both streams (ltx-core requires equal head counts)
    head_dim: int = 128                   # video
    audio_head_dim: int = 64
    in_channels: int = 128                # video latent channels (patch 1: one latent voxel per token)
    audio_in_channels: int = 128          # audio tokens: 8 latent channels x 16 mel bins
    caption_channels: int | None = 3840   # LTX-2.0's projected text width; None: LTX-2.3 (no projection)
    gated_attention: bool = False         # LTX-2.3's per-head output gates
    cross_attention_adaln: bool = False   # LTX-2.3's modulated text cross-attention
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_pos: tuple[int, int, int] = (20, 2048, 2048)   # seconds, pixels, pixels at which RoPE reaches +1
    audio_max_pos: int = 20                             # seconds
    double_precision_rope: bool = True    # the frequency grid in fp64 (frequencies_precision: float64)
    timestep_scale_multiplier: float = 1000.0
    av_ca_timestep_scale_multiplier: float = 1000.0   # the cross-modal gates' sigma scale (ltx-core's default: 1)

    def __post_init__(self):
        object.__setattr__(self, "max_pos", tuple(self.max_pos))
        for name in ("num_layers", "num_heads", "head_dim", "audio_head_dim", "in_channels", "audio_in_channels",
                     "audio_max_pos"):
            _check_int(name, getattr(self, name), 1, MAX_LAYERS if name == "num_layers" else MAX_WIDTH)
        if self.caption_channels is not None:
            _check_int("caption_channels", self.caption_channels, 1, MAX_CHANNELS)
        if self.num_heads > MAX_HEADS or self.dim > MAX_WIDTH or self.audio_dim > MAX_WIDTH:
            raise UserError(f"LTX-2 widths {self.dim} (video) and {self.audio_dim} (audio) with {self.num_heads} heads "
                            f"exceed videodit's bounds ({MAX_WIDTH} wide, {MAX_HEADS} heads); fix the model config")
        if len(self.max_pos) != 3:
            raise UserError(f"LTX-2 max_pos must be 3 values (seconds, height, width pixels), not {list(self.max_pos)}")
        for value in self.max_pos:
            _check_int("max_pos", value, 1, MAX_CHANNELS)
        for name in ("norm_eps", "rope_theta", "timestep_scale_multiplier", "av_ca_timestep_scale_multiplier"):
            _check_positive(name, getattr(self, name))
        for name in ("gated_attention", "cross_attention_adaln", "double_precision_rope"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"LTX-2 {name} must be true or false, not {getattr(self, name)!r}")
        # RoPE splits the frequencies of the whole width between the heads: each stream's width (and
        # the cross-modal one, the audio width) must split into an even number of values per head.
        if self.head_dim % 2 or self.audio_head_dim % 2:
            raise UserError(f"LTX-2 head sizes must be even for RoPE; head_dim={self.head_dim}, "
                            f"audio_head_dim={self.audio_head_dim} are not")
        for width, axes in ((self.dim, 3), (self.audio_dim, 1)):
            if width // (2 * axes) < 1:
                raise UserError(f"LTX-2 width {width} is too small for RoPE over {axes} axes; fix the model config")

    # ------------------------------------------------------------------ derived sizes

    @property
    def dim(self) -> int:
        """The video stream's width (and its text context's)."""
        return self.num_heads * self.head_dim

    @property
    def audio_dim(self) -> int:
        """The audio stream's width (its text context's, and the cross-modal attentions')."""
        return self.num_heads * self.audio_head_dim

    @property
    def modulation_rows(self) -> int:
        """Rows of each block's modulation table: shift, scale, gate of self-attention and FFN, and
        LTX-2.3's query shift, scale and gate of the text cross-attention."""
        return 9 if self.cross_attention_adaln else 6

    @property
    def version(self) -> str:
        return "2.3" if self.caption_channels is None else "2.0"

    @property
    def mlp_hidden(self) -> int:
        return 4 * self.dim

    @property
    def patch_size(self) -> tuple[int, int, int]:
        return (1, 1, 1)


def _check_int(name: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UserError(f"LTX-2 {name}={value!r} is not an integer in [{low}, {high}]; fix the model config")


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UserError(f"LTX-2 {name}={value!r} is not a finite positive number; fix the model config")


# The released configurations (ltx-core's meta-device build of each counts 18,876,174,592 and
# 18,988,838,144 parameters). The cross-modal gate's sigma scale is the releases' 1000 (diffusers'
# converter); a release file's own metadata is read over it.
LTX2_0 = LTX2Geometry()
LTX2_3 = LTX2Geometry(caption_channels=None, gated_attention=True, cross_attention_adaln=True)
