"""LTX-2 configurations in and out: the release's (JSON under ``config`` in the safetensors metadata,
its ``transformer`` section, as ltx-core's ``LTXModelConfigurator`` reads it) and diffusers'
(``LTX2VideoTransformer3DModel``'s config.json).

Every value read is checked for type and range before anything is built (a config asking for
10^12 layers or a NaN epsilon is one line naming the key); values that describe a model videodit
does not build (another RoPE type, LTX-2.5's keyframe embedding or bias-free FFN, a patch above
1) are refused by name. Absent keys take the reader's defaults: ltx-core's for the release,
diffusers' for its folders.
"""

from __future__ import annotations

import math
from videodit.errors import UserError
from videodit.models.ltx2.geometry import (AUDIO_DOWNSAMPLE, AUDIO_HOP, AUDIO_SAMPLE_RATE, CAUSAL_OFFSET, MAX_HEADS,
                                           MAX_LAYERS, MAX_WIDTH, VIDEO_SCALE, LTX2Geometry)

# What ltx-core's configurator insists on (``check_config_value``: the value, or None when absent).
LTX_CHECKED = dict(dropout=0.0, attention_bias=True, num_vector_embeds=None, activation_fn="gelu-approximate",
                   num_embeds_ada_norm=1000, use_linear_projection=False, only_cross_attention=False,
                   cross_attention_norm=True, double_self_attention=False, upcast_attention=False,
                   standardization_norm="rms_norm", norm_elementwise_affine=False, qk_norm="rms_norm",
                   positional_embedding_type="rope", use_audio_video_cross_attention=True, share_ff=False,
                   av_cross_ada_norm=True, use_middle_indices_grid=True)
# Beyond 2.3 (LTX-2.5 and later): values of models videodit does not build, with the reason.
LTX_UNSUPPORTED = dict(use_prompt_adaln_single=(True, "KV-cacheable text attention (LTX-2.5)"),
                       ff_bias=(True, "a video FFN without biases (LTX-2.5)"),
                       audio_ff_bias=(True, "an audio FFN without biases"),
                       use_keyframes_abs_pos_embedding=(False, "the keyframe embedding (LTX-2.5)"),
                       rope_type=("split", "interleaved RoPE (pre-release LTX-2)"))


class _Reader:
    """Typed, bounded reads of one config dict, errors naming the file and the key."""

    def __init__(self, config: dict, where: str):
        if not isinstance(config, dict):
            raise UserError(f"{where} is not a JSON object; restore the original file")
        self.config, self.where = config, where

    def fail(self, key: str, what: str):
        value = repr(self.config.get(key))
        raise UserError(f"{self.where}: {key}={value[:60]} {what}; restore the original file or export it again")

    def int(self, key: str, default: int, high: int = MAX_WIDTH, low: int = 1) -> int:
        value = self.config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            self.fail(key, f"is not an integer in [{low}, {high}]")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            self.fail(key, "is not a finite positive number")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.config.get(key, default)
        if not isinstance(value, bool):
            self.fail(key, "is not true or false")
        return value

    def ints(self, key: str, default: list[int], length: int) -> tuple[int, ...]:
        value = self.config.get(key, default)
        if not isinstance(value, (list, tuple)) or len(value) != length or not all(
                isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_WIDTH for v in value):
            self.fail(key, f"is not a list of {length} positive integers")
        return tuple(value)

    def equal(self, key: str, expected, default, what: str):
        if self.config.get(key, default) != expected:
            self.fail(key, f"is not {expected!r}: {what}, which videodit does not build")


# ----------------------------------------------------------------------------- the release

