"""LTX-2's audio VAE and vocoder, frozen, through diffusers' ``AutoencoderKLLTX2Audio`` and
``LTX2Vocoder`` / ``LTX2VocoderWithBWE``.

What the releases hold (LTX-2.0 and 2.3 alike for the VAE; Lightricks/LTX-2 ltx-core
``model/audio_vae/``, diffusers' ``autoencoder_kl_ltx2_audio.py``):

- **The mel.** Stereo log-mel spectrograms ``[B, 2, T, 64]`` of 16 kHz audio, hop 160 (100 frames a
  second), n_fft 1024 (ltx-core's ``AudioProcessor``: torchaudio's slaney mel, magnitude, log of
  ``max(mel, 1e-5)``; computing it is the data side's, not this module's).
- **The latents.** The encoder halves time and mel bins twice, causally in time: ``T`` mel frames
  give ``ceil(T / 4)`` latent frames of ``[8 channels, 16 bins]``; the decoder gives back
  ``4 T' - 3`` mel frames. ``encode`` returns what ltx-core's ``AudioEncoder`` returns and ltx-trainer
  trains on: the posterior MEANS, normalised per token feature, ``(z - mean-of-means) /
  std-of-means`` over the ``(channel, bin)`` features of a latent frame (128 statistics).
- **The tokens.** The DiT's audio stream takes ``[B, T', 128]``: ltx-core's ``AudioPatchifier``,
  ``b c t f -> b t (c f)`` (:func:`audio_tokens`; videodit's ``LTX2Model(audio=...)``), 25 a second.
  A clip of ``s`` seconds is generated as ``round(25 s)`` tokens (ltx-core's
  ``AudioLatentShape.from_duration``); encoded from its mel (``samples // 160 + 1`` frames) it
  gives ``ceil(frames / 4)``, which can be one more. Causal in time (no attention in the releases):
  latent frame ``j`` sees mel frames up to ``4 j`` only, so a mel padded after its end (a batch's
  longest) encodes to the clip's own latents first; cut them at ``latent_frames(length)``.
- **The vocoder.** Mel -> stereo waveform in [-1, 1]. LTX-2.0: a HiFi-GAN (240x upsampling, tanh)
  at 24 kHz. LTX-2.3: a BigVGAN-style one at 16 kHz (snake-beta, anti-aliased) followed by a
  bandwidth extension to 48 kHz. Held and run in fp32 whatever ``dtype`` (ltx-core runs the 2.3 one
  in fp32: bf16 degrades it); the VAE runs in ``dtype`` (ltx-trainer encodes in fp32).

``path`` (joined with ``subfolder``) is either

- the single-file release (``ltx-2-19b-*.safetensors``, ``ltx-2.3-22b-*.safetensors``): its metadata
  ``config["audio_vae"]`` / ``config["vocoder"]`` (ltx-core's keys, read with ltx-core's defaults)
  become diffusers' configs, and its ``audio_vae.*`` / ``vocoder.*`` tensors are renamed as
  diffusers' converter renames them; or
- a diffusers LTX-2 folder with ``audio_vae/`` and ``vocoder/`` (or the ``audio_vae/`` folder itself,
  its ``vocoder/`` beside it).

Either way the module is built on the meta device and loaded strictly from safetensors (a missing,
unknown or mis-shaped tensor is one line naming it and the file); no pickle is ever opened.

One deliberate difference from a stock diffusers folder: Lightricks' ``VocoderWithBWE`` clamps its
first stage to [-1, 1] before the bandwidth extension, diffusers' converted 2.3 config does not
(``final_act_fn: null``); videodit clamps as Lightricks does, for both layouts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import Tensor, nn

from videodit.errors import UserError
from videodit.models.vae_base import load_strict
from videodit.models.weight_files import (ConfigValues, LazyTensors, build_bounded, open_safetensors, read_json,
                                          sharded_sources)

AUDIO_KINDS = ("ltx2",)
VAE_CLASS = "AutoencoderKLLTX2Audio"
VOCODER_CLASSES = ("LTX2Vocoder", "LTX2VocoderWithBWE")
DOWNSAMPLE = 4          # both codes fix it (LATENT_DOWNSAMPLE_FACTOR): two 2x levels in time and in mel bins
STATS = {"per_channel_statistics.mean-of-means": "latents_mean", "per_channel_statistics.std-of-means": "latents_std"}
# ltx-core's vocoder names -> diffusers' (whole dotted parts; "downsample.lowpass" -> "downsample" below)
_VOCODER_PARTS = {"ups": "upsamplers", "resblocks": "resnets", "conv_pre": "conv_in", "conv_post": "conv_out",
                  "act_post": "act_out"}
_WEIGHTS = "diffusion_pytorch_model.safetensors"
_PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt")


# ----------------------------------------------------------------------------- tokens

def audio_tokens(latents: Tensor) -> Tensor:
    """``[B, C, T, F]`` latents -> ``[B, T, C * F]`` tokens (ltx-core's ``AudioPatchifier``)."""
    return latents.permute(0, 2, 1, 3).flatten(2)


def audio_latents(tokens: Tensor, mel_bins: int = 16) -> Tensor:
    """``[B, T, C * F]`` tokens -> ``[B, C, T, F]`` latents of ``mel_bins`` (F) bins."""
    return tokens.unflatten(2, (-1, mel_bins)).permute(0, 2, 1, 3)


# ----------------------------------------------------------------------------- the release's config

def _section(value, where: str, what: str) -> dict:
    if not isinstance(value, dict):
        raise UserError(f"{where}: the metadata config's {what} is not a mapping; restore the release file")
    return value


def _expect(config: dict, key: str, expected, default, where: str, what: str) -> None:
    if config.get(key, default) != expected:
        raise UserError(f"{where}: {what}.{key}={config.get(key, default)!r} is not {expected!r}, as LTX-2's releases "
                        "have (videodit builds no other); pass an LTX-2 release file")


def audio_vae_config(audio_vae: dict, where: str) -> tuple[dict, int]:
    """diffusers' AutoencoderKLLTX2Audio config and the mel's n_fft for ltx-core's ``config["audio_vae"]``,
    read with ltx-core's defaults (``audio_vae/model_configurator.py``)."""
    audio_vae = _section(audio_vae, where, "audio_vae")
    params = _section(_section(audio_vae.get("model", {}), where, "audio_vae.model").get("params", {}), where,
                      "audio_vae.model.params")
    dd = _section(params.get("ddconfig", {}), where, "audio_vae.model.params.ddconfig")
    pre = _section(audio_vae.get("preprocessing", {}), where, "audio_vae.preprocessing")
    stft, mel = _section(pre.get("stft", {}), where, "stft"), _section(pre.get("mel", {}), where, "mel")
    variables = _section(audio_vae.get("variables", {}), where, "audio_vae.variables")
    fix = "restore the release file"
    v = ConfigValues(dd, f"{where} (metadata config.audio_vae ddconfig)", fix)
    s = ConfigValues(stft, f"{where} (metadata config.audio_vae.preprocessing.stft)", fix)
    what = "audio_vae ddconfig"
    for key, expected, default in (("norm_type", "pixel", "pixel"), ("causality_axis", "height", "height"),
                                   ("double_z", True, True), ("attn_type", "vanilla", "vanilla"),
                                   ("resamp_with_conv", True, True)):
        _expect(dd, key, expected, default, where, what)
    mel_bins = dd.get("mel_bins") or mel.get("n_mel_channels") or variables.get("mel_bins")
    if mel_bins is None:
        raise UserError(f"{where}: the metadata config.audio_vae names no mel_bins; {fix}")
    attn = dd.get("attn_resolutions", (8, 16, 32))
    if not isinstance(attn, (list, tuple)) or not all(isinstance(r, int) and not isinstance(r, bool) for r in attn):
        raise UserError(f"{where}: audio_vae ddconfig.attn_resolutions={attn!r} is not a list of whole numbers; {fix}")
    config = {"base_channels": v.int("ch", 128), "output_channels": v.int("out_ch", 2, high=16),
              "ch_mult": list(v.ints("ch_mult", (1, 2, 4), length=3)), "num_res_blocks": v.int("num_res_blocks", 2),
              "attn_resolutions": sorted(attn) or None, "in_channels": v.int("in_channels", 2, high=16),
              "resolution": v.int("resolution", 256), "latent_channels": v.int("z_channels", 8, high=1024),
              "norm_type": "pixel", "causality_axis": "height", "dropout": 0.0,
              "mid_block_add_attention": v.bool("mid_block_add_attention", True),
              "sample_rate": ConfigValues(params, f"{where} (config.audio_vae.model.params)", fix).int(
                  "sampling_rate", 16000, high=1 << 20),
              "mel_hop_length": s.int("hop_length", 160, high=1 << 16), "is_causal": s.bool("causal", True),
              "mel_bins": ConfigValues({"mel_bins": mel_bins}, f"{where} (config.audio_vae)", fix).int(
                  "mel_bins", high=4096),
              "double_z": True}
    return config, s.int("filter_length", 1024, high=1 << 16)


def _whole_numbers(value, key: str, where: str, what: str) -> list[int]:
    if not (isinstance(value, list) and value and all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 1024
                                                      for n in value)):
        raise UserError(f"{where}: {what}.{key}={value!r} is not a list of whole numbers from 1 to 1024; restore the "
                        "release file")
    return value


