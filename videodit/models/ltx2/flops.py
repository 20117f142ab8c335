"""The FLOP model of the LTX-2 DiT (``models/ltx2/model.py``), part by part (see
``models/flop_count.py`` for what is counted): the video stream, and with ``audio_tokens`` the
audio stream and the cross-modal attentions too (the model called with audio, as
``model.train_audio`` trains it). ``tests/models/test_ltx2_spec.py`` holds both against
FlopCounterMode on a tiny model, exactly.

With one time per sample (text-to-video) each time MLP runs once per sample; the text keys and
values are computed from every caption token in every block, for each stream. The audio stream's
text is as long as the video's (the connectors give both from one Gemma pass). The cross-modal
attentions run on the audio heads (inner width ``audio_dim``) whichever stream asks: audio -> video
(video queries, audio keys and values) and video -> audio (audio queries, video keys and values).
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


def _attention(g: LTX2Geometry, queries: int, keys: int, query_dim: int, key_dim: int,
               inner: int) -> tuple[int, int]:
    """(projections, QK^T + AV) of one attention: q and out on the queries, k and v on the keys;
    LTX-2.3's per-head gate logits on the queries."""
    projections = queries * 2 * 2 * query_dim * inner + keys * 2 * 2 * key_dim * inner
    if g.gated_attention:
        projections += queries * 2 * query_dim * g.num_heads
    return projections, 4 * inner * queries * keys


def _stream_embed(g: LTX2Geometry, width: int, in_channels: int, tokens: int, text: int) -> tuple[int, int]:
    """(all, data-fed) FLOPs of one stream before the blocks: its patch projection (fed by x_t),
    time embedding and modulation, LTX-2.0's caption projection, LTX-2.3's prompt modulation."""
    time, time_fed = _time_mlp(width, g.modulation_rows)
    fed = tokens * 2 * in_channels * width + time_fed
    embed = tokens * 2 * in_channels * width + time
    if g.caption_channels is not None:                                # LTX-2.0's caption projection
        fed += text * 2 * g.caption_channels * width
        embed += text * (2 * g.caption_channels * width + 2 * width * width)
    if g.cross_attention_adaln:                                       # LTX-2.3's prompt_adaln_single
        prompt, prompt_fed = _time_mlp(width, 2)
        embed, fed = embed + prompt, fed + prompt_fed
    return embed, fed


def _stream_block(g: LTX2Geometry, width: int, tokens: int, text: int) -> tuple[int, int]:
    """(all, QK^T + AV) FLOPs of one stream's part of a block: self-attention, text attention, FFN."""
    own, own_attention = _attention(g, tokens, tokens, width, width, width)
    text_part, text_attention = _attention(g, tokens, text, width, width, width)
    ffn = tokens * 2 * 2 * width * 4 * width
    attention = own_attention + text_attention
    return own + text_part + ffn + attention, attention


def _cross_modal_embed(g: LTX2Geometry) -> tuple[int, int]:
    """(all, data-fed) FLOPs of the cross-modal attentions' time MLPs: each stream's scale/shift of
    its own time (4 rows) and its gate of the other stream's sigma (1 row)."""
    parts = [_time_mlp(g.dim, 4), _time_mlp(g.audio_dim, 4), _time_mlp(g.dim, 1), _time_mlp(g.audio_dim, 1)]
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def _cross_modal_block(g: LTX2Geometry, video: int, audio: int) -> tuple[int, int]:
    """(all, QK^T + AV) FLOPs of one block's audio -> video and video -> audio attentions."""
    d, a = g.dim, g.audio_dim
    a2v, a2v_attention = _attention(g, video, audio, d, a, a)
    v2a, v2a_attention = _attention(g, audio, video, a, d, a)
    return a2v + v2a + a2v_attention + v2a_attention, a2v_attention + v2a_attention


def grid_flops(g: LTX2Geometry, tokens: int, caption_tokens: int, audio_tokens: int = 0) -> FlopCount:
    """Forward FLOPs of one sample of ``tokens`` video tokens and ``caption_tokens`` text tokens;
    ``audio_tokens`` > 0: the model called with its audio stream, that many audio tokens."""
    text = caption_tokens
    embed, data_fed = _stream_embed(g, g.dim, g.in_channels, tokens, text)
    block, attention = _stream_block(g, g.dim, tokens, text)
    final = tokens * 2 * g.dim * g.in_channels
    if audio_tokens:
        a = g.audio_dim
        parts = [_stream_embed(g, a, g.audio_in_channels, audio_tokens, text), _cross_modal_embed(g)]
        embed, data_fed = embed + sum(p[0] for p in parts), data_fed + sum(p[1] for p in parts)
        for part, part_attention in (_stream_block(g, a, audio_tokens, text),
                                     _cross_modal_block(g, tokens, audio_tokens)):
            block, attention = block + part, attention + part_attention
        final += audio_tokens * 2 * a * g.audio_in_channels
    return FlopCount(float(embed), (float(block),) * g.num_layers, float(final),
                     (float(attention),) * g.num_layers, float(data_fed))
