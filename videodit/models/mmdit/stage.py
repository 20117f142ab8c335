"""An MMDiT pipeline stage (``parallel/pipeline.py`` cuts the model, this says what a piece is).

A stage is any contiguous run of ``model.blocks`` (the double blocks, then the single ones), so a
boundary may fall inside either stack or between them. Between stages travel the image tokens
[B, Li, D], the text tokens [B, Lt, D], ``vec`` [B, D], the RoPE table [B, Li, head_dim/2, 2]
(repeated per sample so the schedule can cut it into micro-batches; no gradient flows through it)
and, where the caption has a mask, that mask [B, Lt] (as 0/1 floats). The first stage holds the
embedders, the last the final layer: its output is the patches [B, Li, C p p], which
``MMDiTSpec.stage_latents`` unpatchifies. Pure: no torch.distributed.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from videodit.models.mmdit.model import MMDiT

EMBEDDING = ("img_in", "time_in", "vector_in", "cond_in", "txt_in")


class MMDiTStage(nn.Module):
    """Part of an MMDiT: optionally the embedders, a run of blocks, optionally the final layer."""

    def __init__(self, model: MMDiT, block_ids: Sequence[int], *, first: bool, last: bool):
        super().__init__()
        self.geometry = model.geometry
        self.first, self.last = first, last
        self._model = [model]   # for embed/unpatchify only; a list keeps it out of the state dict
        if first:
            for name in EMBEDDING:
                if hasattr(model, name):
                    setattr(self, name, getattr(model, name))
        # Blocks keep their names in the whole model (double_blocks.N, single_blocks.N), so the
        # checkpoints of the stages add up to the model's.
        depth = self.geometry.depth
        self._order = self.block_ids = sorted(block_ids)   # their numbers in the whole model's blocks
        self.double_blocks = nn.ModuleDict({str(i): model.double_blocks[i] for i in self._order if i < depth})
        self.single_blocks = nn.ModuleDict({str(i - depth): model.single_blocks[i - depth]
                                            for i in self._order if i >= depth})
        if last:
            self.final_layer = model.final_layer

    @property
    def blocks(self) -> list[nn.Module]:
        return [*self.double_blocks.values(), *self.single_blocks.values()]

    def forward(self, *args):
        """First stage: the model inputs (x, t, y, pooled, cond[, y_mask]). Other stages: the
        previous stage's outputs. Returns the inter-stage tensors, or on the last stage the
        output patches."""
        if self.first:
            x, t, y, pooled, cond, *y_mask = args
            img, txt, vec, rope = self._model[0].embed(x, t, y, pooled, cond)
            rope = rope.expand(x.shape[0], *rope.shape)
            mask = tuple(m.float() for m in y_mask if m is not None)
        else:
            img, txt, vec, rope, *mask = args
        text_mask = tuple(m > 0.5 for m in mask)
        for block in self.blocks:
            img, txt = block(img, txt, vec, rope[0], *text_mask)
        if self.last:
            return self.final_layer(img, vec)
        return tuple(v.float().contiguous() for v in (img, txt, vec, rope, *mask))


def stage_io(stage: MMDiTStage, inputs: tuple[torch.Tensor, ...], microbatches: int) -> dict:
    """Meta tensors of one micro-batch's stage inputs and outputs, from the model inputs
    (x, t, y, pooled, cond[, y_mask]) of the whole batch."""
    x, t, y = inputs[:3]
    g = stage.geometry
    n = x.shape[0] // microbatches
    frames, rows, columns = x.shape[2], x.shape[3] // g.patch, x.shape[4] // g.patch
    tokens, text = frames * rows * columns, y.shape[1]

    def meta(*shape, grad=True):   # activations carry gradients between stages; RoPE and the mask do not
        return torch.empty(shape, dtype=torch.float32, device="meta", requires_grad=grad)

    masked = len(inputs) > 5 and inputs[5] is not None
    between = (meta(n, tokens, g.hidden_size), meta(n, text, g.hidden_size), meta(n, g.hidden_size),
               meta(n, tokens, g.head_dim // 2, 2, grad=False), *((meta(n, text, grad=False),) if masked else ()))
    root = tuple(torch.empty(n, *v.shape[1:], dtype=v.dtype, device="meta") for v in inputs)
    output = meta(n, tokens, g.in_channels) if stage.last else between
    return dict(input_args=root if stage.first else between, output_args=output)