def _stage(cfg: dict, where: str, what: str, resblock: str, activation: str | None) -> tuple[dict, ConfigValues]:
    """One generator of ltx-core's ``Vocoder`` (``_vocoder_from_config``) as diffusers' LTX2Vocoder arguments."""
    _expect(cfg, "resblock", resblock, None, where, what)
    _expect(cfg, "stereo", True, None, where, what)
    if activation:
        _expect(cfg, "activation", activation, None, where, what)
    v = ConfigValues(cfg, f"{where} (metadata config.{what})", "restore the release file")
    rates = _whole_numbers(cfg.get("upsample_rates", [6, 5, 2, 2, 2]), "upsample_rates", where, what)
    kernels = _whole_numbers(cfg.get("upsample_kernel_sizes", [16, 15, 8, 4, 4]), "upsample_kernel_sizes", where, what)
    res_kernels = _whole_numbers(cfg.get("resblock_kernel_sizes", [3, 7, 11]), "resblock_kernel_sizes", where, what)
    dilations = cfg.get("resblock_dilation_sizes", [[1, 3, 5]] * 3)
    if not isinstance(dilations, list):
        dilations = None   # refused below, in the same words
    dilations = [_whole_numbers(d, "resblock_dilation_sizes", where, what) for d in (dilations or [None])]
    if len(rates) != len(kernels) or len(res_kernels) != len(dilations) or any(len(d) != 3 for d in dilations):
        raise UserError(f"{where}: {what} pairs {len(rates)} upsample rates with {len(kernels)} kernel sizes and "
                        f"{len(res_kernels)} resblock kernels with {len(dilations)} dilation lists (of 3 each, as "
                        "ltx-core's resblocks take); restore the release file")
    hidden = v.int("upsample_initial_channel", 1024, high=1 << 16)
    if hidden % 2 ** len(rates):
        raise UserError(f"{where}: {what}.upsample_initial_channel={hidden} does not halve {len(rates)} times; restore "
                        "the release file")
    return {"in_channels": 128, "hidden_channels": hidden, "out_channels": 2,   # ltx-core's stereo: 2 x 64 bins
            "upsample_kernel_sizes": kernels, "upsample_factors": rates, "resnet_kernel_sizes": res_kernels,
            "resnet_dilations": dilations, "leaky_relu_negative_slope": 0.1,
            "final_bias": v.bool("use_bias_at_final", True)}, v


