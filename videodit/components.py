"""Build the model and its frozen encoders from a config: shared by train, sample, the planner
and export. The one place that knows every kind of encoder (the toy one included)."""

from __future__ import annotations

import torch

from videodit.config import Config
from videodit.errors import UserError
from videodit.models.families import get_spec, spec_of
from videodit.models.families import encoder_kinds, encoder_spec
from videodit.models.text import load_text_encoder
from videodit.models.vae import build_vae
from videodit.toy.audio_codec import ToyAudioCodec
from videodit.toy.encoder import TOY_MAX_LENGTH, ToyTextEncoder

OWN_TEXT_KINDS = ("toy", "transformers")   # built here; the families bring the others
UNMASKED_TEXT_KINDS = ("t5-clip",)         # text.mask=false: Open-Sora 2.0's T5, run without its mask
POOLED_TEXT_KINDS = ("t5-clip",)           # with a pooled vector beside the tokens (Open-Sora 2.0's CLIP-L)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}   # vae.dtype, text.dtype


def build_text_encoder(kind: str, path: str | None = None, max_length: int | None = None, dim: int = 64,
                       dtype: torch.dtype = torch.float32, mask: bool = True, audio: bool = False,
                       audio_dim: int | None = None) -> torch.nn.Module:
    """A frozen text encoder: ``toy`` (weight-free, ``dim`` wide; ``path`` ignored),
    ``transformers`` (the local folder ``path``; ``dim`` comes from its config), ``umt5`` (Wan's
    umT5-XXL, run with its mask and zero-padded as Wan does) or ``t5-clip`` (Open-Sora 2.0's T5 and
    CLIP pooled vector; ``mask=False`` runs T5 unmasked as Open-Sora does). ``max_length=None``
    means 8 tokens for the toy encoder and 120 for transformers models. ``audio``: a family's encoder
    that also gives its audio stream's text (``encode_streams``; LTX-2's, for ``model.train_audio``);
    the toy encoder gives its own, ``audio_dim`` wide (default ``dim``)."""
    if not mask and kind not in UNMASKED_TEXT_KINDS:
        raise UserError(f"text.mask=false (Open-Sora 2.0's unmasked T5) is for text.kind="
                        f"{' or '.join(UNMASKED_TEXT_KINDS)}, not {kind!r}; set text.mask=true")
    if kind == "toy":
        return ToyTextEncoder(dim=dim, max_length=max_length or TOY_MAX_LENGTH, audio_dim=audio_dim)
    if kind == "transformers":
        return load_text_encoder(path, max_length=max_length, dtype=dtype)
    family = encoder_spec("text_kinds", kind)
    if family is not None:   # a family's own encoder (Wan's umT5): its spec builds it
        return family.build_text_encoder(kind, path, max_length, dtype, mask=mask, **({"audio": True} if audio else {}))
    raise UserError(f"text.kind={kind!r} is not supported; choose one of: {', '.join(OWN_TEXT_KINDS + encoder_kinds('text_kinds'))}")


def build_encoders(cfg: Config, device: torch.device):
    """The frozen VAE and text encoder (no gradients, eval mode)."""
    vae = build_vae(cfg.vae.kind, path=cfg.vae.path, subfolder=cfg.vae.subfolder,
                    scaling_factor=cfg.vae.scaling_factor, micro_batch=cfg.vae.micro_batch,
                    temporal_micro_batch=cfg.vae.temporal_micro_batch, dtype=DTYPES[cfg.vae.dtype],
                    sample_posterior=cfg.vae.sample_posterior)
    text = build_text_encoder(cfg.text.kind, path=cfg.text.path, max_length=cfg.text.max_length,
                              dim=cfg.text.dim, dtype=DTYPES[cfg.text.dtype], mask=cfg.text.mask,
                              audio=cfg.model.train_audio,
                              audio_dim=get_spec(cfg.model.family).audio_text_width(cfg.model))
    return vae.to(device), text.to(device)


OWN_AUDIO_KINDS = ("toy",)   # built here, for any family with an audio stream; the families bring the others


def check_audio_training(cfg: Config) -> None:
    """One line for a ``model.train_audio`` the run cannot do: a family without an audio stream, no
    ``audio.kind``, or an audio VAE that is neither ours nor the family's."""
    family, kind = cfg.model.family, cfg.audio.kind
    spec = get_spec(family)
    if cfg.model.train_audio and not spec.audio_kinds:
        raise UserError(f"model.train_audio: the {family} family has no audio stream (LTX-2 has one); set "
                        "model.train_audio=false")
    if cfg.model.train_audio and kind == "none":
        raise UserError(f"model.train_audio needs the audio VAE that makes the audio stream's latents: set "
                        f"audio.kind={spec.audio_kinds[0]} and audio.path (the release file or a diffusers folder)")
    allowed = spec.audio_kinds + (OWN_AUDIO_KINDS if spec.audio_kinds else ())   # the toy's: any audio stream
    if kind != "none" and kind not in allowed:
        raise UserError(f"audio.kind={kind} is not an audio VAE of the {family} family (its: "
                        f"{', '.join(allowed) or 'none'}); set audio.kind=none")


