"""Frozen text encoder adapters: captions -> padded token embeddings + mask.

Every adapter is an ``nn.Module`` with ``dim`` and ``max_length`` attributes and
``encode(captions) -> (embeddings float32 [B, max_length, dim], mask bool [B, max_length])``
where ``mask`` is True for real tokens. Embeddings at padded positions are zero, so a
consumer that ignores the mask still sees nothing from padding. Encoders are frozen
(no grad, always eval) and never download anything.
"""

from __future__ import annotations

import math
import string
from pathlib import Path

import torch
from torch import Tensor, nn

from videodit.data.toy import COLOURS, DIRECTIONS, SHAPES
from videodit.errors import UserError

TEXT_KINDS = ("toy", "transformers")

# Defaults used by build_text_encoder when max_length is None.
TOY_MAX_LENGTH = 8
HF_MAX_LENGTH = 120

PAD_TOKEN, UNK_TOKEN = "<pad>", "<unk>"
# Fixed order: ids must never change, or toy checkpoints would silently mean other words.
TOY_VOCAB = (PAD_TOKEN, UNK_TOKEN, "a", *COLOURS, *SHAPES, "moving", *DIRECTIONS)


class FrozenTextEncoder(nn.Module):
    """Shared freezing behaviour for text encoder adapters."""

    dim: int
    max_length: int

    def _freeze(self) -> None:
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> "FrozenTextEncoder":
        # A parent model calling .train() must not re-enable dropout in the frozen encoder.
        return super().train(False)

    def encode(self, captions: list[str]) -> tuple[Tensor, Tensor]:  # pragma: no cover
        raise NotImplementedError


# --------------------------------------------------------------------------- toy encoder


def _as_caption_list(captions: list[str] | str) -> list[str]:
    # A bare string would otherwise be iterated character by character.
    return [captions] if isinstance(captions, str) else list(captions)


def toy_tokenize(caption: str) -> list[str]:
    """Lower-case whitespace tokenisation; punctuation at word edges is dropped."""
    words = (w.strip(string.punctuation) for w in caption.lower().split())
    return [w for w in words if w]


def _sinusoidal_positions(length: int, dim: int) -> Tensor:
    """Standard transformer sin/cos position table [length, dim] (odd dims padded)."""
    half = (dim + 1) // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * freqs[None, :]
    table = torch.cat([angles.sin(), angles.cos()], dim=1)[:, :dim]
    return table.float()