def vocoder_config(vocoder: dict, where: str) -> tuple[str, dict]:
    """(diffusers class name, config) for ltx-core's ``config["vocoder"]`` (``VocoderConfigurator``):
    flat for LTX-2.0 (HiFi-GAN), ``{"vocoder": ..., "bwe": ...}`` for LTX-2.3."""
    vocoder = _section(vocoder, where, "vocoder")
    if "bwe" not in vocoder:
        config, v = _stage(vocoder, where, "vocoder", "1", None)
        config.update(act_fn="leaky_relu", antialias=False,
                      final_act_fn="tanh" if v.bool("use_tanh_at_final", True) else "clamp",
                      output_sampling_rate=v.int("output_sampling_rate", 24000, high=1 << 20))
        return "LTX2Vocoder", config
    first, v = _stage(_section(vocoder.get("vocoder", {}), where, "vocoder.vocoder"), where, "vocoder.vocoder",
                      "AMP1", "snakebeta")
    bwe_cfg = _section(vocoder["bwe"], where, "vocoder.bwe")
    bwe, b = _stage(bwe_cfg, where, "vocoder.bwe", "AMP1", "snakebeta")
    config = {**first, "act_fn": "snakebeta", "antialias": True, "antialias_ratio": 2, "antialias_kernel_size": 12,
              # ltx-core applies the first stage's final activation (apply_final_activation), the BWE's not
              "final_act_fn": "tanh" if v.bool("use_tanh_at_final", True) else "clamp",
              **{f"bwe_{k}": value for k, value in bwe.items()}, "bwe_act_fn": "snakebeta", "bwe_antialias": True,
              "bwe_antialias_ratio": 2, "bwe_antialias_kernel_size": 12, "bwe_final_act_fn": None,
              "filter_length": b.int("n_fft", high=1 << 16), "hop_length": b.int("hop_length", high=1 << 16),
              "window_length": b.int("n_fft", high=1 << 16),   # ltx-core's MelSTFT: win_length = n_fft
              "num_mel_channels": b.int("num_mels", high=4096),
              "input_sampling_rate": b.int("input_sampling_rate", high=1 << 20),
              "output_sampling_rate": b.int("output_sampling_rate", high=1 << 20)}
    return "LTX2VocoderWithBWE", config


