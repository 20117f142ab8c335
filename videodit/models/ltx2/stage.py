"""An LTX-2 pipeline stage (``parallel/pipeline.py`` cuts the model, this says what a piece is).

A stage is a contiguous run of ``transformer_blocks`` (their names kept: checkpoints of the stages
add up to the model's). The first stage also holds every root module before the blocks (both
streams' embedders and the cross-modal ones, so that every parameter belongs to a stage); the last
the output layers of both streams.

Between stages travel, per sample (so the schedule can cut them into micro-batches), each stream's
tensors: its tokens [B, T, width], its text [B, L, width], the modulation [B, 1 or T, rows width] and
the time embedding [B, 1 or T, width] (the video's per token when the inputs carry a frame mask, as
training's always do), the RoPE table (cos and sin [B, H, T, head_dim / 2], no gradient) and
LTX-2.3's text modulation [B, 1, 2 width]; with the audio stream (the inputs carry audio) the video's
then the audio's, each also with the cross-modal attentions' time-only RoPE (cos and sin [B, H, T,
audio_head_dim / 2], no gradient), scale/shift [B, 1 or T, 4 width] and gate [B, 1, width]. Last, the
text masks the inputs give, additive [B, 1, 1, L] (no gradient; with audio both or neither: a missing
one travels as zeros, which attend every token). The last stage ends with the output layers: the
video's tokens [B, T, C], and with audio also the audio's [B, Ta, C_a]; ``LTX2Spec.stage_latents``
turns the video's back into latents. A model input that is None reaches the first stage as the
pipeline's empty [B, 0] placeholder. Pure: no torch.distributed.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from videodit.models.ltx2.block import StreamInputs
from videodit.models.ltx2.model import LTX2Model

LAST = ("scale_shift_table", "proj_out", "audio_scale_shift_table", "audio_proj_out")
AUDIO_AT = 6   # where the audio tokens sit in the model inputs (LTX2Spec.model_inputs)


class LTX2Stage(nn.Module):
    """Part of an LTX2Model: optionally the embedders, a run of blocks, optionally the output layers."""

    def __init__(self, model: LTX2Model, block_ids: Sequence[int], *, first: bool, last: bool):
        super().__init__()
        self.geometry = model.geometry
        self.first, self.last = first, last
        self._model = [model]   # for embed/head only; a list keeps it out of the state dict
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
        """First stage: the model inputs (x, t, context[, fps, x_mask, context_mask, audio, audio_t,
        audio_context, audio_context_mask]). Other stages: the previous stage's outputs. Returns the
        inter-stage tensors, or on the last stage the output tokens (video, or (video, audio))."""
        model = self._model[0]
        if self.first:
            vx, video, ax, audio = model.embed(*(None if _placeholder(a) else a for a in args))
            between = _between(vx, video, ax, audio)
        else:
            between = args
        vx, video, ax, audio = self._unpack(between)
        for block in self.blocks:
            vx, ax = block(vx, ax, video, audio)
        if self.last:
            out = model.head(vx, video.embedded, self.scale_shift_table, self.proj_out)
            return out if ax is None else (out, model.head(ax, audio.embedded, self.audio_scale_shift_table,
                                                           self.audio_proj_out))
        width = _stream_width(self.geometry, ax is not None)
        sent = (vx, *between[1:width], *((ax, *between[width + 1:]) if ax is not None else between[width:]))
        # fp32 between stages (fp64 stays fp64), as stage_io declares them
        return tuple(v.to(torch.promote_types(v.dtype, torch.float32)).contiguous() for v in sent)

    def _unpack(self, between) -> tuple[torch.Tensor, StreamInputs, torch.Tensor | None, StreamInputs | None]:
        """(vx, video inputs, ax or None, audio inputs or None) from the inter-stage tensors."""
        video_only = _stream_width(self.geometry, False)
        with_audio = len(between) > video_only + 1   # more than the video stream and its text mask
        width = _stream_width(self.geometry, with_audio)
        masks = list(between[2 * width:] if with_audio else between[width:]) or [None, None]
        prompt = self.geometry.cross_attention_adaln
        vx, video = _stream(between[:width], prompt, masks[0])
        if not with_audio:
            return vx, video, None, None
        ax, audio = _stream(between[width:2 * width], prompt, masks[1])
        return vx, video, ax, audio


def _stream_width(g, with_audio: bool) -> int:
    """How many inter-stage tensors one stream takes (its text mask aside)."""
    return 6 + int(g.cross_attention_adaln) + 4 * with_audio


def _stream_tensors(x: torch.Tensor, inputs: StreamInputs, with_audio: bool) -> tuple:
    """A stream's inter-stage tensors (module docstring), tables repeated per sample."""
    def batched(table):
        return tuple(part.expand(x.shape[0], *part.shape[1:]) for part in table)
    prompt = () if inputs.prompt_modulation is None else (inputs.prompt_modulation,)
    cross = (*batched(inputs.cross_rope), inputs.cross_modulation, inputs.cross_gate) if with_audio else ()
    return (x, inputs.context, inputs.modulation, inputs.embedded, *batched(inputs.rope), *prompt, *cross)


