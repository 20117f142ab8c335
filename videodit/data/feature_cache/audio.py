"""Soundtracks in a feature cache: the audio VAE's latents of each clip's soundtrack, stored beside
its video latents for a ``model.train_audio`` run (LTX-2), and read back in its place.

Per sample three tensors (cache dtype), encoded by ``videodit cache build`` with the config's audio
VAE exactly as ``AudioStream.tokens`` encodes on the fly (``encode_soundtracks``):

* ``audio``: the normalised posterior means ``[C, T', F]`` of the clip's log-mel (``VideoDataset(...,
  audio=AudioSpec.from_config(cfg.data))``), cut at ``latent_frames(length)``. ``T'`` follows the
  clip's own soundtrack length (its frame times), so the shard check takes it from the header and
  checks channels, bins, dtype and byte count; the shard's SHA-256 covers its bytes.
* ``audio_mask``: ``[1]``, 1 where the clip has a soundtrack, 0 for silence (no audio loss).
* ``audio_text``: the audio stream's caption tokens (``encode_streams``' second output), the same
  run of valid tokens as the video caption's (``text_offset``, ``text_len``), ``[n, D_audio]``.

The manifest holds ``audio`` (the geometry: ``latent_channels``, ``latent_mel_bins``, ``text_dim``)
and ``encoders.audio`` (the audio VAE's identity: ``format.encoder_identity``); only an audio
cache has them, so a video cache is byte for byte what it was. An audio cache trains a video-only
run (the audio tensors are not read); a video-only cache is refused for an audio run in one line.
This module is a leaf below reader.py, verify.py and training.py.
"""

from __future__ import annotations

import torch

from videodit.errors import UserError

AUDIO, AUDIO_MASK, AUDIO_TEXT = "audio", "audio_mask", "audio_text"
TENSORS = (AUDIO, AUDIO_MASK, AUDIO_TEXT)
ANY = -1   # a free dimension in an expected shape: the audio latents' time


def holds_audio(manifest: dict) -> bool:
    return "audio" in manifest


def manifest_entries(encoder, text_dim: int | None) -> dict:
    """The manifest's ``audio`` geometry of a build with the audio VAE ``encoder`` (none without)."""
    if encoder is None:
        return {}
    return {"audio": {"latent_channels": int(encoder.latent_channels), "latent_mel_bins": int(encoder.latent_mel_bins),
                      "text_dim": int(text_dim)}}


def audio_problem(manifest: dict) -> str | None:
    """What makes the audio keys of a manifest unusable, or None."""
    if "audio" not in manifest:
        return None
    geometry = manifest["audio"]
    if not isinstance(geometry, dict) or not all(
            isinstance(geometry.get(k), int) and not isinstance(geometry.get(k), bool) and geometry[k] >= 1
            for k in ("latent_channels", "latent_mel_bins", "text_dim")):
        return "audio is not {latent_channels, latent_mel_bins, text_dim} of positive integers"
    identity = manifest["encoders"].get("audio")
    if not isinstance(identity, dict) or not isinstance(identity.get("kind"), str):
        return "it holds audio latents but encoders.audio names no audio VAE"
    return None


def tensor_shapes(manifest: dict, text_len: int) -> dict[str, list[int]]:
    """Audio tensor name -> shape of one sample's stored tensor (``ANY``: free), none without audio."""
    if not holds_audio(manifest):
        return {}
    g = manifest["audio"]
    return {AUDIO: [g["latent_channels"], ANY, g["latent_mel_bins"]], AUDIO_MASK: [1],
            AUDIO_TEXT: [int(text_len), g["text_dim"]]}


def require_audio(manifest: dict, where: str) -> None:
    """Refuse, in one line with the fix, a cache without audio latents for a ``model.train_audio`` run."""
    if not holds_audio(manifest):
        raise UserError(f"data.cache={where} holds no audio latents, which model.train_audio trains on: build a cache "
                        "with this run's config (model.train_audio=true and audio.*), `videodit cache build CONFIG "
                        "--out NEW_DIR`, and train from that")