def audio_vae_name(name: str) -> str:
    """A release tensor name (without ``audio_vae.``) -> diffusers' (its converter renames the statistics)."""
    return STATS.get(name, name)


def vocoder_name(name: str) -> str:
    """A release tensor name (without its one ``vocoder.``) -> diffusers' (its converter's renames)."""
    parts = [_VOCODER_PARTS.get(p, p) for p in name.split(".")]
    return ".".join(p for i, p in enumerate(parts) if not (p == "lowpass" and i and parts[i - 1] == "downsample"))


# ----------------------------------------------------------------------------- building and loading

def _check_config(name: str, config: dict, where: str) -> None:
    """What videodit and diffusers' forward passes need beyond their constructors' checks, refused in one line."""
    if name == VAE_CLASS:
        for key, expected in (("norm_type", "pixel"), ("causality_axis", "height"), ("double_z", True)):
            if config.get(key, expected) != expected:
                raise UserError(f"{where}: the audio VAE's {key}={config.get(key)!r} is not {expected!r}, as LTX-2's "
                                "has (videodit builds no other); restore the files")
        if len(config.get("ch_mult", (1, 2, 4))) != 3:
            raise UserError(f"{where}: the audio VAE's ch_mult={config.get('ch_mult')!r} is not 3 levels: LTX-2's "
                            "audio VAE compresses 4x (both codes fix it); restore the files")
    if name != "LTX2VocoderWithBWE":
        return
    ratio, rest = divmod(config.get("output_sampling_rate", 48000), config.get("input_sampling_rate", 16000))
    first = math.prod(config.get("upsample_factors", [5, 2, 2, 2, 2, 2]))
    hop, bwe = config.get("hop_length", 80), math.prod(config.get("bwe_upsample_factors", [6, 5, 2, 2, 2]))
    if rest or ratio < 1 or first % hop or bwe != hop * ratio:
        raise UserError(f"{where}: the vocoder's bandwidth extension does not fit its first stage (output rate a "
                        "whole multiple of the input rate, first-stage upsampling a multiple of hop_length, BWE "
                        "upsampling = hop_length x that multiple, as LTX-2.3's 16 -> 48 kHz is); restore the files")


def _build(class_name: str, config: dict, held: int, where: str) -> nn.Module:
    import diffusers
    from diffusers.pipelines import ltx2

    cls = getattr(diffusers, class_name) if class_name == VAE_CLASS else getattr(ltx2, class_name)
    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    try:
        _check_config(class_name, kwargs, where)
        return build_bounded(lambda: cls.from_config(kwargs), held,
                             f"{where}: its config describes a {class_name} far larger than its {held} tensors; "
                             "restore the files")
    except (TypeError, ValueError, ZeroDivisionError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"{where}: its config does not build diffusers' {class_name} ({first}); restore the "
                        "files") from None


