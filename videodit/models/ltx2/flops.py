"""The FLOP model of the LTX-2 DiT's video stream (``models/ltx2/model.py`` called without audio), part
by part (see ``models/flop_count.py`` for what is counted). ``tests/models/test_ltx2_spec.py`` holds
it against FlopCounterMode on a tiny model, exactly.

With one time per sample (text-to-video) each time MLP runs once per sample; the text keys and
values are computed from every caption token in every block. The audio stream and the
cross-modal attentions, which only run with audio, are not counted (the audio issue adds them).
"""

from __future__ import annotations

from videodit.models.flop_count import FlopCount
from videodit.models.ltx2.embeddings import TIME_FREQ_DIM
from videodit.models.ltx2.geometry import LTX2Geometry


def _time_mlp(d: int, rows: int) -> tuple[int, int]:
    """(all, data-fed) FLOPs of one AdaLayerNormSingle on one value: linear_1 (fed by the
    sinusoid), linear_2, the modulation projection."""
    fed = 2 * TIME_FREQ_DIM * d
    return fed + 2 * d * d + 2 * d * rows * d, fed


def grid_flops(g: LTX2Geometry, tokens: int, caption_tokens: int) -> FlopCount:
    """Forward FLOPs of one sample of ``tokens`` video tokens and ``caption_tokens`` text tokens."""
    d, n, text, heads = g.dim, tokens, caption_tokens, g.num_heads
    time, time_fed = _time_mlp(d, g.modulation_rows)
    data_fed = n * 2 * g.in_channels * d + time_fed                  # patchify_proj, fed by x_t
    embed = n * 2 * g.in_channels * d + time
    if g.caption_channels is not None:                                # LTX-2.0's caption projection
        data_fed += text * 2 * g.caption_channels * d
        embed += text * (2 * g.caption_channels * d + 2 * d * d)
    if g.cross_attention_adaln:                                       # LTX-2.3's prompt_adaln_single
        prompt, prompt_fed = _time_mlp(d, 2)
        embed, data_fed = embed + prompt, data_fed + prompt_fed
    gates = n * 2 * d * heads if g.gated_attention else 0             # to_gate_logits, per attention
    attention = 4 * d * n * n + 4 * d * n * text                      # QK^T + AV: self, then text
    block = (n * 4 * 2 * d * d + gates                                # attn1: q, k, v, out
             + n * 2 * 2 * d * d + text * 2 * 2 * d * d + gates       # attn2: q, out; k, v on the text
             + n * 2 * 2 * d * g.mlp_hidden                           # the FFN
             + attention)
    final = n * 2 * d * g.in_channels
    return FlopCount(float(embed), (float(block),) * g.num_layers, float(final),
                     (float(attention),) * g.num_layers, float(data_fed))