def geometry_from_release(config: dict, where: str) -> LTX2Geometry:
    """The geometry of a release's metadata ``config`` (its ``transformer`` section)."""
    if not isinstance(config, dict) or not isinstance(config.get("transformer"), dict):
        raise UserError(f"{where}: the metadata config has no transformer section; pass an LTX-2 release file")
    r = _Reader(config["transformer"], f"{where} (metadata config.transformer)")
    for key, expected in LTX_CHECKED.items():
        if r.config.get(key) != expected:   # as ltx-core: absent counts as None
            r.fail(key, f"is not {expected!r}, as ltx-core requires")
    for key, (expected, what) in LTX_UNSUPPORTED.items():
        r.equal(key, expected, expected, what)
    heads = r.int("num_attention_heads", 32, MAX_HEADS)
    if r.int("audio_num_attention_heads", 32, MAX_HEADS) != heads:
        r.fail("audio_num_attention_heads", "differs from num_attention_heads (ltx-core requires them equal)")
    head_dim, audio_head_dim = r.int("attention_head_dim", 128), r.int("audio_attention_head_dim", 64)
    in_channels, audio_in = r.int("in_channels", 128), r.int("audio_in_channels", 128)
    _same(r, "out_channels", in_channels, 128)
    _same(r, "audio_out_channels", audio_in, 128)
    _same(r, "cross_attention_dim", heads * head_dim, 4096)
    _same(r, "audio_cross_attention_dim", heads * audio_head_dim, 2048)
    caption = None
    if not r.bool("caption_proj_before_connector", False):   # LTX-2.0: the DiT projects the text
        caption = r.int("caption_channels", 3840)
    precision = r.config.get("frequencies_precision", False)
    if precision not in (False, None, "float32", "float64"):
        r.fail("frequencies_precision", "is not float32 or float64")
    return _geometry(r, num_layers=r.int("num_layers", 48, MAX_LAYERS), num_heads=heads, head_dim=head_dim,
                     audio_head_dim=audio_head_dim, in_channels=in_channels, audio_in_channels=audio_in,
                     caption_channels=caption, gated_attention=r.bool("apply_gated_attention", False),
                     cross_attention_adaln=r.bool("cross_attention_adaln", False),
                     norm_eps=r.number("norm_eps", 1e-6), rope_theta=r.number("positional_embedding_theta", 10000.0),
                     max_pos=r.ints("positional_embedding_max_pos", [20, 2048, 2048], 3),
                     audio_max_pos=r.ints("audio_positional_embedding_max_pos", [20], 1)[0],
                     double_precision_rope=precision == "float64",
                     timestep_scale_multiplier=r.number("timestep_scale_multiplier", 1000),
                     av_ca_timestep_scale_multiplier=r.number("av_ca_timestep_scale_multiplier", 1))


def release_config(g: LTX2Geometry) -> dict:
    """The metadata ``config`` of a release file holding this DiT (what ltx-core builds it from)."""
    transformer = {**LTX_CHECKED, **{k: expected for k, (expected, _) in LTX_UNSUPPORTED.items()},
                   "num_attention_heads": g.num_heads, "attention_head_dim": g.head_dim,
                   "audio_num_attention_heads": g.num_heads, "audio_attention_head_dim": g.audio_head_dim,
                   "in_channels": g.in_channels, "out_channels": g.in_channels,
                   "audio_in_channels": g.audio_in_channels, "audio_out_channels": g.audio_in_channels,
                   "num_layers": g.num_layers, "cross_attention_dim": g.dim, "audio_cross_attention_dim": g.audio_dim,
                   "norm_eps": g.norm_eps, "positional_embedding_theta": g.rope_theta,
                   "positional_embedding_max_pos": list(g.max_pos), "audio_positional_embedding_max_pos": [g.audio_max_pos],
                   "timestep_scale_multiplier": _plain(g.timestep_scale_multiplier),
                   "av_ca_timestep_scale_multiplier": _plain(g.av_ca_timestep_scale_multiplier),
                   "frequencies_precision": "float64" if g.double_precision_rope else "float32",
                   "apply_gated_attention": g.gated_attention, "cross_attention_adaln": g.cross_attention_adaln,
                   "caption_proj_before_connector": g.caption_channels is None}
    if g.caption_channels is not None:
        transformer["caption_channels"] = g.caption_channels
    return {"transformer": transformer}


# ----------------------------------------------------------------------------- diffusers

DIFFUSERS_CLASS = "LTX2VideoTransformer3DModel"
# diffusers' settings for what videodit's model fixes (patch 1, the VAEs' strides, ...), with the
# class's own defaults for absent keys.
_DIFFUSERS_FIXED = dict(patch_size=(1, 1), patch_size_t=(1, 1), audio_patch_size=(1, 1), audio_patch_size_t=(1, 1),
                        vae_scale_factors=(list(VIDEO_SCALE), [8, 32, 32]), audio_scale_factor=(AUDIO_DOWNSAMPLE, 4),
                        audio_sampling_rate=(AUDIO_SAMPLE_RATE, 16000), audio_hop_length=(AUDIO_HOP, 160),
                        causal_offset=(CAUSAL_OFFSET, 1), activation_fn=("gelu-approximate", "gelu-approximate"),
                        qk_norm=("rms_norm_across_heads", "rms_norm_across_heads"),
                        norm_elementwise_affine=(False, False), attention_bias=(True, True),
                        attention_out_bias=(True, True), rope_type=("split", "interleaved"), ff_bias=(True, True),
                        audio_ff_bias=(True, True), use_prompt_adaln_single=(True, True),
                        use_keyframes_abs_pos_embedding=(False, False))