def _materialised(model: nn.Module) -> nn.Module:
    """The BWE's resampler filter is a non-persistent buffer (in no file): the meta build left it
    empty, so build that one small module again on the CPU."""
    resampler = getattr(model, "resampler", None)
    if resampler is not None and resampler.filter.is_meta:
        with torch.device("cpu"):
            model.resampler = type(resampler)(ratio=resampler.ratio, window_type="hann", persistent=False)
    return model


def _loaded(class_name: str, config: dict, sources: dict, dtype: torch.dtype, where: str, fix: str) -> nn.Module:
    model = _build(class_name, config, len(sources), where)
    tensors = LazyTensors(sources)
    load_strict(model, {k: tensors[k].to(dtype) for k in tensors}, where=where, fix=fix,
                stranger=f"is not part of the {class_name} its config describes")
    return _materialised(model)


def release_config(file: Path) -> dict:
    metadata = open_safetensors(file).metadata() or {}
    try:
        config = json.loads(metadata["config"])
    except (KeyError, TypeError, ValueError, RecursionError):
        config = None
    if not isinstance(config, dict) or "audio_vae" not in config:
        raise UserError(f"{file} has no audio_vae config in its safetensors metadata; pass the LTX-2 release file as "
                        "downloaded, or a diffusers LTX-2 folder with audio_vae/ and vocoder/")
    return config


def load_release(file: Path, dtype: torch.dtype, vocoder: bool = True):
    """(AutoencoderKLLTX2Audio, LTX2Vocoder[WithBWE] or None, n_fft) of a release file."""
    config = release_config(file)
    fix = "pass an LTX-2 release file as downloaded"
    vae_config, n_fft = audio_vae_config(config["audio_vae"], str(file))
    keys = list(open_safetensors(file).keys())
    sources = {audio_vae_name(k[len("audio_vae."):]): (file, k) for k in keys if k.startswith("audio_vae.")}
    if not sources:
        raise UserError(f"{file} holds no audio_vae.* tensors; pass a release file with its audio VAE, or a diffusers "
                        "LTX-2 folder")
    vae = _loaded(VAE_CLASS, vae_config, sources, dtype, str(file), fix)
    if not vocoder:
        return vae, None, n_fft
    if "vocoder" not in config:
        raise UserError(f"{file} has no vocoder config in its safetensors metadata; pass the LTX-2 release file as "
                        "downloaded")
    name, voc_config = vocoder_config(config["vocoder"], str(file))
    sources = {vocoder_name(k[len("vocoder."):]): (file, k) for k in keys if k.startswith("vocoder.")}
    return vae, _loaded(name, voc_config, sources, torch.float32, str(file), fix), n_fft


def _folder_sources(folder: Path) -> dict:
    """name -> (file, name) of a diffusers component folder's safetensors (one file or an index)."""
    if (folder / _WEIGHTS).is_file():
        return {k: (folder / _WEIGHTS, k) for k in open_safetensors(folder / _WEIGHTS).keys()}
    if (folder / f"{_WEIGHTS}.index.json").is_file():
        return sharded_sources(folder / f"{_WEIGHTS}.index.json")
    pickles = sorted(p.name for pattern in _PICKLES for p in folder.glob(pattern))
    if pickles:
        raise UserError(f"{folder} holds {pickles[0]}, a pickle, which videodit never loads (it can run code); convert "
                        f"it to {_WEIGHTS} (diffusers' save_pretrained(safe_serialization=True))")
    raise UserError(f"{folder} holds no {_WEIGHTS}; download the component's weights")


def load_folder(folder: Path, classes: tuple[str, ...], dtype: torch.dtype) -> tuple[nn.Module, dict]:
    """A diffusers component folder (config.json + safetensors) of one of ``classes``, strictly."""
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder} has no config.json; point to a diffusers LTX-2 folder (audio_vae/ and vocoder/)")
    config = read_json(folder / "config.json")
    name = config.get("_class_name") if isinstance(config, dict) else None
    if name not in classes:
        raise UserError(f"{folder / 'config.json'} holds _class_name={name!r}, not {' or '.join(classes)}; point to "
                        "LTX-2's audio VAE and vocoder folders")
    model = _loaded(name, config, _folder_sources(folder), dtype, str(folder), "restore the folder from its download")
    return model, config


