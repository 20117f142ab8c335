"""What Wan 2.1 keeps for backward: the planner's activation profile (``ModelSpec.activation_profile``).

Read op by op from what ``WanBlock`` saves (``saved_tensors_hooks`` on a block, in fp32 and under
bf16 autocast) and checked against ``videodit.planner.measure.LiveMemory`` through the Trainer in
``tests/planner/test_planner.py``. Where it differs from STDiT: the residual stream, the
modulation, the norms and the gate products are fp32 whatever the compute dtype (so under
autocast about half the kept bytes stay fp32); q/k RMSNorm runs in fp32 on a copy of the
projection and RoPE follows it on every block; autocast casts the modulated input once per
projection (three bf16 copies for q, k, v); the text context (text_len tokens, no mask) gives
every block its own cross-attention keys and values.
"""

from __future__ import annotations

from videodit.models.spec import ActivationProfile, Saved

QKV = ("self_attn.q", "self_attn.k", "self_attn.v")
CAPTION_LAYERS = ("cross_attn.k", "cross_attn.v")

BLOCK_SAVED: tuple[Saved, ...] = (
    # self-attention
    Saved("block input (residual stream, fp32)", 1, "D", False, False, True),
    Saved("norm1 output (for the modulation's scale gradient)", 1, "D", False, False, False, ("adaln",)),
    Saved("modulated input of q/k/v (autocast: a bf16 copy per projection)", 1, "D", True, False, False, QKV,
          autocast_units=3),
    Saved("q, k projections as the fp32 RMSNorm input", 2, "D", False, True, False),
    Saved("q, k normalised (before the norm weight, fp32)", 2, "D", False, True, False, ("qk_norm",)),
    Saved("q, k after RoPE (attention inputs)", 2, "D", True, True, False),
    Saved("v (attention input)", 1, "D", True, True, False),
    Saved("q, k, v projections (kept by selective)", 0, "D", True, True, True, selective_units=3),
    Saved("attention output", 1, "D", True, True, True),
    Saved("attention output with heads merged (o input)", 1, "D", True, True, False, ("self_attn.o",)),
    Saved("o output as fp32 (for the gate gradient)", 1, "D", False, False, False, ("adaln",)),
    Saved("o projection (kept by selective)", 0, "D", True, False, True, selective_units=1),
    # cross-attention (no modulation; norm3 is an affine LayerNorm)
    Saved("residual after self-attention (norm3 input, fp32)", 1, "D", False, False, False),
    Saved("norm3 output (cross q input)", 1, "D", True, False, False, ("cross_attn.q",)),
    Saved("cross q projection as the fp32 RMSNorm input", 1, "D", False, True, False),
    Saved("cross q normalised (before the norm weight, fp32)", 1, "D", False, True, False, ("qk_norm",)),
    Saved("cross q (attention input)", 1, "D", True, True, False),
    Saved("cross q projection (kept by selective)", 0, "D", True, True, True, selective_units=1),
    Saved("cross attention output", 1, "D", True, True, True),
    Saved("cross attention output merged (o input): a view in fp32, a bf16 copy under autocast", 0, "D", True,
          True, False, ("cross_attn.o",), autocast_units=1),
    Saved("cross o projection (kept by selective)", 0, "D", True, False, True, selective_units=1),
    # FFN
    Saved("residual after cross-attention (norm2 input, fp32)", 1, "D", False, False, False),
    Saved("norm2 output (for the modulation's scale gradient)", 1, "D", False, False, False, ("adaln",)),
    Saved("modulated input of ffn.0", 1, "D", True, False, False, ("ffn.0",)),
    Saved("ffn.0 output (GELU input)", 1, "M", True, True, True),
    Saved("GELU output (ffn.2 input)", 1, "M", True, True, False, ("ffn.2",)),
    Saved("ffn.2 output as fp32 (for the gate gradient)", 1, "D", False, False, False, ("adaln",)),
    Saved("ffn.2 projection (kept by selective)", 0, "D", True, False, True, selective_units=1),
    # per token: 3 LayerNorms' mean and rstd, the rstd of the q, k and cross q RMSNorms (over all
    # heads: one value per token), the two attentions' logsumexps (per head)
    Saved("LayerNorm mean and rstd (3 norms)", 6, "1", False, False, False),
    Saved("RMSNorm rstd of q, k, cross q", 3, "1", False, False, False),
    Saved("two attention logsumexps", 2, "H", False, True, True),
    # per caption token (text_len of them per sample, whatever the caption's length)
    Saved("caption as k/v input: fp32 shares the text embedding, autocast casts it per projection", 0, "D",
          True, False, False, CAPTION_LAYERS, on="caption", autocast_units=2),
    Saved("cross k projection as the fp32 RMSNorm input", 1, "D", False, True, False, on="caption"),
    Saved("cross k normalised (before the norm weight, fp32)", 1, "D", False, True, False, ("qk_norm",),
          on="caption"),
    Saved("cross k, v (attention inputs)", 2, "D", True, True, False, on="caption"),
    Saved("cross k, v projections (kept by selective)", 0, "D", True, True, True, on="caption", selective_units=2),
    Saved("cross k RMSNorm rstd", 1, "1", False, False, False, on="caption"),
)

