"""An STDiT pipeline stage (``parallel/pipeline.py`` cuts the model, this says what a piece is).

Between STDiT stages travel five tensors: the token grid, the embedded caption, its mask, the
adaLN input ``t_mod`` and ``cond``; gradients flow back through all but the mask, so the
embedders on stage 0 learn from every block. With frame conditioning (``diffusion.mask_ratios``)
a sixth travels, the frame mask ``x_mask``: ``t_mod`` and ``cond`` are then per frame, and the
last stage's output layer and loss need the mask too. Pure: no torch.distributed.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from videodit.models.stdit.model import STDiT

X_MASK = 8   # model inputs: (x, t, y, y_mask, fps, drop_caption, height, width[, x_mask])


class DiTStage(STDiT):
    """Part of an STDiT: optionally the embedding, a run of blocks, optionally the output layer."""

    EMBEDDING = ("patch_embed", "t_embedder", "fps_embedder", "t_block", "caption_embedder", "caption_pool")

    def __init__(self, model: STDiT, block_ids: Sequence[int], *, first: bool, last: bool):
        nn.Module.__init__(self)   # not STDiT.__init__: the parts come from ``model``
        self.geometry = model.geometry
        self.first, self.last = first, last
        self.rope = model.rope     # no parameters
        if first:
            for name in self.EMBEDDING:
                setattr(self, name, getattr(model, name))
        all_blocks = model.blocks  # execution order: spatial 0, temporal 0, spatial 1, ...
        self.spatial_blocks = nn.ModuleDict({str(i // 2): all_blocks[i] for i in block_ids if i % 2 == 0})
        self.temporal_blocks = nn.ModuleDict({str(i // 2): all_blocks[i] for i in block_ids if i % 2 == 1})
        self._order = sorted(block_ids)
        if last:
            self.final_layer = model.final_layer

    @property
    def blocks(self) -> list[nn.Module]:
        return [(self.temporal_blocks if i % 2 else self.spatial_blocks)[str(i // 2)] for i in self._order]

    def forward(self, *args):
        """First stage: the model's inputs (x, t, y, y_mask, fps, drop_caption, height, width[, x_mask]).
        Other stages: the previous stage's outputs. Returns the inter-stage tensors, or on the last
        stage the output patches [B, T', S, patch values] (``unpatchify`` makes latents)."""
        if self.first:
            x_mask = args[X_MASK] if len(args) > X_MASK else None
            tokens, y, y_mask, t_mod, cond = self.embed(*args)
        else:
            tokens, y, y_mask, t_mod, cond, *rest = args
            x_mask = rest[0] if rest else None
        rope = self.rope(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            tokens = block(tokens, y, y_mask, t_mod, rope)
        if self.last:
            return self.final_layer(tokens, cond, x_mask).float()
        # Sent dense and in fp32 whatever the autocast, as ``stage_io`` declares them.
        sent = (tokens, y, y_mask, t_mod, cond) + (() if x_mask is None else (x_mask,))
        return tuple(x.float().contiguous() if x.is_floating_point() else x.contiguous() for x in sent)


def stage_io(stage: DiTStage, inputs: tuple[torch.Tensor, ...], microbatches: int) -> dict:
    """Meta tensors of one micro-batch's stage inputs and outputs, from the model inputs
    (x, t, y, y_mask, fps, drop_caption, height, width[, x_mask]) of the whole batch."""
    x, _, y = inputs[:3]
    g = stage.geometry
    n = x.shape[0] // microbatches
    pt, ph, pw = g.patch_size
    frames, height, width = x.shape[-3:]
    grid = (-(-frames // pt), -(-height // ph) * -(-width // pw))
    d, length = g.hidden_size, y.shape[1]

    def meta(*shape, dtype=torch.float32):   # float tensors carry gradients between stages
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

    if len(inputs) > X_MASK:   # frame conditioning: adaLN per frame, the mask travels along
        between = (meta(n, *grid, d), meta(n, length, d), meta(n, length, dtype=torch.bool),
                   meta(n, grid[0], 6, d), meta(n, 2, d), meta(n, grid[0], dtype=torch.bool))
    else:
        between = (meta(n, *grid, d), meta(n, length, d), meta(n, length, dtype=torch.bool), meta(n, 6, d),
                   meta(n, d))
    root = tuple(torch.empty(n, *t.shape[1:], dtype=t.dtype, device="meta") for t in inputs)
    output = meta(n, *grid, g.in_channels * pt * ph * pw) if stage.last else between
    return dict(input_args=root if stage.first else between, output_args=output)
