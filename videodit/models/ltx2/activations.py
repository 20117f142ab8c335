"""What the LTX-2 DiT keeps for backward: the planner's activation profile
(``ModelSpec.activation_profile``), the video stream's and, when the model runs with audio
(``model.train_audio``), the audio stream's and the cross-modal attentions'.

Read from what one ``LTX2Block`` saves (``saved_tensors_hooks``, distinct storages, fp32 and under
bf16 autocast, LTX-2.0 and 2.3) and the rest of the model by ``LiveMemory`` over a step at two
depths (``tests/planner/test_ltx2_plan.py`` holds the planner within 5% of it, audio on and off).
Training always has a time per token (the model inputs carry a frame mask), so the video's
modulation is per token; the [B, T, rows D] modulation itself is not kept (the blocks' table sums
are), only each block's sums of its table rows with it, which the gates' views keep whole.

Where LTX-2 differs from Wan: under autocast the residual stream is bf16 (the projections' bf16
outputs added with bf16 gates), only the three weightless norms' outputs and the q/k RMSNorms
(run in fp32) stay fp32; RoPE's tables are fp32 and each rotation casts its own bf16 copy; LTX-2.3
adds the text query's modulation (3 more rows, its 1 + scale and modulated input) and the
per-head gates (their logits and 2 sigmoid, and the gated heads merged as a copy). The text keys
and values are computed from every caption token in every block (LTX-2.3 modulates the text per
block first). Units per token of one block, fp32 (autocast: fp32 entries + bf16 entries):
LTX-2.3 46 D + 2 M (9 D + 37 D + 2 M), LTX-2.0 39 D + 2 M (9 D + 30 D + 2 M).

The audio stream (``on="audio"``: its tokens, whole on every sequence-parallel rank) is the video
stream's block on the audio width A = ``audio_dim`` (its FFN 4 A wide), less what the video keeps
per token for its per-token time: the audio's modulation is per sample (one sigma a clip), so its
table sums and 1 + scale are per sample, too small to count. Its text (``"audio_caption"``) is as
long as the video's. The cross-modal attentions keep, per audio token and per video token of the
rank (``"av_tokens"``), their side's RMSNorm output, the modulated inputs, the q/k RMSNorms, the
A-wide heads (the cross-modal attentions run on the audio heads) and the gated output with its
residual; on the video side also the per-token 1 + scale (the video's cross-modal modulation is
per token). Widths are written in units of the video's: A = ``ratio`` D, 4 A = ``ratio`` M.
Measured per audio token of one block, fp32: LTX-2.3 40 A + 2 (4 A) (14 A + 30 A under autocast),
LTX-2.0 37 A; per video token 7 D + 9 A.
"""

from __future__ import annotations

from dataclasses import dataclass

from videodit.models.spec import ActivationProfile, Saved

CAPTION_LAYERS = ("attn2.to_k", "attn2.to_v", "audio_attn2.to_k", "audio_attn2.to_v")


@dataclass(frozen=True)
class StreamsProfile(ActivationProfile):
    """An :class:`ActivationProfile` of a model with a second token stream through its blocks:
    ``stream_inputs``, what a fully checkpointed block keeps as its inputs besides the video tokens
    (LTX-2's audio tokens, per block; ``planner/estimate.block_input_bytes`` reads it)."""
    stream_inputs: tuple[Saved, ...] = ()


def _block(gated: bool) -> tuple[Saved, ...]:
    rows = 9 if gated else 6                  # LTX-2.3: the text query's rows too
    attention = (8, 10) if gated else (6, 8)  # (fp32, autocast) units of the per-head tensors
    other = (11, 16) if gated else (9, 14)    # (fp32, autocast) of the rest
    entries = [
        Saved("block input (residual stream: bf16 under autocast)", 1, "D", True, False, True),
        Saved("the three weightless RMSNorms' outputs (fp32; the modulations' scale gradients)", 3, "D", False, False,
              False, ("adaln",)),
        Saved("q, k, text q RMSNorm: the fp32 input and the normalised values", 6, "D", False, True, False),
        Saved(f"table + per-token modulation sums ({rows} rows), kept whole by the gates' views", rows, "D", True,
              False, False),
        Saved("q, k after RoPE, v, attention outputs, text q; (2.3) gated heads merged; autocast: RoPE's bf16 "
              "copies", attention[0], "D", True, True, False, autocast_units=attention[1]),
        Saved("1 + scale and the modulated projection inputs, the o and FFN outputs for the gates, the residuals",
              other[0], "D", True, False, False, autocast_units=other[1]),
        Saved("matmul and attention outputs (kept by selective): q, k, v, o, text q, o, the attention outputs, "
              "net.2", 0, "D", True, True, True, selective_units=9),
        Saved("FFN hidden: GELU input and output", 2, "M", True, True, True, selective_units=1),
        Saved("attention logsumexps", 2, "H", False, True, True),
        Saved("RMSNorm rstd: three weightless norms and q, k, text q", 6, "1", False, False, False),
        # per caption token
        Saved("text k RMSNorm: fp32 input and normalised values", 2, "D", False, True, False, on="caption"),
        Saved("text k, v (attention inputs); (2.3) the modulated text, cast per projection under autocast",
              3 if gated else 2, "D", True, True, False, on="caption",
              autocast_units=4 if gated else 2),
        Saved("text k, v projections (kept by selective)", 0, "D", True, True, True, on="caption",
              selective_units=2),
        Saved("text k RMSNorm rstd", 1, "1", False, False, False, on="caption"),
    ]
    if gated:
        entries.append(Saved("per-head gates: logits' sigmoid and 2 sigmoid (self and text attention)", 4, "H", True,
                             True, False))
    return tuple(entries)


