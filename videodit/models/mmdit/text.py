"""Open-Sora 2.0's text conditioning: T5-XXL token features and CLIP-L's pooled vector.

Open-Sora (``opensora/models/text/conditioner.py``, ``HFEmbedder``) tokenizes each caption for
``google/t5-v1_1-xxl`` padded to 512 tokens and runs the encoder WITHOUT an attention mask, so
the pad tokens carry features and its MMDiT attends to all 512; it runs the text tower of
``openai/clip-vit-large-patch14`` on 77 tokens and keeps ``pooler_output`` (the EOS token's
state), the vector the MMDiT's ``vector_in`` takes. Here:

* ``encode(captions) -> (y float32 [B, L, dim], mask bool [B, L])`` is T5. ``mask=False``
  (``text.mask: false``) is Open-Sora's run: no mask, every position a token (the mask is all
  True, so the model masks nothing). ``mask=True`` runs T5 with its mask and zeroes the pads,
  as every other videodit encoder; the model then masks the padded keys.
* ``encode_pooled(captions) -> float32 [B, pooled_dim]`` is CLIP's pooled vector.

Only the captions decide the features: Open-Sora's ``seq_align`` pads T5's input further when
(512 + image tokens) % sp != 0, which without a mask makes the features depend on the sequence
parallel size; videodit never pads text for sequence parallelism (text tokens are replicated on
every rank), so nothing of the kind exists here.

``text.path`` is a folder holding both encoders: ``t5/`` + ``clip/``, or Open-Sora's
``ckpts/`` download (``google/t5-v1_1-xxl/`` + ``openai/clip-vit-large-patch14/``). Each is a
local transformers folder; nothing is downloaded, no code is executed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from videodit.errors import UserError
from videodit.models.text_base import FrozenTextEncoder, as_caption_list
from videodit.user_files import read_user_json

T5_LENGTH = 512    # configs/diffusion/*: t5.max_length
CLIP_LENGTH = 77   # clip.max_length, CLIP's positions
# (T5 folder, CLIP folder) inside text.path, in the order they are looked for.
LAYOUTS = ((Path("t5"), Path("clip")),
           (Path("google/t5-v1_1-xxl"), Path("openai/clip-vit-large-patch14")))
_WHERE = ("point text.path to a folder holding t5/ and clip/ (transformers folders of google/t5-v1_1-xxl and "
          "openai/clip-vit-large-patch14) or to Open-Sora 2.0's ckpts/ download (nothing is downloaded)")


def _dtype_kwarg() -> str:
    import transformers
    # transformers >= 4.56 renamed torch_dtype to dtype; older releases only know the old name.
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


class OpenSora2TextEncoder(FrozenTextEncoder):
    """Frozen T5 (token features) and CLIP text tower (pooled vector), with their tokenizers."""

    def __init__(self, t5_dir: Path, clip_dir: Path, max_length: int = T5_LENGTH,
                 dtype: torch.dtype = torch.float32, mask: bool = False):
        super().__init__()
        try:
            from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5Tokenizer
        except ImportError:
            raise UserError("text.kind=t5-clip needs the transformers package: pip install 'videodit[hf]'") from None
        kwarg = {_dtype_kwarg(): dtype}
        try:   # the tokenizer classes Open-Sora uses (legacy T5 tokenization, as it asks)
            self.t5_tokenizer = T5Tokenizer.from_pretrained(str(t5_dir), legacy=True, local_files_only=True)
            self.t5 = T5EncoderModel.from_pretrained(str(t5_dir), local_files_only=True, **kwarg)
            self.clip_tokenizer = CLIPTokenizer.from_pretrained(str(clip_dir), local_files_only=True)
            self.clip = CLIPTextModel.from_pretrained(str(clip_dir), local_files_only=True, **kwarg)
        except (OSError, ValueError, KeyError, ImportError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise UserError(f"cannot load Open-Sora 2.0's text encoders from {t5_dir} and {clip_dir}: {first}") \
                from None
        self.dim = int(self.t5.config.d_model)
        self.pooled_dim = int(self.clip.config.hidden_size)
        self.max_length = int(max_length)
        self.clip_length = min(CLIP_LENGTH, int(self.clip.config.max_position_embeddings))
        self.mask = bool(mask)
        self._freeze()

    @torch.no_grad()
    def encode(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        tokens = self.t5_tokenizer(as_caption_list(captions), padding="max_length", truncation=True,
                                   max_length=self.max_length, return_tensors="pt")
        ids, real = tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device).bool()
        if not self.mask:   # Open-Sora: the pads are tokens like any other
            hidden = self.t5(input_ids=ids, attention_mask=None).last_hidden_state
            return hidden.float(), torch.ones_like(real)
        hidden = self.t5(input_ids=ids, attention_mask=real.long()).last_hidden_state
        return hidden.float() * real[..., None], real

    @torch.no_grad()
    def encode_pooled(self, captions: list[str]) -> Tensor:
        tokens = self.clip_tokenizer(as_caption_list(captions), padding="max_length", truncation=True,
                                     max_length=self.clip_length, return_tensors="pt")
        # No attention mask, as Open-Sora (CLIP's causal mask keeps the pads out of the EOS state anyway).
        return self.clip(input_ids=tokens["input_ids"].to(self.device)).pooler_output.float()


# --------------------------------------------------------------------------- factory


def opensora2_text_folders(path: str | None) -> tuple[Path, Path]:
    """(T5 folder, CLIP folder) inside ``text.path`` (see :data:`LAYOUTS`)."""
    if path is None or not str(path).strip():
        raise UserError(f"text.path is required for text.kind=t5-clip: {_WHERE}")
    root = Path(path).expanduser()
    if not root.is_dir():
        raise UserError(f"text.path='{path}' is not an existing folder: {_WHERE}")
    for t5, clip in LAYOUTS:
        if (root / t5 / "config.json").is_file() or (root / clip / "config.json").is_file():
            missing = [str(p) for p in (t5, clip) if not (root / p / "config.json").is_file()]
            if missing:
                raise UserError(f"text.path='{path}' has no {missing[0]}/config.json; {_WHERE}")
            return root / t5, root / clip
    raise UserError(f"text.path='{path}' holds neither t5/ + clip/ nor google/t5-v1_1-xxl/ + "
                    f"openai/clip-vit-large-patch14/; {_WHERE}")


def _check_model_type(folder: Path, want: tuple[str, ...], what: str) -> None:
    try:
        model_type = read_user_json(folder / "config.json").get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise UserError(f"cannot read {folder / 'config.json'} ({exc}); fix or replace it") from None
    if model_type not in want:
        raise UserError(f"{folder / 'config.json'} has model_type={model_type!r}, not {want[0]!r}: text.kind=t5-clip "
                        f"needs {what} there")


def load_opensora2_text(path: str | None, max_length: int | None = T5_LENGTH, dtype: torch.dtype = torch.float32,
                        mask: bool = False) -> OpenSora2TextEncoder:
    """A frozen :class:`OpenSora2TextEncoder` from the local folder ``path``
    (:func:`opensora2_text_folders`); ``max_length`` T5 tokens (None: 512); ``dtype`` weights and
    compute (Open-Sora runs both in bf16), features come out fp32; ``mask``: see the module."""
    t5_dir, clip_dir = opensora2_text_folders(path)
    _check_model_type(t5_dir, ("t5",), "a T5 encoder (google/t5-v1_1-xxl)")
    _check_model_type(clip_dir, ("clip_text_model", "clip"), "a CLIP text model (openai/clip-vit-large-patch14)")
    return OpenSora2TextEncoder(t5_dir, clip_dir, max_length=max_length or T5_LENGTH, dtype=dtype, mask=mask)


__all__ = ["CLIP_LENGTH", "T5_LENGTH", "OpenSora2TextEncoder", "load_opensora2_text", "opensora2_text_folders"]
