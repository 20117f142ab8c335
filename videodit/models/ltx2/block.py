"""One LTX-2 block (ltx-core ``BasicAVTransformerBlock``): a video stream and an audio stream that
meet in two cross-modal attentions.

Per stream, in order (x the stream's tokens, every norm a weightless RMSNorm):

1. self-attention on norm(x) x (1 + scale) + shift, added with a gate (table rows 0-2);
2. text cross-attention from norm(x); LTX-2.3 modulates its query (rows 6-8, with a gate on the
   output) and the text keys/values by sigma (the ``prompt_scale_shift_table`` plus
   ``prompt_adaln_single``'s output);
3. when both streams are there: audio -> video attention (video queries, audio keys/values) and
   video -> audio attention, each side modulated by its own 5-row table (scale, shift for a2v;
   scale, shift for v2a; the gate) on the stream's own time, and gated by the OTHER stream's sigma;
   both read the streams as they were before either cross-modal update;
4. the GELU-tanh FFN on norm(x) x (1 + scale) + shift, added with a gate (rows 3-5).

The modulation comes per sample ([B, 1, ...]) or per token ([B, T, ...]: image-to-video's clean
first frame has time 0); ``rows`` adds the block's table to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from videodit.models.layers import merge_heads, split_heads
from videodit.models.ltx2.attention import Attention
from videodit.models.ltx2.embeddings import FeedForward, modulate, rms, rows
from videodit.models.ltx2.geometry import LTX2Geometry
from videodit.models.ltx2.rope import Table


@dataclass
class StreamInputs:
    """What one stream's blocks read besides its tokens, the same for every block."""
    context: torch.Tensor                    # [B, L, width] text
    context_mask: torch.Tensor | None        # additive [B, 1, 1, L] or None (every text token attended)
    modulation: torch.Tensor                 # [B, 1 or T, rows * width]
    rope: Table                              # self-attention RoPE
    embedded: torch.Tensor | None = None     # [B, 1 or T, width] time embedding (the output layer's)
    prompt_modulation: torch.Tensor | None = None   # LTX-2.3: [B, 1, 2 * width] (text shift, scale)
    cross_rope: Table | None = None          # time-only RoPE of the cross-modal attentions
    cross_modulation: torch.Tensor | None = None    # [B, 1 or T, 4 * width]: a2v scale, shift; v2a scale, shift
    cross_gate: torch.Tensor | None = None   # [B, 1, width], from the other stream's sigma