def _audio_block(gated: bool, ratio: float) -> tuple[Saved, ...]:
    """The audio stream's own part of a block (self-attention, text attention, FFN), per audio
    token and per audio caption token: the video's entries without the per-token modulation."""
    a = ratio
    attention = (8, 10) if gated else (6, 8)  # as the video's
    other = 8 if gated else 7                 # the video's less its three (two) per-token 1 + scale
    entries = [
        Saved("audio: block input (its residual stream)", a, "D", True, False, True, on="audio"),
        Saved("audio: the three weightless RMSNorms' outputs (fp32)", 3 * a, "D", False, False, False, ("adaln",),
              on="audio"),
        Saved("audio: q, k, text q RMSNorm: the fp32 input and the normalised values", 6 * a, "D", False, True, False,
              on="audio"),
        Saved("audio: q, k after RoPE, v, attention outputs, text q, (2.3) gated heads merged; autocast: RoPE's bf16 "
              "copies", attention[0] * a, "D", True, True, False, on="audio", autocast_units=attention[1] * a),
        Saved("audio: the modulated projection inputs, the o and FFN outputs for the gates, the residuals",
              other * a, "D", True, False, False, on="audio"),
        Saved("audio: matmul and attention outputs (kept by selective)", 0, "D", True, True, True, on="audio",
              selective_units=9 * a),
        Saved("audio: FFN hidden (4 A): GELU input and output", 2 * a, "M", True, True, True, on="audio",
              selective_units=a),
        Saved("audio: attention logsumexps", 2, "H", False, True, True, on="audio"),
        Saved("audio: RMSNorm rstd: three weightless norms and q, k, text q", 6, "1", False, False, False, on="audio"),
        # per caption token of the audio stream's text
        Saved("audio text k RMSNorm: fp32 input and normalised values", 2 * a, "D", False, True, False,
              on="audio_caption"),
        Saved("audio text k, v; (2.3) the modulated text, cast per projection under autocast", (3 if gated else 2) * a,
              "D", True, True, False, on="audio_caption", autocast_units=(4 if gated else 2) * a),
        Saved("audio text k, v projections (kept by selective)", 0, "D", True, True, True, on="audio_caption",
              selective_units=2 * a),
        Saved("audio text k RMSNorm rstd", 1, "1", False, False, False, on="audio_caption"),
    ]
    if gated:
        entries.append(Saved("audio: per-head gates' sigmoid and 2 sigmoid (self and text attention)", 4, "H", True,
                             True, False, on="audio", selective_units=2))
    return tuple(entries)


def _cross_modal(gated: bool, ratio: float) -> tuple[Saved, ...]:
    """The audio -> video and video -> audio attentions of a block, each side on its own tokens."""
    a = ratio
    entries = []
    for on, side, norm_output in (("audio", "audio side", a), ("av_tokens", "video side", 1)):
        entries += [
            Saved(f"cross-modal, {side}: the stream's RMSNorm output (fp32)", norm_output, "D", False, False, False,
                  ("adaln",), on=on),
            Saved(f"cross-modal, {side}: the q / k RMSNorms' fp32 inputs and normalised values (A wide)", 4 * a, "D",
                  False, True, False, on=on),
            Saved(f"cross-modal, {side}: heads after RoPE, v or the attention output, the merged heads; autocast: "
                  "RoPE's bf16 copies", 5 * a, "D", True, True, False, on=on, autocast_units=7 * a),
            Saved(f"cross-modal, {side}: the A-wide projections and attention output (kept by selective)", 0, "D",
                  True, True, True, on=on, selective_units=4 * a if on == "av_tokens" else 5 * a),
            Saved(f"cross-modal, {side}: logsumexp of its queries", 1, "H", False, True, True, on=on),
            Saved(f"cross-modal, {side}: RMSNorm rstd (the stream's, q or k, k or q)", 3, "1", False, False, False,
                  on=on),
        ]
        if gated:
            entries.append(Saved(f"cross-modal, {side}: per-head gates of its queries", 2, "H", True, True, False,
                                 on=on, selective_units=1))
    # audio side: the modulated inputs (a2v keys/values, v2a queries), v2a's o for the gate, the residual;
    # video side: the same and the per-token 1 + scale of both; its a2v o kept by selective too
    entries.append(Saved("cross-modal, audio side: modulated inputs, the gated output, the residual", 4 * a, "D",
                         True, False, False, on="audio"))
    entries.append(Saved("cross-modal, video side: modulated inputs and their per-token 1 + scale, the gated output "
                         "(a2v's o, kept by selective), the residual", 6, "D", True, False, False, on="av_tokens",
                         selective_units=1))
    return tuple(entries)