def build_audio_encoder(cfg: Config, device: torch.device, vocoder: bool = False):
    """The frozen audio VAE ``audio.*`` names (checked by :func:`check_audio_training`): the toy's
    (``toy/audio_codec.py``) or the family's, through its spec; ``vocoder``: with its vocoder
    (sampling; training encodes only). None for ``audio.kind=none``."""
    check_audio_training(cfg)
    if cfg.audio.kind == "none":
        return None
    if cfg.audio.kind == "toy":
        return ToyAudioCodec().to(device)
    encoder = get_spec(cfg.model.family).build_audio(cfg.audio.kind, cfg.audio.path, cfg.audio.subfolder,
                                                      dtype=DTYPES[cfg.audio.dtype], vocoder=vocoder)
    return encoder.to(device)


def check_audio_model(model, encoder) -> None:
    """One line where the model cannot take the audio VAE's tokens: no audio stream, or one of
    another width."""
    spec = spec_of(model)
    width = spec.audio_channels(model.geometry)
    if width != encoder.token_width:
        has = "no audio stream" if width is None else f"an audio stream of {width}-wide tokens"
        raise UserError(f"model.train_audio: the model has {has}, the audio VAE gives {encoder.token_width}-wide "
                        f"tokens (its latent channels x mel bins); set model.audio_channels={encoder.token_width} "
                        "or use the model's own audio VAE")


def build_image_encoder(cfg: Config, device: torch.device) -> torch.nn.Module | None:
    """The frozen image encoder of a model that embeds image features of the given frame
    (``model.image_dim``: Wan 2.1 I2V's CLIP), from ``image_encoder.path``; None for other models."""
    if cfg.model.image_dim is None:
        return None
    if not cfg.image_encoder.path:
        raise UserError("model.image_dim: this model embeds CLIP features of the given frame; set image_encoder.path "
                        "to its image encoder (a diffusers Wan I2V folder, its image_encoder/, or Wan's download with "
                        "models_clip_*.pth)")
    encoder = get_spec(cfg.model.family).build_image_encoder(cfg.image_encoder.path, DTYPES[cfg.image_encoder.dtype])
    if encoder.dim != cfg.model.image_dim:
        raise UserError(f"image_encoder.path={cfg.image_encoder.path} gives {encoder.dim}-wide features but "
                        f"model.image_dim={cfg.model.image_dim}; point it at the model's own image encoder")
    return encoder.to(device)


def first_frame_features(image_encoder, video: torch.Tensor) -> torch.Tensor | None:
    """The image features (``Conditions.image``) of each clip's first frame, ``video`` [B, 3, T, H,
    W] in [-1, 1]; None without an image encoder. Wan encodes the image it is given at its own
    size; here it is the clip's first frame at the bucket's size (CLIP squashes both to 224x224)."""
    if image_encoder is None:
        return None
    with torch.no_grad():
        return image_encoder.encode(video[:, :, 0]).float()


def first_frame_given(model, vae, video: torch.Tensor) -> torch.Tensor | None:
    """The conditioning channels of a model that takes a given first frame (Wan i2v): ``video``
    [B, 3, T, H, W] in [-1, 1] with every frame after the first zero (mid-grey), through the VAE,
    as Wan builds its ``y``; None for other models."""
    spec = spec_of(model)
    if not spec.takes_first_frame(model.geometry):
        return None
    first = torch.zeros_like(video)
    first[:, :, 0] = video[:, :, 0]
    with torch.no_grad():
        return spec.first_frame_condition(vae.encode(first).float())


def model_geometry(cfg: Config, latent_channels: int, caption_channels: int):
    """The model's arguments (its family's geometry) from the config and the encoders' sizes."""
    return get_spec(cfg.model.family).geometry(cfg.model, latent_channels, caption_channels, cfg.text.max_length)


def build_model(cfg: Config, vae, text) -> torch.nn.Module:
    """The model, with the parts ``model.freeze_*`` name excluded from training; with
    ``model.expert=both``, the two experts of a two-expert model as one module."""
    return model_of(cfg, model_geometry(cfg, vae.latent_channels, text.dim))


def model_of(cfg: Config, geometry) -> torch.nn.Module:
    """The model of ``geometry`` as ``cfg.model`` has it built (see :func:`build_model`)."""
    spec = get_spec(cfg.model.family)

    def one():
        return spec.configure(spec.build(geometry), cfg.model)
    if cfg.model.expert == "both":
        return spec.combine_experts(one(), one(), cfg.model.expert_boundary)
    return one()


def one_model_tensors(cfg: Config, tensors: dict) -> dict:
    """The tensors of one whole model in a state dict of ``cfg``'s model: the high-noise expert's
    of a ``model.expert=both`` model (both have the same sizes), else all of them."""
    if cfg.model.expert != "both":
        return tensors
    prefix = get_spec(cfg.model.family).expert_prefixes[0]
    return {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}