# ----------------------------------------------------------------------------- the adapter

class LTX2AudioVAE(nn.Module):
    """A frozen LTX-2 audio VAE (mel <-> normalised latents) and its vocoder (mel -> waveform)."""

    def __init__(self, vae: nn.Module, vocoder: nn.Module | None = None, n_fft: int = 1024):
        super().__init__()
        c = vae.config
        self.vae, self.vocoder = vae, vocoder
        self.latent_channels, self.mel_bins = int(c.latent_channels), int(c.mel_bins)
        self.in_channels = int(c.in_channels)
        self.latent_mel_bins = self.mel_bins // DOWNSAMPLE   # each level: (bins - 2) // 2 + 1
        self.token_width = self.latent_channels * self.latent_mel_bins
        self.sample_rate, self.hop_length, self.n_fft = int(c.sample_rate), int(c.mel_hop_length), int(n_fft)
        self.latents_per_second = self.sample_rate / self.hop_length / DOWNSAMPLE
        self.vocoder_in_channels = self.output_sample_rate = None
        if vae.latents_mean.numel() != self.token_width:
            raise UserError(f"the audio VAE holds {vae.latents_mean.numel()} latent statistics but its tokens are "
                            f"{self.latent_channels} x {self.latent_mel_bins} = {self.token_width} wide (ltx-core "
                            "normalises token features): restore its files")
        if vocoder is not None:
            self.vocoder = vocoder.float()
            core = getattr(vocoder, "vocoder", vocoder)   # LTX-2.3: the first stage of LTX2VocoderWithBWE
            self.vocoder_in_channels = int(core.conv_in.in_channels)
            self.output_sample_rate = int(vocoder.config.output_sampling_rate)
            if core is not vocoder and core.final_act_fn is None:
                core.final_act_fn = "clamp"   # as Lightricks' VocoderWithBWE (module docstring)
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> "LTX2AudioVAE":
        return super().train(False)   # frozen: a parent's .train() must not flip it

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.latents_mean.dtype

    @property
    def device(self) -> torch.device:
        return self.vae.latents_mean.device

    # ---------------------------------------------------------------- sizes

    def latent_frames(self, mel_frames: int) -> int:
        """Latent frames the encoder gives for ``mel_frames``: ``ceil(mel_frames / 4)``."""
        return -(-int(mel_frames) // DOWNSAMPLE)

    def mel_frames(self, latent_frames: int) -> int:
        """Mel frames the decoder gives for ``latent_frames``: ``4 T' - 3`` (causal)."""
        return max(DOWNSAMPLE * int(latent_frames) - (DOWNSAMPLE - 1), 1)

    def latent_size(self, *, seconds: float | None = None, mel_frames: int | None = None) -> tuple[int, int]:
        """(latent frames, latent mel bins): of ``mel_frames`` as the encoder gives them, or of
        ``seconds`` as LTX generates them (``round(seconds x 25)``; module docstring)."""
        if (seconds is None) == (mel_frames is None):
            raise ValueError("give exactly one of seconds and mel_frames")
        frames = round(seconds * self.latents_per_second) if seconds is not None else self.latent_frames(mel_frames)
        return frames, self.latent_mel_bins

    # ---------------------------------------------------------------- mel <-> latents <-> waveform

    def _stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        return self.vae.latents_mean.float().to(like.device), self.vae.latents_std.float().to(like.device)

    def _check_mel(self, mel: Tensor, channels: int, bins: int | None, what: str) -> None:
        if mel.ndim != 4 or mel.shape[1] != channels or (bins is not None and mel.shape[3] != bins):
            raise ValueError(f"{what} takes a mel [B, {channels}, T, {bins or 'bins'}], got {tuple(mel.shape)}")

    @torch.no_grad()
    def encode(self, mel: Tensor) -> Tensor:
        """Mel ``[B, 2, T, 64]`` -> normalised posterior means ``[B, 8, ceil(T / 4), 16]``."""
        self._check_mel(mel, self.in_channels, self.mel_bins, "the audio VAE")
        means = self.vae.encode(mel.to(device=self.device, dtype=self.dtype)).latent_dist.mode().float()
        mean, std = self._stats(means)
        return audio_latents((audio_tokens(means) - mean) / std, means.shape[3])

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Normalised latents ``[B, 8, T', 16]`` -> mel ``[B, 2, 4 T' - 3, 64]`` (fp32)."""
        if latents.ndim != 4 or latents.shape[1] != self.latent_channels or latents.shape[3] != self.latent_mel_bins:
            raise ValueError(f"the audio decoder takes latents [B, {self.latent_channels}, T, {self.latent_mel_bins}], "
                             f"got {tuple(latents.shape)}")
        latents = latents.float().to(self.device)
        mean, std = self._stats(latents)
        z = audio_latents(audio_tokens(latents) * std + mean, latents.shape[3])
        return self.vae.decode(z.to(self.dtype)).sample.float()

    @torch.no_grad()
    def vocode(self, mel: Tensor) -> Tensor:
        """Mel ``[B, 2, T, 64]`` -> waveform ``[B, 2, samples]`` in [-1, 1] at ``output_sample_rate``."""
        if self.vocoder is None:
            raise UserError("this audio VAE was built without its vocoder; build it with vocoder=True")
        if mel.ndim != 4 or mel.shape[1] * mel.shape[3] != self.vocoder_in_channels:
            raise ValueError(f"the vocoder takes a mel [B, C, T, bins] with C x bins = {self.vocoder_in_channels}, got "
                             f"{tuple(mel.shape)}")
        return self.vocoder(mel.float().to(self.device)).float()

    def tokens(self, latents: Tensor) -> Tensor:
        """Latents ``[B, 8, T', 16]`` -> the DiT's audio tokens ``[B, T', 128]``."""
        return audio_tokens(latents)

    def untokens(self, tokens: Tensor) -> Tensor:
        """The DiT's audio tokens ``[B, T', 128]`` -> latents ``[B, 8, T', 16]``."""
        return audio_latents(tokens, self.latent_mel_bins)


def build_ltx2_audio(path, subfolder: str | None = None, *, dtype: torch.dtype = torch.float32, vocoder: bool = True,
                     key: str = "audio.path") -> LTX2AudioVAE:
    """The frozen audio VAE (+ vocoder) of ``path`` (+ ``subfolder``): module docstring. ``key`` names
    the config key in messages."""
    if path is None or not str(path).strip():
        raise UserError(f"{key} is required for LTX-2's audio: point it to the LTX-2 release file "
                        "(ltx-2-19b-*.safetensors / ltx-2.3-22b-*.safetensors) or a diffusers LTX-2 folder with "
                        "audio_vae/ and vocoder/ (nothing is downloaded)")
    target = Path(path).expanduser() / (subfolder or "")
    try:
        import diffusers  # noqa: F401
    except ImportError:
        raise UserError("LTX-2's audio VAE needs the diffusers package: pip install 'videodit[hf]'") from None
    if target.is_file():
        return LTX2AudioVAE(*load_release(target, dtype, vocoder))
    if target.is_dir() and (target / "audio_vae" / "config.json").is_file():
        vae_folder, vocoder_folder = target / "audio_vae", target / "vocoder"
    elif (target / "config.json").is_file():
        vae_folder, vocoder_folder = target, target.parent / "vocoder"
    else:
        raise UserError(f"{key}='{path}'" + (f" (subfolder '{subfolder}')" if subfolder else "") + " is neither an "
                        "LTX-2 release file nor a diffusers LTX-2 folder with audio_vae/; point it to one")
    vae, _ = load_folder(vae_folder, (VAE_CLASS,), dtype)
    voc = None
    if vocoder:
        if not vocoder_folder.is_dir():
            raise UserError(f"{vocoder_folder} is missing: a diffusers LTX-2 folder has the vocoder beside audio_vae/; "
                            "download it, or build the audio VAE without its vocoder")
        voc, _ = load_folder(vocoder_folder, VOCODER_CLASSES, torch.float32)
    return LTX2AudioVAE(vae, voc)


__all__ = ["AUDIO_KINDS", "LTX2AudioVAE", "audio_latents", "audio_tokens", "audio_vae_config", "build_ltx2_audio",
           "vocoder_config", "vocoder_name"]
