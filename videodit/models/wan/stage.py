"""A Wan pipeline stage (``parallel/pipeline.py`` cuts the model, this says what a piece is).

Between Wan stages travel the token sequence [B, L, D], the block modulation input e0
[B, 6, D], the head's e [B, D] (per token, [B, L, 6, D] and [B, L, D], when the model inputs
carry a frame mask), the embedded context [B, image_tokens + text_len, D] and the RoPE table
[B, L, head_dim/2, 2] (repeated per sample so the schedule can cut it into micro-batches;
no gradient flows through it). The last stage ends with the head: output patches
[B, L, patch values], which ``WanSpec.stage_latents`` unpatchifies. Pure: no torch.distributed.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from videodit.models.wan.model import WanDiT

EMBEDDING = ("patch_embedding", "text_embedding", "time_embedding", "time_projection")


class WanStage(nn.Module):
    """Part of a WanDiT: optionally the embedding, a run of blocks, optionally the head."""

    def __init__(self, model: WanDiT, block_ids: Sequence[int], *, first: bool, last: bool):
        super().__init__()
        self.geometry = model.geometry
        self.first, self.last = first, last
        self._model = [model]   # for embed/unpatchify only; a list keeps it out of the state dict
        if first:
            for name in EMBEDDING:
                setattr(self, name, getattr(model, name))
        # Blocks keep their names in the whole model (blocks.N): checkpoints add up across stages.
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in block_ids})
        self._order = sorted(block_ids)
        if last:
            self.head = model.head

    def forward(self, *args):
        """First stage: the model inputs (x, t, context[, x_mask]). Other stages: the previous
        stage's outputs. Returns the inter-stage tensors, or on the last stage the output patches."""
        if self.first:
            x, t, context, *x_mask = args
            tokens, e0, e, context, rope = self._model[0].embed(x, t, context, *x_mask)
            rope = rope.expand(x.shape[0], *rope.shape)
        else:
            tokens, e0, e, context, rope = args
        for i in self._order:
            tokens = self.blocks[str(i)](tokens, e0, context, rope[0])
        if self.last:
            return self.head(tokens, e)
        return tuple(v.float().contiguous() for v in (tokens, e0, e, context, rope))


def stage_io(stage: WanStage, inputs: tuple[torch.Tensor, ...], microbatches: int) -> dict:
    """Meta tensors of one micro-batch's stage inputs and outputs, from the model inputs
    (x, t, context[, x_mask]) of the whole batch."""
    x, t = inputs[:2]
    per_token = (len(inputs) > 3 and inputs[3] is not None) or t.dim() == 2   # x_mask given, or t per token
    g = stage.geometry
    n = x.shape[0] // microbatches
    frames, height, width = (s // p for s, p in zip(x.shape[-3:], g.patch_size))
    tokens = frames * height * width

    def meta(*shape, grad=True):   # activations carry gradients between stages; RoPE does not
        return torch.empty(shape, dtype=torch.float32, device="meta", requires_grad=grad)

    time = (tokens,) if per_token else ()
    between = (meta(n, tokens, g.dim), meta(n, *time, 6, g.dim), meta(n, *time, g.dim),
               meta(n, g.image_tokens + g.text_len, g.dim), meta(n, tokens, g.head_dim // 2, 2, grad=False))
    root = tuple(torch.empty(n, *t.shape[1:], dtype=t.dtype, device="meta") for t in inputs)
    patch_values = g.out_channels * g.patch_size[0] * g.patch_size[1] * g.patch_size[2]
    output = meta(n, tokens, patch_values) if stage.last else between
    return dict(input_args=root if stage.first else between, output_args=output)