def _outside(gated: bool, projected: bool) -> tuple[Saved, ...]:
    entries = [
        Saved("RoPE tables (cos, sin: head_dim values per head, fp32), read by every block", 1, "D", False, False,
              True),
        Saved("output layer: its norm output, 1 + scale, the modulated projection input (per-token time)", 4.2, "D",
              True, False, True, ("proj_out",), autocast_units=4.1),
        Saved("latent-sized tensors: noise, x_t, target, the output tokens and latents, the loss error", 5, "1",
              False, False, True, on="latent"),
    ]
    if projected:   # LTX-2.0's caption projection
        entries.append(Saved("caption projection: GELU input and output, the text context", 3, "D", True, False, True,
                             ("caption_projection",), on="caption"))
        entries.append(Saved("caption cast to bf16 for the projection (autocast)", 0, "C", True, False, True,
                             ("caption_projection",), on="caption", autocast_units=1))
    return tuple(entries)


def _audio_outside(projected: bool, ratio: float, audio_channels: int) -> tuple[Saved, ...]:
    """The audio stream before and after the blocks (its time is per sample: no per-token
    modulation in its output layer). Under autocast every rotation casts the fp32 RoPE tables
    itself and nothing keeps them (the checkpointed blocks do: :func:`_checkpoint_inputs`)."""
    a = ratio
    entries = [
        Saved("audio RoPE tables: self and cross-modal (fp32)", 2 * a, "D", False, False, True, on="audio",
              autocast_units=0),
        Saved("video cross-modal RoPE tables (fp32, A wide)", a, "D", False, False, True, on="av_tokens",
              autocast_units=0),
        Saved("audio output layer: the last block's output, its norm output, the modulated projection input",
              3 * a, "D", True, False, True, ("audio_proj_out",), on="audio"),
        Saved("audio output layer: the norm's mean and rstd", 2, "1", True, False, True, ("audio_proj_out",),
              on="audio"),
        Saved("audio latent-sized tensors: noise, x_t, target, the loss error", 4 * audio_channels, "1", False, False,
              True, on="audio"),
        Saved("autocast: the audio tokens cast for the patch projection, the output projection's bf16 output", 0, "1",
              True, False, True, on="audio", autocast_units=2 * audio_channels),
    ]
    if projected:   # LTX-2.0's audio caption projection
        entries.append(Saved("audio caption projection: GELU input and output, the audio text", 3 * a, "D", True,
                             False, True, ("audio_caption_projection",), on="audio_caption"))
        entries.append(Saved("caption cast to bf16 for the audio projection (autocast)", 0, "C", True, False, True,
                             ("audio_caption_projection",), on="audio_caption", autocast_units=1))
    return tuple(entries)


def _checkpoint_inputs(gated: bool, ratio: float) -> tuple[Saved, ...]:
    """What the checkpointed blocks hold as their inputs (``StreamInputs``) that plain training
    frees after forward: the per-token modulation [B, T, rows D] and time embedding [B, T, D]
    (the output layer's), in the compute dtype. RoPE's tables and the text are kept anyway. With
    audio: the video's per-token cross-modal modulation [B, T, 4 D], and under autocast the fp32
    RoPE tables of the audio and the cross-modal attentions, which a plain block casts and drops."""
    rows = 9 if gated else 6
    return (Saved(f"per-token modulation ({rows} rows), the blocks' shared input", rows, "D", True, False, True),
            Saved("per-token time embedding (the output layer's), in the blocks' shared input", 1, "D", True, False,
                  True),
            Saved("per-token cross-modal modulation (a2v and v2a scale, shift)", 4, "D", True, False, True,
                  on="av_tokens"),
            Saved("audio RoPE tables, self and cross-modal (fp32; autocast)", 0, "D", False, False, True, on="audio",
                  autocast_units=2 * ratio),
            Saved("video cross-modal RoPE tables (fp32; autocast)", 0, "D", False, False, True, on="av_tokens",
                  autocast_units=ratio))


def profile(gated: bool, projected: bool, ratio: float = 0.5, audio_channels: int = 128) -> StreamsProfile:
    """The profile of LTX-2.3 (``gated``: per-head gates and the text query's modulation) or
    LTX-2.0, whose text goes through the caption projection (``projected``). ``ratio``: the audio
    width over the video's (the releases' 2048 / 4096); ``audio_channels``: the audio tokens' width.
    The audio entries count nothing for a video-only step (no audio tokens)."""
    return StreamsProfile(block=_block(gated) + _audio_block(gated, ratio) + _cross_modal(gated, ratio),
                          outside=_outside(gated, projected) + _audio_outside(projected, ratio, audio_channels),
                          caption_layers=CAPTION_LAYERS, sp_gathered=0.0, sp_local=1.0,
                          checkpoint_inputs=_checkpoint_inputs(gated, ratio), residual_low=True,
                          stream_inputs=(Saved("audio block input (its residual stream)", ratio, "D", True, False,
                                               True, on="audio"),))
