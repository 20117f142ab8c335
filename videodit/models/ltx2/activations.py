"""What the LTX-2 video stream keeps for backward: the planner's activation profile
(``ModelSpec.activation_profile``).

Read from what one ``LTX2Block`` saves (``saved_tensors_hooks``, distinct storages, fp32 and under
bf16 autocast, LTX-2.0 and 2.3) and the rest of the model by ``LiveMemory`` over a step at two
depths (``tests/planner/test_ltx2_plan.py`` holds the planner within 5% of it). Training always
has a time per token (the model inputs carry a frame mask), so the modulation is per token; the
[B, T, rows D] modulation itself is not kept (the blocks' table sums are), only each block's sums
of its table rows with it, which the gates' views keep whole.

Where LTX-2 differs from Wan: under autocast the residual stream is bf16 (the projections' bf16
outputs added with bf16 gates), only the three weightless norms' outputs and the q/k RMSNorms
(run in fp32) stay fp32; RoPE's tables are fp32 and each rotation casts its own bf16 copy; LTX-2.3
adds the text query's modulation (3 more rows, its 1 + scale and modulated input) and the
per-head gates (their logits and 2 sigmoid, and the gated heads merged as a copy). The text keys
and values are computed from every caption token in every block (LTX-2.3 modulates the text per
block first). Units per token of one block, fp32 (autocast: fp32 entries + bf16 entries):
LTX-2.3 46 D + 2 M (9 D + 37 D + 2 M), LTX-2.0 39 D + 2 M (9 D + 30 D + 2 M).
"""

from __future__ import annotations

from videodit.models.spec import ActivationProfile, Saved

CAPTION_LAYERS = ("attn2.to_k", "attn2.to_v")


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


def _checkpoint_inputs(gated: bool) -> tuple[Saved, ...]:
    """What the checkpointed blocks hold as their inputs (``StreamInputs``) that plain training
    frees after forward: the per-token modulation [B, T, rows D] and time embedding [B, T, D]
    (the output layer's), in the compute dtype. RoPE's tables and the text are kept anyway."""
    rows = 9 if gated else 6
    return (Saved(f"per-token modulation ({rows} rows), the blocks' shared input", rows, "D", True, False, True),
            Saved("per-token time embedding (the output layer's), in the blocks' shared input", 1, "D", True, False,
                  True))


def profile(gated: bool, projected: bool) -> ActivationProfile:
    """The profile of LTX-2.3 (``gated``: per-head gates and the text query's modulation) or
    LTX-2.0, whose text goes through the caption projection (``projected``)."""
    return ActivationProfile(block=_block(gated), outside=_outside(gated, projected), caption_layers=CAPTION_LAYERS,
                             sp_gathered=0.0, sp_local=1.0, checkpoint_inputs=_checkpoint_inputs(gated),
                             residual_low=True)