def geometry_from_diffusers(config: dict, where: str) -> LTX2Geometry:
    r = _Reader(config, where)
    for key, (expected, default) in _DIFFUSERS_FIXED.items():
        value = r.config.get(key, default)
        if (list(value) if isinstance(value, tuple) else value) != expected:
            r.fail(key, f"is not {expected!r}, the only value videodit's LTX-2 takes")
    heads = r.int("num_attention_heads", 32, MAX_HEADS)
    if r.int("audio_num_attention_heads", 32, MAX_HEADS) != heads:
        r.fail("audio_num_attention_heads", "differs from num_attention_heads (the release format needs them equal)")
    head_dim, audio_head_dim = r.int("attention_head_dim", 128), r.int("audio_attention_head_dim", 64)
    in_channels, audio_in = r.int("in_channels", 128), r.int("audio_in_channels", 128)
    if r.config.get("out_channels") is not None:
        _same(r, "out_channels", in_channels, in_channels)
    if r.config.get("audio_out_channels") is not None:
        _same(r, "audio_out_channels", audio_in, audio_in)
    _same(r, "cross_attention_dim", heads * head_dim, 4096)
    _same(r, "audio_cross_attention_dim", heads * audio_head_dim, 2048)
    gated, adaln = r.bool("gated_attn", False), r.bool("cross_attn_mod", False)
    if r.bool("audio_gated_attn", False) != gated or r.bool("audio_cross_attn_mod", False) != adaln:
        r.fail("audio_gated_attn", "differs from the video stream's (gated_attn, cross_attn_mod): not a release")
    caption = r.int("caption_channels", 3840) if r.bool("use_prompt_embeddings", True) else None
    return _geometry(r, num_layers=r.int("num_layers", 48, MAX_LAYERS), num_heads=heads, head_dim=head_dim,
                     audio_head_dim=audio_head_dim, in_channels=in_channels, audio_in_channels=audio_in,
                     caption_channels=caption, gated_attention=gated, cross_attention_adaln=adaln,
                     norm_eps=r.number("norm_eps", 1e-6), rope_theta=r.number("rope_theta", 10000.0),
                     max_pos=(r.int("pos_embed_max_pos", 20), r.int("base_height", 2048), r.int("base_width", 2048)),
                     audio_max_pos=r.int("audio_pos_embed_max_pos", 20),
                     double_precision_rope=r.bool("rope_double_precision", True),
                     timestep_scale_multiplier=r.number("timestep_scale_multiplier", 1000),
                     av_ca_timestep_scale_multiplier=r.number("cross_attn_timestep_scale_multiplier", 1000))


def diffusers_config(g: LTX2Geometry) -> dict:
    """config.json of diffusers' LTX2VideoTransformer3DModel holding this DiT."""
    fixed = {key: expected for key, (expected, _) in _DIFFUSERS_FIXED.items()}
    return {"_class_name": DIFFUSERS_CLASS, "_diffusers_version": "0.38.0", **fixed,
            "in_channels": g.in_channels, "out_channels": g.in_channels, "num_attention_heads": g.num_heads,
            "attention_head_dim": g.head_dim, "cross_attention_dim": g.dim, "pos_embed_max_pos": g.max_pos[0],
            "base_height": g.max_pos[1], "base_width": g.max_pos[2], "gated_attn": g.gated_attention,
            "cross_attn_mod": g.cross_attention_adaln, "audio_in_channels": g.audio_in_channels,
            "audio_out_channels": g.audio_in_channels, "audio_num_attention_heads": g.num_heads,
            "audio_attention_head_dim": g.audio_head_dim, "audio_cross_attention_dim": g.audio_dim,
            "audio_pos_embed_max_pos": g.audio_max_pos, "audio_gated_attn": g.gated_attention,
            "audio_cross_attn_mod": g.cross_attention_adaln, "num_layers": g.num_layers, "norm_eps": g.norm_eps,
            "caption_channels": g.caption_channels or 3840, "rope_theta": g.rope_theta,
            "rope_double_precision": g.double_precision_rope,
            "timestep_scale_multiplier": _plain(g.timestep_scale_multiplier),
            "cross_attn_timestep_scale_multiplier": _plain(g.av_ca_timestep_scale_multiplier),
            "use_prompt_embeddings": g.caption_channels is not None,
            "perturbed_attn": g.gated_attention}   # the 2.3 releases' processor (STG); no weights


# ----------------------------------------------------------------------------- shared

def _same(r: _Reader, key: str, expected: int, default: int) -> None:
    if r.int(key, default) != expected:
        r.fail(key, f"is not {expected} (the stream's width / input channels), which the layout requires")


def _geometry(r: _Reader, **fields) -> LTX2Geometry:
    try:
        return LTX2Geometry(**fields)
    except UserError as exc:
        raise UserError(f"{r.where}: {exc}") from None


def _plain(value: float):
    """1000.0 as 1000 in JSON, as the releases write integers."""
    return int(value) if float(value).is_integer() else value