def _stream(tensors, prompt: bool, mask) -> tuple[torch.Tensor, StreamInputs]:
    """The reverse of :func:`_stream_tensors`."""
    x, context, modulation, embedded, cos, sin, *rest = tensors
    prompt_modulation = rest.pop(0) if prompt else None
    cross = dict(cross_rope=(rest[0], rest[1]), cross_modulation=rest[2], cross_gate=rest[3]) if rest else {}
    return x, StreamInputs(context=context, context_mask=mask, modulation=modulation, rope=(cos, sin),
                           embedded=embedded, prompt_modulation=prompt_modulation, **cross)


def _between(vx, video: StreamInputs, ax, audio: StreamInputs | None) -> tuple:
    """What the first stage sends: the video stream's tensors, the audio's, then the text masks."""
    if ax is None:
        return (*_stream_tensors(vx, video, False), *(() if video.context_mask is None else (video.context_mask,)))
    masks = (video.context_mask, audio.context_mask)
    if all(mask is None for mask in masks):
        masks = ()
    else:   # both or neither, so that the next stage tells them apart; zeros attend every token
        masks = tuple(torch.zeros(len(inputs.context), 1, 1, inputs.context.shape[1], dtype=x.dtype, device=x.device)
                      if inputs.context_mask is None else inputs.context_mask
                      for x, inputs in ((vx, video), (ax, audio)))
    return (*_stream_tensors(vx, video, True), *_stream_tensors(ax, audio, True), *masks)


def _placeholder(x) -> bool:
    """The pipeline's empty [B, 0] stand-in for a None model input."""
    return x is None or (x.dim() == 2 and x.shape[1] == 0)


def _given(inputs, index: int) -> bool:
    return len(inputs) > index and not _placeholder(inputs[index])


def stage_io(stage: LTX2Stage, inputs: tuple[torch.Tensor, ...], microbatches: int) -> dict:
    """Meta tensors of one micro-batch's stage inputs and outputs, from the model inputs
    (x, t, context[, fps, x_mask, context_mask, audio, audio_t, audio_context, audio_context_mask])
    of the whole batch (None inputs as the pipeline's placeholders)."""
    x, _, context = inputs[:3]
    g = stage.geometry
    n = x.shape[0] // microbatches
    tokens = math.prod(x.shape[2:])
    with_audio = _given(inputs, AUDIO_AT)
    dtype = torch.promote_types(x.dtype, torch.float32)

    def meta(*shape, grad=True, table=False):   # activations carry gradients between stages; RoPE and masks do not
        return torch.empty(shape, dtype=torch.float32 if table else dtype, device="meta", requires_grad=grad)

    def stream(length, text, width, head_dim, time):
        cos, sin = (meta(n, g.num_heads, length, head_dim // 2, grad=False, table=True) for _ in range(2))
        prompt = (meta(n, 1, 2 * width),) if g.cross_attention_adaln else ()
        cross = (*(meta(n, g.num_heads, length, g.audio_head_dim // 2, grad=False, table=True) for _ in range(2)),
                 meta(n, time, 4 * width), meta(n, 1, width)) if with_audio else ()
        return (meta(n, length, width), meta(n, text, width), meta(n, time, g.modulation_rows * width),
                meta(n, time, width), cos, sin, *prompt, *cross)

    video = stream(tokens, context.shape[1], g.dim, g.head_dim, tokens if _given(inputs, 4) else 1)
    audio, masks = (), (meta(n, 1, 1, context.shape[1], grad=False),) if _given(inputs, 5) else ()
    if with_audio:
        sound, audio_text = inputs[AUDIO_AT], inputs[AUDIO_AT + 2]
        audio = stream(sound.shape[1], audio_text.shape[1], g.audio_dim, g.audio_head_dim, 1)
        if _given(inputs, 5) or _given(inputs, AUDIO_AT + 3):
            masks = tuple(meta(n, 1, 1, text.shape[1], grad=False) for text in (context, audio_text))
    between = (*video, *audio, *masks)
    root = tuple(torch.empty(n, *v.shape[1:], dtype=v.dtype, device="meta") for v in inputs)
    output = meta(n, tokens, g.in_channels)
    if with_audio:
        output = (output, meta(n, inputs[AUDIO_AT].shape[1], g.audio_in_channels))
    return dict(input_args=root if stage.first else between, output_args=output if stage.last else between)


def stage_latents(output, latent_shape):
    """The last stage's video tokens [B, F*H*W, C] as latents [B, C, F, H, W]; with the audio stream
    (video, audio tokens [B, Ta, C_a])."""
    if isinstance(output, tuple):
        return stage_latents(output[0], latent_shape), output[1]
    b, _, frames, height, width = latent_shape
    return output.transpose(1, 2).reshape(b, -1, frames, height, width)