OUTSIDE_SAVED: tuple[Saved, ...] = (
    # the head runs in fp32 whatever the compute dtype
    Saved("head: the last block's output (its norm's input)", 1, "D", False, False, True),
    Saved("head: norm output and the modulated projection input", 2, "D", False, False, True, ("head",)),
    Saved("head: norm mean and rstd", 2, "1", False, False, True),
    Saved("latent-sized tensors: the noisy input (patch embedding), the loss error, ...", 3, "1", False, False, True,
          on="latent"),
    # the text embedding, on text_len tokens per sample
    Saved("padded caption (text_embedding.0 input)", 1, "C", True, False, True, ("text_embedding",), on="caption"),
    Saved("text embedding GELU input and output", 2, "D", True, False, True, ("text_embedding",), on="caption"),
    Saved("text context, shared by every block's k and v in fp32 (autocast copies it per block)", 1, "D", False,
          False, True, CAPTION_LAYERS, on="caption", autocast_units=0),
)

# With a time per token (TI2V, its image frame at time 0) the modulation is a tensor per token.
PER_TOKEN_BLOCK: tuple[Saved, ...] = (
    # table + e0, kept whole by the gates' views; 1 + scale adds nothing measurable on top (LiveMemory
    # through the Trainer, tests/planner/test_planner.py: a separate 2 D overshot by 7%)
    Saved("per-token modulation table + e0 (fp32)", 6, "D", False, False, False),
)
PER_TOKEN_OUTSIDE: tuple[Saved, ...] = (
    Saved("per-token time embedding: e0 (6 D) and the head's e (fp32), shared by every block", 7, "D", False,
          False, True),
    Saved("per-token time MLP: its first linear's output and SiLU, SiLU(e) (fp32)", 3, "D", False, False, True),
    Saved("per-token time sinusoid (freq_dim = 256 values, fp32)", 256, "1", False, False, True),
    Saved("per-token head modulation: 1 + scale (fp32)", 1, "D", False, False, True),
)

# Under sequence parallelism the head's input is the gathered output (counted above); measured on
# CPU, the rank keeps one more fp32 D-wide tensor of its own slice instead.
PROFILE = ActivationProfile(block=BLOCK_SAVED, outside=OUTSIDE_SAVED, caption_layers=CAPTION_LAYERS,
                            sp_gathered=0.0, sp_local=1.0)
PER_TOKEN_PROFILE = ActivationProfile(block=BLOCK_SAVED + PER_TOKEN_BLOCK, outside=OUTSIDE_SAVED + PER_TOKEN_OUTSIDE,
                                      caption_layers=CAPTION_LAYERS, sp_gathered=0.0, sp_local=1.0)
