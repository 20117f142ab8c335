"""Tiny, randomly initialised stand-ins for a diffusers AutoencoderKL and a T5 text encoder
(with a word tokenizer over the toy vocabulary), saved as local folders. They let the
``vae.kind=diffusers`` and ``text.kind=transformers`` paths, and the feature cache built on
them, run offline: in the tests, the benchmarks, or for a user without the real weights. The Wan
2.1 ones (an AutoencoderKLWan, a umT5 encoder in diffusers' text_encoder/ + tokenizer/ layout) do
the same for ``vae.kind=wan2.1`` and the umT5 encoder."""

from __future__ import annotations

from pathlib import Path

import torch

from videodit.toy.encoder import TOY_VOCAB

# T5's special tokens first (pad 0, eos 1, unk 2), then the toy vocabulary's words.
TOY_WORDS = ("<pad>", "</s>", "<unk>", *TOY_VOCAB[2:])


def save_word_tokenizer(folder: Path, words: tuple[str, ...] | list[str] = TOY_WORDS) -> None:
    """A lower-casing, whitespace WordLevel tokenizer that appends ``</s>`` like T5's, saved for
    ``AutoTokenizer``. ``words`` must start with ``<pad>``, ``</s>``, ``<unk>``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>",
                            eos_token="</s>").save_pretrained(folder)


def save_t5(folder: Path, *, d_model: int = 16, d_ff: int = 32, d_kv: int = 8, num_layers: int = 1,
            num_heads: int = 2, words: tuple[str, ...] | list[str] = TOY_WORDS, seed: int = 0) -> Path:
    """A T5 encoder and its word tokenizer in ``folder``."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(vocab_size=len(words), d_model=d_model, d_ff=d_ff, d_kv=d_kv, num_layers=num_layers,
                      num_heads=num_heads, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    T5EncoderModel(config).save_pretrained(folder)
    save_word_tokenizer(folder, words)
    return Path(folder)


def save_kl_vae(folder: Path, *, block_out_channels: tuple[int, ...] = (8, 16), layers_per_block: int = 1,
                norm_num_groups: int = 8, latent_channels: int = 4, scaling_factor: float = 0.5,
                shift_factor: float | None = None, seed: int = 0) -> Path:
    """A 2-D AutoencoderKL in ``folder``: spatial compression ``2 ** (len(block_out_channels) - 1)``."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    blocks = len(block_out_channels)
    AutoencoderKL(block_out_channels=tuple(block_out_channels), down_block_types=("DownEncoderBlock2D",) * blocks,
                  up_block_types=("UpDecoderBlock2D",) * blocks, layers_per_block=layers_per_block,
                  latent_channels=latent_channels, norm_num_groups=norm_num_groups, scaling_factor=scaling_factor,
                  shift_factor=shift_factor).save_pretrained(folder)
    return Path(folder)


def save_wan_vae(folder: Path, *, base_dim: int = 4, z_dim: int = 4, dim_mult: tuple[int, ...] = (1, 2, 2),
                 num_res_blocks: int = 1, temperal_downsample: tuple[bool, ...] = (False, True),
                 latents_mean: tuple[float, ...] | None = None, latents_std: tuple[float, ...] | None = None,
                 seed: int = 0) -> Path:
    """A Wan 2.1-style AutoencoderKLWan in ``folder``: spatial compression ``2 ** len(temperal_downsample)``,
    temporal ``2 ** sum(temperal_downsample)``; latent statistics default to 0.1*i / 1 + 0.25*i."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    AutoencoderKLWan(base_dim=base_dim, z_dim=z_dim, dim_mult=list(dim_mult), num_res_blocks=num_res_blocks,
                     temperal_downsample=list(temperal_downsample),
                     latents_mean=list(latents_mean or [0.1 * i for i in range(z_dim)]),
                     latents_std=list(latents_std or [1 + 0.25 * i for i in range(z_dim)])).save_pretrained(folder)
    return Path(folder)


def save_umt5(folder: Path, *, d_model: int = 16, d_ff: int = 32, d_kv: int = 8, num_layers: int = 2,
              num_heads: int = 2, words: tuple[str, ...] | list[str] = TOY_WORDS, seed: int = 0) -> Path:
    """A umT5 encoder in ``folder/text_encoder`` and its word tokenizer in ``folder/tokenizer``
    (diffusers' Wan pipeline layout)."""
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config = UMT5Config(vocab_size=len(words), d_model=d_model, d_ff=d_ff, d_kv=d_kv, num_layers=num_layers,
                        num_heads=num_heads, relative_attention_num_buckets=8, relative_attention_max_distance=32,
                        feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    UMT5EncoderModel(config).save_pretrained(Path(folder) / "text_encoder")
    save_word_tokenizer(Path(folder) / "tokenizer", words)
    return Path(folder)