class LTX2Block(nn.Module):
    def __init__(self, g: LTX2Geometry):
        super().__init__()
        self.eps = g.norm_eps
        self.cross_attention_adaln = g.cross_attention_adaln
        d, a, h = g.dim, g.audio_dim, g.num_heads

        def attention(query, context, head_dim, kind):
            return Attention(query, context, h, head_dim, g.norm_eps, g.gated_attention, kind)

        self.attn1 = attention(d, d, g.head_dim, "self")
        self.attn2 = attention(d, d, g.head_dim, "cross")
        self.ff = FeedForward(d)
        self.scale_shift_table = nn.Parameter(torch.empty(g.modulation_rows, d))
        self.audio_attn1 = attention(a, a, g.audio_head_dim, "audio_self")
        self.audio_attn2 = attention(a, a, g.audio_head_dim, "cross")
        self.audio_ff = FeedForward(a)
        self.audio_scale_shift_table = nn.Parameter(torch.empty(g.modulation_rows, a))
        # The cross-modal attentions run on the audio heads, whichever stream asks.
        self.audio_to_video_attn = attention(d, a, g.audio_head_dim, "a2v")
        self.video_to_audio_attn = attention(a, d, g.audio_head_dim, "v2a")
        self.scale_shift_table_a2v_ca_audio = nn.Parameter(torch.empty(5, a))
        self.scale_shift_table_a2v_ca_video = nn.Parameter(torch.empty(5, d))
        if g.cross_attention_adaln:
            self.prompt_scale_shift_table = nn.Parameter(torch.empty(2, d))
            self.audio_prompt_scale_shift_table = nn.Parameter(torch.empty(2, a))
        self.skip_self_attention = False   # STG's perturbed branch (LTX2Spec.skip_self_attention sets it)

    def forward(self, vx: torch.Tensor, ax: torch.Tensor | None, video: StreamInputs,
                audio: StreamInputs | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """vx [B, Tv, d] and ax [B, Ta, a] (None: the video stream alone, no cross-modal attention)."""
        vx = self._attend(vx, video, self.attn1, self.attn2, self.scale_shift_table,
                          getattr(self, "prompt_scale_shift_table", None))
        if ax is not None:
            ax = self._attend(ax, audio, self.audio_attn1, self.audio_attn2, self.audio_scale_shift_table,
                              getattr(self, "audio_prompt_scale_shift_table", None))
            vx, ax = self._cross_modal(vx, ax, video, audio)
            ax = self._feed_forward(ax, audio.modulation, self.audio_scale_shift_table, self.audio_ff)
        vx = self._feed_forward(vx, video.modulation, self.scale_shift_table, self.ff)
        return vx, ax

    def _attend(self, x, inputs: StreamInputs, self_attn: Attention, text_attn: Attention, table, prompt_table):
        shift, scale, gate = rows(table, inputs.modulation, 0, 3)
        normed = modulate(rms(x, self.eps), scale, shift)
        skipped = self.skip_self_attention and self_attn is self.attn1
        x = x + (_values_only(self_attn, normed) if skipped else self_attn(normed, rope=inputs.rope)) * gate
        normed = rms(x, self.eps)
        if not self.cross_attention_adaln:
            return x + text_attn(normed, inputs.context, inputs.context_mask)
        shift_q, scale_q, gate_q = rows(table, inputs.modulation, 6, 3)
        shift_kv, scale_kv = rows(prompt_table, inputs.prompt_modulation, 0, 2)
        context = modulate(inputs.context, scale_kv, shift_kv)
        return x + text_attn(modulate(normed, scale_q, shift_q), context, inputs.context_mask) * gate_q

    def _cross_modal(self, vx, ax, video: StreamInputs, audio: StreamInputs):
        """Both directions from the streams as they enter (the video's update must not bias v2a)."""
        v_table, a_table = self.scale_shift_table_a2v_ca_video, self.scale_shift_table_a2v_ca_audio
        v_normed, a_normed = rms(vx, self.eps), rms(ax, self.eps)

        def side(table, inputs: StreamInputs, normed, first):
            scale, shift = rows(table[:4], inputs.cross_modulation, first, 2)
            return modulate(normed, scale, shift)

        (v_gate,) = rows(v_table[4:], video.cross_gate, 0, 1)
        (a_gate,) = rows(a_table[4:], audio.cross_gate, 0, 1)
        a2v = self.audio_to_video_attn(side(v_table, video, v_normed, 0), side(a_table, audio, a_normed, 0),
                                       rope=video.cross_rope, k_rope=audio.cross_rope)
        v2a = self.video_to_audio_attn(side(a_table, audio, a_normed, 2), side(v_table, video, v_normed, 2),
                                       rope=audio.cross_rope, k_rope=video.cross_rope)
        return vx + a2v * v_gate, ax + v2a * a_gate

    def _feed_forward(self, x, modulation, table, ff: FeedForward):
        shift, scale, gate = rows(table, modulation, 3, 3)
        return x + ff(modulate(rms(x, self.eps), scale, shift)) * gate


def _values_only(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """A self-attention skipped as STG perturbs it (ltx-core's ``all_perturbed``): the values pass
    unattended, then the heads' gates (2.3) and the output projection, as in ltx-core's Attention."""
    out = split_heads(attn.to_v(x), attn.head_dim)
    if attn.to_gate_logits is not None:
        out = out * (2.0 * torch.sigmoid(attn.to_gate_logits(x))).transpose(1, 2).unsqueeze(-1)
    return attn.to_out[0](merge_heads(out))
