"""An LTX-2 pipeline stage (``parallel/pipeline.py`` cuts the model, this says what a piece is).

A stage is a contiguous run of ``transformer_blocks`` (their names kept: checkpoints of the stages
add up to the model's). The first stage also holds every root module before the blocks (the video
stream's embedders and, unused while the video trains alone, the audio stream's and the
cross-modal ones, so that every parameter belongs to a stage); the last the output layers.

Pipelines train the video stream alone (the model inputs carry no audio). Between stages travel,
per sample (so the schedule can cut them into micro-batches): the video tokens [B, T, d], the
text [B, L, d], the modulation [B, 1 or T, rows d] and the time embedding [B, 1 or T, d] (per
token when the inputs carry a frame mask, as training's always do), the RoPE table (cos and sin
[B, H, T, head_dim / 2], no gradient), LTX-2.3's text modulation [B, 1, 2 d] and, when the inputs
give a text mask, its additive form [B, 1, 1, L] (no gradient). The last stage ends with the
output layer: tokens [B, T, C], which ``LTX2Spec.stage_latents`` turns back into latents.
Pure: no torch.distributed.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from videodit.errors import UserError
from videodit.models.ltx2.block import StreamInputs
from videodit.models.ltx2.model import LTX2Model

LAST = ("scale_shift_table", "proj_out", "audio_scale_shift_table", "audio_proj_out")


class LTX2Stage(nn.Module):
    """Part of an LTX2Model: optionally the embedders, a run of blocks, optionally the output layers."""

    def __init__(self, model: LTX2Model, block_ids: Sequence[int], *, first: bool, last: bool):
        super().__init__()
        self.geometry = model.geometry
        self.first, self.last = first, last
        self._model = [model]   # for embed/head/unpatchify only; a list keeps it out of the state dict
        for name, child in model.named_children():
            if name != "transformer_blocks" and (name in LAST) == last and (first or name in LAST):
                setattr(self, name, child)
        for name, param in model.named_parameters(recurse=False):
            if (name in LAST and last) or (name not in LAST and first):
                self.register_parameter(name, param)
        self.block_ids = sorted(block_ids)
        self.transformer_blocks = nn.ModuleDict({str(i): model.transformer_blocks[i] for i in self.block_ids})

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.transformer_blocks.values())

    def forward(self, *args):
        """First stage: the model inputs (x, t, context[, fps, x_mask, context_mask]). Other
        stages: the previous stage's outputs. Returns the inter-stage tensors, or on the last
        stage the output tokens."""
        model = self._model[0]
        if self.first:
            if len(args) > 6:
                raise UserError("pipeline parallelism trains LTX-2's video stream alone; the model inputs carry "
                                "audio: set parallel.pp=1")
            x, t, context, *rest = args
            vx, video, _, _ = model.embed(x, t, context, *rest)
            cos, sin = (table.expand(x.shape[0], *table.shape[1:]) for table in video.rope)
            prompt = () if video.prompt_modulation is None else (video.prompt_modulation,)
            mask = () if video.context_mask is None else (video.context_mask,)
            between = (vx, video.context, video.modulation, video.embedded, cos, sin, *prompt, *mask)
        else:
            between = args
        vx, video = self._unpack(between)
        for block in self.blocks:
            vx, _ = block(vx, None, video, None)
        if self.last:
            return model.head(vx, video.embedded, self.scale_shift_table, self.proj_out)
        # fp32 between stages (fp64 stays fp64), as stage_io declares them
        return tuple(v.to(torch.promote_types(v.dtype, torch.float32)).contiguous() for v in (vx, *between[1:]))

    def _unpack(self, between) -> tuple[torch.Tensor, StreamInputs]:
        vx, context, modulation, embedded, cos, sin, *rest = between
        prompt = rest.pop(0) if self.geometry.cross_attention_adaln else None
        mask = rest.pop(0) if rest else None
        return vx, StreamInputs(context=context, context_mask=mask, modulation=modulation, rope=(cos, sin),
                                embedded=embedded, prompt_modulation=prompt)


def stage_io(stage: LTX2Stage, inputs: tuple[torch.Tensor, ...], microbatches: int) -> dict:
    """Meta tensors of one micro-batch's stage inputs and outputs, from the model inputs
    (x, t, context[, fps, x_mask, context_mask]) of the whole batch."""
    x, _, context = inputs[:3]
    g = stage.geometry
    n = x.shape[0] // microbatches
    tokens, text = x.shape[2] * x.shape[3] * x.shape[4], context.shape[1]
    per_token = len(inputs) > 4 and inputs[4] is not None

    dtype = torch.promote_types(x.dtype, torch.float32)

    def meta(*shape, grad=True, table=False):   # activations carry gradients between stages; RoPE and the mask do not
        return torch.empty(shape, dtype=torch.float32 if table else dtype, device="meta", requires_grad=grad)

    time = tokens if per_token else 1
    cos, sin = (meta(n, g.num_heads, tokens, g.head_dim // 2, grad=False, table=True) for _ in range(2))
    between = (meta(n, tokens, g.dim), meta(n, text, g.dim), meta(n, time, g.modulation_rows * g.dim),
               meta(n, time, g.dim), cos, sin,
               *((meta(n, 1, 2 * g.dim),) if g.cross_attention_adaln else ()),
               *((meta(n, 1, 1, text, grad=False),) if len(inputs) > 5 and inputs[5] is not None else ()))
    root = tuple(torch.empty(n, *v.shape[1:], dtype=v.dtype, device="meta") for v in inputs)
    output = meta(n, tokens, g.in_channels) if stage.last else between
    return dict(input_args=root if stage.first else between, output_args=output)


def stage_latents(output: torch.Tensor, latent_shape) -> torch.Tensor:
    """The last stage's tokens [B, F*H*W, C] as latents [B, C, F, H, W]."""
    b, _, frames, height, width = latent_shape
    return output.transpose(1, 2).reshape(b, -1, frames, height, width)