class ToyTextEncoder(FrozenTextEncoder):
    """A weight-free encoder for the toy caption vocabulary.

    Token rows come from a fixed-seed CPU ``torch.Generator`` and are normalised to unit
    length; a sinusoidal position encoding (scaled to norm 0.5 so it does not swamp the
    word identity) is added. Everything is rebuilt from ``seed``, so the encoder is
    identical on every machine and needs no file. Unknown words map to ``<unk>``.
    """

    def __init__(self, dim: int = 64, max_length: int = TOY_MAX_LENGTH, seed: int = 0):
        super().__init__()
        if dim < 1 or max_length < 1:
            raise UserError(f"text.dim={dim} and text.max_length={max_length} must be positive")
        self.dim, self.max_length, self.seed = int(dim), int(max_length), int(seed)
        self.vocab = {word: i for i, word in enumerate(TOY_VOCAB)}
        generator = torch.Generator().manual_seed(self.seed)
        table = torch.randn(len(TOY_VOCAB), self.dim, generator=generator)
        table = table / table.norm(dim=1, keepdim=True)
        positions = _sinusoidal_positions(self.max_length, self.dim)
        positions = 0.5 * positions / positions.norm(dim=1, keepdim=True)
        # Buffers (not parameters): they move with .to() but are never trained. Not
        # persistent, since they are fully determined by the seed and would only bloat
        # checkpoints.
        self.register_buffer("token_table", table, persistent=False)
        self.register_buffer("position_table", positions, persistent=False)
        self._freeze()

    def token_ids(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        """Ids [B, max_length] (padded/truncated) and the real-token mask."""
        unk, pad = self.vocab[UNK_TOKEN], self.vocab[PAD_TOKEN]
        ids = torch.full((len(captions), self.max_length), pad, dtype=torch.long)
        mask = torch.zeros((len(captions), self.max_length), dtype=torch.bool)
        for row, caption in enumerate(captions):
            words = toy_tokenize(caption)[: self.max_length]
            ids[row, : len(words)] = torch.tensor([self.vocab.get(w, unk) for w in words], dtype=torch.long)
            # Mask by length, not by id, so a literal "<pad>" word still counts as a token.
            mask[row, : len(words)] = True
        return ids, mask

    @torch.no_grad()
    def encode(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        captions = _as_caption_list(captions)
        ids, mask = self.token_ids(captions)
        ids, mask = ids.to(self.token_table.device), mask.to(self.token_table.device)
        embeddings = self.token_table[ids] + self.position_table[None]
        return embeddings * mask[..., None], mask


# --------------------------------------------------------------------------- transformers


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _model_dim(config) -> int:
    """Hidden size of the text tower (T5: d_model; BERT/CLIP/LLMs: hidden_size)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("d_model", "hidden_size", "n_embd", "dim"):
        value = getattr(text_config, name, None)
        if isinstance(value, int):
            return value
    raise UserError(f"cannot tell the hidden size of a {config.model_type!r} model; check text.path")


def _load_text_model(path: str, config, dtype: torch.dtype) -> nn.Module:
    """The encoder part of the model at ``path``.

    T5-family configs load only their encoder class (no decoder weights in memory); CLIP
    loads its text tower; other encoder-decoders load fully and keep ``get_encoder()``;
    everything else (BERT, LLMs) loads with AutoModel and uses ``last_hidden_state``.
    """
    import transformers

    encoder_classes = {
        "t5": "T5EncoderModel",
        "mt5": "MT5EncoderModel",
        "umt5": "UMT5EncoderModel",
        "clip": "CLIPTextModel",
        "siglip": "SiglipTextModel",
    }
    cls = getattr(transformers, encoder_classes.get(config.model_type, "AutoModel"), transformers.AutoModel)
    # transformers >= 4.56 renamed torch_dtype to dtype; older releases only know the old name.
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    dtype_kwarg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    model = cls.from_pretrained(path, local_files_only=True, **{dtype_kwarg: dtype})
    if getattr(config, "is_encoder_decoder", False) and hasattr(model, "get_encoder"):
        model = model.get_encoder()
    return model


class HFTextEncoder(FrozenTextEncoder):
    """Any transformers text encoder from a local folder (T5, CLIP text, BERT, LLMs...)."""

    def __init__(self, path: str, max_length: int = HF_MAX_LENGTH, dtype: torch.dtype = torch.float32):
        super().__init__()
        try:
            from transformers import AutoConfig, AutoTokenizer
        except ImportError:
            raise UserError(
                "text.kind='transformers' needs the transformers package: pip install 'videodit[hf]'"
            ) from None

        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model = _load_text_model(path, config, dtype)
        except (OSError, ValueError, KeyError) as exc:
            message = f"cannot load the text encoder from text.path='{path}': {_one_line(exc)}"
            raise UserError(message) from None
        if self.tokenizer.pad_token is None:
            # Decoder-only LLM tokenizers often lack a pad token; EOS is the usual stand-in
            # (padded positions are masked out and zeroed anyway).
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.dim = _model_dim(config)
        self.max_length = int(max_length)
        self._freeze()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def encode(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        captions = _as_caption_list(captions)
        tokens = self.tokenizer(
            captions,
            padding="max_length",
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        input_ids = tokens["input_ids"].to(self.device)
        mask = tokens["attention_mask"].to(self.device).bool()
        hidden = self.model(input_ids=input_ids, attention_mask=mask.long()).last_hidden_state
        return hidden.float() * mask[..., None], mask


# --------------------------------------------------------------------------- factory


def _check_model_folder(path: str | None) -> str:
    if path is None or str(path).strip() == "":
        raise UserError(
            "text.path is required for text.kind='transformers': point it to a local "
            "transformers model folder (nothing is downloaded)"
        )
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(
            f"text.path='{path}' is not an existing folder: point text.path to a local "
            "transformers model folder (nothing is downloaded)"
        )
    if not (folder / "config.json").is_file():
        raise UserError(
            f"text.path='{path}' has no config.json: point text.path to a transformers "
            "model folder saved with save_pretrained"
        )
    return str(folder)


def build_text_encoder(
    kind: str,
    path: str | None = None,
    max_length: int | None = None,
    dim: int = 64,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Build a frozen text encoder.

    ``kind='toy'``: :class:`ToyTextEncoder` with ``dim`` (``path`` is ignored).
    ``kind='transformers'``: :class:`HFTextEncoder` from the local folder ``path``; ``dim``
    is ignored (it comes from the model config).
    ``max_length=None`` means 8 for the toy encoder and 120 for transformers models.
    """
    if kind == "toy":
        return ToyTextEncoder(dim=dim, max_length=max_length or TOY_MAX_LENGTH)
    if kind == "transformers":
        folder = _check_model_folder(path)
        return HFTextEncoder(folder, max_length=max_length or HF_MAX_LENGTH, dtype=dtype)
    raise UserError(f"text.kind={kind!r} is not supported; choose one of: {', '.join(TEXT_KINDS)}")


__all__ = [
    "TEXT_KINDS",
    "TOY_VOCAB",
    "FrozenTextEncoder",
    "ToyTextEncoder",
    "HFTextEncoder",
    "build_text_encoder",
    "toy_tokenize",
]
