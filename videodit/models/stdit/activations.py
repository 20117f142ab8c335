"""What STDiT keeps for backward: the planner's activation profile (``ModelSpec.activation_profile``).

Made by reading what the ops of ``STBlock`` save (``saved_tensors_hooks`` on a block, op by op)
and checked against ``videodit.planner.measure.LiveMemory`` in ``tests/planner/test_planner.py``.
"""

from __future__ import annotations

from videodit.models.spec import ActivationProfile, Saved

QKV = ("attn.q", "attn.k", "attn.v")

BLOCK_SAVED: tuple[Saved, ...] = (
    # self-attention (spatial or temporal)
    Saved("block input (residual stream)", 1, "D", False, False, True),
    Saved("norm1 output (for the adaLN scale gradient)", 1, "D", False, False, False, ("adaln",)),
    Saved("modulated input of q/k/v", 1, "D", True, False, False, QKV),
    Saved("q, k before QK-norm", 2, "D", True, True, True),
    Saved("q, k normalised (before the norm weight)", 2, "D", False, True, False, ("qk_norm",)),
    Saved("q, k after QK-norm (and RoPE), attention inputs", 2, "D", True, True, False),
    Saved("v", 1, "D", True, True, True),
    Saved("attention output", 1, "D", True, True, True),
    Saved("attention output with heads merged (proj input)", 1, "D", True, True, False, ("attn.proj",)),
    Saved("output projection (for the gate gradient)", 1, "D", True, False, True, ("adaln",)),
    # cross-attention
    Saved("residual after self-attention (q input)", 1, "D", True, False, False, ("cross_attn.q",)),
    Saved("cross q", 1, "D", True, True, True),
    Saved("cross attention output (proj input)", 1, "D", True, True, True),
    Saved("cross output projection (kept only by selective)", 0, "D", True, False, True, selective_units=1),
    # MLP
    Saved("residual after cross-attention (norm2 input)", 1, "D", False, False, False),
    Saved("norm2 output", 1, "D", False, False, False, ("adaln",)),
    Saved("modulated input of fc1", 1, "D", True, False, False, ("mlp.fc1",)),
    Saved("fc1 output (GELU input)", 1, "M", True, True, True),
    Saved("GELU output (fc2 input)", 1, "M", True, True, False, ("mlp.fc2",)),
    Saved("fc2 output (for the gate gradient)", 1, "D", True, False, True, ("adaln",)),
    # per token and per caption token
    Saved("LayerNorm mean and rstd (2 norms)", 4, "1", False, False, True),
    Saved("QK-norm rstd (q, k per head) and two attention logsumexps", 4, "H", False, True, True),
    Saved("cross-attention keys and values of the caption", 2, "D", True, True, True, on="caption"),
)

OUTSIDE_SAVED: tuple[Saved, ...] = (
    Saved("final layer: its norm's output and the modulated projection input", 2, "D", False, False, True,
          ("final_layer",)),
    Saved("final layer: norm mean and rstd", 2, "1", False, False, True),
    Saved("latent-sized tensors: input, patch output, unpatchified output, velocity, error", 5, "1", False,
          False, True, on="latent"),
)

PROFILE = ActivationProfile(block=BLOCK_SAVED, outside=OUTSIDE_SAVED, caption_layers=("cross_attn.k", "cross_attn.v"))
