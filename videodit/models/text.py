"""Frozen text encoder adapters: captions -> padded token embeddings + mask.

Every adapter is an ``nn.Module`` with ``dim`` and ``max_length`` attributes and
``encode(captions) -> (embeddings float32 [B, max_length, dim], mask bool [B, max_length])``
where ``mask`` is True for real tokens. Embeddings at padded positions are zero, so a
consumer that ignores the mask still sees nothing from padding. Encoders are frozen
(no grad, always eval) and never download anything.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from videodit.errors import UserError
from videodit.models.text_base import FrozenTextEncoder, as_caption_list

HF_MAX_LENGTH = 120   # caption tokens when text.max_length is not given


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

    @torch.no_grad()
    def encode(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        captions = as_caption_list(captions)
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


def load_text_encoder(path: str | None, max_length: int | None = None,
                      dtype: torch.dtype = torch.float32) -> HFTextEncoder:
    """A frozen :class:`HFTextEncoder` from the local transformers folder ``path``
    (``max_length=None``: 120 tokens)."""
    return HFTextEncoder(_check_model_folder(path), max_length=max_length or HF_MAX_LENGTH, dtype=dtype)
