"""Wan 2.1's text encoder: umT5-XXL's encoder (transformers ``UMT5EncoderModel``), 512 tokens.

Wan (``wan/modules/t5.py``, ``T5EncoderModel.__call__``) cleans each prompt (ftfy, HTML
entities, runs of whitespace), tokenizes it padded to ``text_len=512``, runs the encoder WITH
the attention mask, cuts each output to the prompt's true length (EOS included) and its DiT
zero-pads it back to 512. diffusers' ``WanPipeline._get_t5_prompt_embeds`` does the same. Here
the result is the padded tensor plus the mask: ``(emb float32 [B, 512, dim], mask bool)``, zero
past each prompt's length, as every ``FrozenTextEncoder`` returns.

The folder is diffusers' layout (``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``: ``text_encoder/`` and
``tokenizer/``) or one folder holding both; nothing is downloaded, no code is executed.
"""

from __future__ import annotations

import html
from pathlib import Path

import torch
from torch import Tensor

from videodit.errors import UserError
from videodit.models.text_base import FrozenTextEncoder, as_caption_list
from videodit.user_files import read_user_json

try:   # what Wan and diffusers use; the stdlib's re differs only on a few control characters
    import regex as _re
except ImportError:  # pragma: no cover
    import re as _re

WAN_TEXT_LENGTH = 512   # wan/configs/shared_config.py: text_len

# wan/configs/shared_config.py: sample_neg_prompt, the negative prompt of every Wan 2.1 sampler.
WAN_NEGATIVE_PROMPT = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，"
                       "JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，"
                       "形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model")
_WHERE_TO_GET = ("point text.path to the Wan 2.1 diffusers folder (text_encoder/ + tokenizer/, e.g. "
                 "Wan-AI/Wan2.1-T2V-1.3B-Diffusers) or to a folder holding both (nothing is downloaded)")


def clean_prompt(text: str) -> str:
    """Wan's ``clean='whitespace'``: ftfy's fixes (when ftfy is installed, as diffusers does), HTML
    entities decoded twice, whitespace runs collapsed to one space."""
    try:
        import ftfy
        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return _re.sub(r"\s+", " ", text).strip()


class UMT5TextEncoder(FrozenTextEncoder):
    """A frozen umT5 encoder and its tokenizer, loaded from ``model_dir`` and ``tokenizer_dir``."""

    def __init__(self, model_dir: Path, tokenizer_dir: Path, max_length: int = WAN_TEXT_LENGTH,
                 dtype: torch.dtype = torch.float32, clean: bool = True):
        super().__init__()
        try:
            import transformers
            from transformers import AutoTokenizer, UMT5EncoderModel
        except ImportError:
            raise UserError("text.kind=umt5 needs the transformers package: pip install 'videodit[hf]'") from None
        # transformers >= 4.56 renamed torch_dtype to dtype; older releases only know the old name.
        major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
        dtype_kwarg = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
            self.model = UMT5EncoderModel.from_pretrained(str(model_dir), local_files_only=True,
                                                          **{dtype_kwarg: dtype})
        except (OSError, ValueError, KeyError, ImportError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise UserError(f"cannot load the umT5 encoder from {model_dir} / {tokenizer_dir}: {first}") from None
        # Trimming keeps the first `length` positions, as Wan does, so padding must be on the right.
        self.tokenizer.padding_side = "right"
        self.dim = int(self.model.config.d_model)
        self.max_length = int(max_length)
        self.clean = clean
        self._freeze()

    @torch.no_grad()
    def encode(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        captions = as_caption_list(captions)
        if self.clean:
            captions = [clean_prompt(c) for c in captions]
        tokens = self.tokenizer(captions, padding="max_length", truncation=True, max_length=self.max_length,
                                add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids, attention = tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=attention).last_hidden_state
        # Wan's u[:len] followed by zero padding, as one mask.
        lengths = attention.gt(0).sum(dim=1)
        mask = torch.arange(ids.shape[1], device=ids.device)[None] < lengths[:, None]
        return torch.where(mask[..., None], hidden.float(), 0.0), mask


# --------------------------------------------------------------------------- factory


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in _TOKENIZER_FILES)


def umt5_folders(path: str | None) -> tuple[Path, Path]:
    """The model and tokenizer folders of ``path``: ``text_encoder/`` + ``tokenizer/`` (diffusers),
    one folder holding both, or a ``text_encoder/`` folder whose sibling is ``tokenizer/``."""
    if path is None or not str(path).strip():
        raise UserError(f"text.path is required for text.kind=umt5: {_WHERE_TO_GET}")
    root = Path(path).expanduser()
    if not root.is_dir():
        raise UserError(f"text.path='{path}' is not an existing folder: {_WHERE_TO_GET}")
    if (root / "text_encoder" / "config.json").is_file():
        model_dir = root / "text_encoder"
        candidates = [root / "tokenizer", model_dir, root]
    elif (root / "config.json").is_file():
        model_dir = root
        candidates = [root, root.parent / "tokenizer"]
    else:
        originals = sorted(p.name for p in root.glob("models_t5*.pth"))
        hint = f" (its {originals[0]} is Wan's original layout, which videodit does not read)" if originals else ""
        raise UserError(f"text.path='{path}' has neither text_encoder/config.json nor config.json{hint}; "
                        f"{_WHERE_TO_GET}")
    tokenizer_dir = next((folder for folder in candidates if _has_tokenizer(folder)), None)
    if tokenizer_dir is None:
        raise UserError(f"text.path='{path}' has no tokenizer (tokenizer/ with tokenizer.json or spiece.model); "
                        f"{_WHERE_TO_GET}")
    return model_dir, tokenizer_dir


def _check_model_type(model_dir: Path) -> None:
    try:
        model_type = read_user_json(model_dir / "config.json").get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise UserError(f"cannot read {model_dir / 'config.json'} ({exc}); fix or replace it") from None
    if model_type != "umt5":
        raise UserError(f"{model_dir / 'config.json'} has model_type={model_type!r}, not 'umt5' (Wan 2.1's "
                        "umT5-XXL); for another encoder use text.kind=transformers")


def load_umt5(path: str | None, max_length: int = WAN_TEXT_LENGTH, dtype: torch.dtype = torch.float32,
              clean: bool = True) -> UMT5TextEncoder:
    """A frozen :class:`UMT5TextEncoder` from the local folder ``path`` (see :func:`umt5_folders`).
    ``dtype``: weights and compute (Wan runs umT5 in bf16); embeddings come out fp32.
    ``clean``: apply Wan's prompt cleaning first."""
    model_dir, tokenizer_dir = umt5_folders(path)
    _check_model_type(model_dir)
    return UMT5TextEncoder(model_dir, tokenizer_dir, max_length=max_length or WAN_TEXT_LENGTH, dtype=dtype,
                           clean=clean)


__all__ = ["WAN_NEGATIVE_PROMPT", "WAN_TEXT_LENGTH", "UMT5TextEncoder", "clean_prompt", "load_umt5", "umt5_folders"]
