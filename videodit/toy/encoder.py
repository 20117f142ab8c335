"""The toy text encoder: a fixed, weight-free embedding of the toy vocabulary."""

from __future__ import annotations

import math
import string

import torch
from torch import Tensor

from videodit.errors import UserError
from videodit.models.text import FrozenTextEncoder, as_caption_list
from videodit.toy.vocabulary import COLOURS, DIRECTIONS, SHAPES

TOY_MAX_LENGTH = 8   # caption tokens when text.max_length is not given

PAD_TOKEN, UNK_TOKEN = "<pad>", "<unk>"
# Fixed order: ids must never change, or toy checkpoints would silently mean other words.
TOY_VOCAB = (PAD_TOKEN, UNK_TOKEN, "a", *COLOURS, *SHAPES, "moving", *DIRECTIONS)


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

    def __init__(self, dim: int = 64, max_length: int = TOY_MAX_LENGTH, seed: int = 0, audio_dim: int | None = None):
        super().__init__()
        if dim < 1 or max_length < 1 or (audio_dim is not None and audio_dim < 1):
            raise UserError(f"text.dim={dim}, text.max_length={max_length} and the audio text width {audio_dim} "
                            "must be positive")
        self.dim, self.max_length, self.seed = int(dim), int(max_length), int(seed)
        self.audio_dim = self.dim if audio_dim is None else int(audio_dim)
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
        captions = as_caption_list(captions)
        ids, mask = self.token_ids(captions)
        ids, mask = ids.to(self.token_table.device), mask.to(self.token_table.device)
        embeddings = self.token_table[ids] + self.position_table[None]
        return (embeddings * mask[..., None]).float(), mask   # float32 out, as every encoder (bf16 tables on GPUs)

    @torch.no_grad()
    def encode_streams(self, captions: list[str]) -> tuple[Tensor, Tensor, Tensor]:
        """(video text, audio text, mask), as LTX-2's encoder gives its two streams: the audio
        stream's is the same table read at its own width (``audio_dim``; a wider one is repeated:
        the words stay apart either way)."""
        y, mask = self.encode(captions)
        repeats = -(-self.audio_dim // self.dim)
        return y, y.repeat(1, 1, repeats)[..., : self.audio_dim].contiguous(), mask