# --------------------------------------------------------------------------- build


def encode_soundtracks(encoder, mels: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Each clip's audio latents ``[C, latent_frames(T_i), F]`` (float32) from its log-mel ``[2, T_i,
    bins]``, as ``AudioStream.tokens`` encodes a batch on the fly: clips of one length in one batch,
    clips of different lengths each alone at its own length."""
    lengths = [int(m.shape[1]) for m in mels]
    if len(set(lengths)) == 1:
        latents = encoder.encode(torch.stack(mels).to(device)).float()
        return [latents[i, :, :encoder.latent_frames(n)] for i, n in enumerate(lengths)]
    return [encoder.encode(m[None].to(device)).float()[0, :, :encoder.latent_frames(n)]
            for m, n in zip(mels, lengths)]


def soundtrack_tensors(encoder, text, samples: list[dict], captions: list[str], mask: torch.Tensor,
                       device: torch.device) -> dict[str, list[torch.Tensor]]:
    """The audio tensors of a build's batch of decoded ``samples`` (with ``audio``, ``audio_mask``),
    name -> one per sample: the latents, the mask and the audio stream's caption tokens (``text``'s
    ``encode_streams``, cut to the valid run of the video caption's ``mask``)."""
    _, context, _ = text.encode_streams(captions)
    runs = []
    for row in mask.cpu():
        valid = torch.nonzero(row).flatten()
        runs.append(slice(int(valid[0]), int(valid[-1]) + 1) if len(valid) else slice(0, 0))
    return {AUDIO: encode_soundtracks(encoder, [s["audio"] for s in samples], device),
            AUDIO_MASK: [torch.tensor([1.0 if s["audio_mask"] else 0.0]) for s in samples],
            AUDIO_TEXT: [context[i, run].float() for i, run in enumerate(runs)]}


# --------------------------------------------------------------------------- training


def collate_audio(samples: list[dict], max_length: int, text_dim: int) -> dict:
    """The audio fields of a ``CachedBatch`` (none where the samples carry no audio): latents padded
    with zeros to the longest, each clip's latent frames, the mask, and the audio stream's caption
    tokens padded back to ``max_length`` as the video caption's."""
    if AUDIO not in samples[0]:
        return {}
    frames = torch.tensor([s[AUDIO].shape[1] for s in samples], dtype=torch.int64)
    first = samples[0][AUDIO]
    latents = torch.zeros(len(samples), first.shape[0], int(frames.max()), first.shape[2])
    context = torch.zeros(len(samples), max_length, text_dim)
    for i, s in enumerate(samples):
        latents[i, :, : s[AUDIO].shape[1]] = s[AUDIO].float()
        n, offset = s[AUDIO_TEXT].shape[0], s["offset"]
        context[i, offset : offset + n] = s[AUDIO_TEXT].float()
    mask = torch.stack([s[AUDIO_MASK].reshape(()) != 0 for s in samples])
    return {"audio_latents": latents, "audio_frames": frames, "audio_mask": mask, "audio_context": context}


class CachedAudioEncoder:
    """What the audio stream needs of the audio VAE when its latents are cached: the token layout
    (``tokens``: ``b c t f -> b t (c f)``, as the VAE's) and width. Encoding says it was not built."""

    def __init__(self, manifest: dict):
        g = manifest["audio"]
        self.latent_channels, self.latent_mel_bins = int(g["latent_channels"]), int(g["latent_mel_bins"])
        self.token_width = self.latent_channels * self.latent_mel_bins
        self.text_dim = int(g["text_dim"])

    def tokens(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.permute(0, 2, 1, 3).flatten(2)

    def encode(self, mel):
        raise UserError("training from data.cache builds no audio VAE, so no soundtrack can be encoded")

    def to(self, *args, **kwargs) -> "CachedAudioEncoder":
        return self
