"""What the MMDiT keeps for backward: the planner's activation profile (``ModelSpec.activation_profile``).

Measured with ``saved_tensors_hooks`` on one block of each kind (distinct storages, in fp32 and
under bf16 autocast; ``tests/models/test_mmdit.py`` holds these numbers against the blocks). Per
token, text tokens and image tokens alike: every block runs the same ops on both (the double
blocks with their own text weights, the single blocks on [text; image]), so each entry is counted
once on the image tokens of the rank and once on the caption tokens (which sequence parallelism
replicates rather than splits).

- double block, fp32: 17 D + 2 M + 3 H + 4 values (two LayerNorms' mean and rstd; q/k RMSNorm
  rstd per head; the attention's logsumexp per head); under autocast 6 D stay fp32 (the residual
  stream, the norms' inputs and outputs, the gate products) and 13 D + 2 M are bf16 (autocast
  casts the modulated input once per projection: q, k, v);
- single block, fp32: 13 D + 2 M + 3 H + 2; under autocast 4 D fp32 and 11 D + 2 M bf16;
- both: the RoPE table of [text; image] (cos and sin, head_dim values per token, fp32), which
  the rotation keeps for its backward (its one saved tensor, as Liger's fused kernel).

The planner holds one profile per block; the MMDiT has two kinds, so :func:`profile` weighs
each kind's entries by its share of the blocks: the total over all blocks is exact, a pipeline
stage of mostly one kind is off by the difference between kinds (about 15%).
"""

from __future__ import annotations

from videodit.models.spec import ActivationProfile, Saved

# (what, units, per, low, tp, selective units, autocast units); selective checkpointing keeps the
# block input (1 D) and the matmul and attention outputs.
_DOUBLE = (
    ("residual stream, norm inputs and outputs, gate products (fp32 under autocast)", 6, "D", False, False, 1, None),
    ("modulated projection inputs, q/k/v and their norms, attention inputs and output", 11, "D", True, True, 6, 13),
    ("MLP hidden: the GELU's input and output", 2, "M", True, True, 1, None),
    ("q/k RMSNorm rstd and the attention logsumexp, per head", 3, "H", False, True, 1, None),
    ("two LayerNorms' mean and rstd", 4, "1", False, False, 0, None),
)
_SINGLE = (
    ("residual stream, norm input and output, gate product (fp32 under autocast)", 4, "D", False, False, 1, None),
    ("modulated projection inputs, q/k/v and their norms, attention inputs and output", 9, "D", True, True, 5, 11),
    ("MLP half of v_mlp: the GELU's input and output", 2, "M", True, True, 1, None),
    ("q/k RMSNorm rstd and the attention logsumexp, per head", 3, "H", False, True, 1, None),
    ("a LayerNorm's mean and rstd", 2, "1", False, False, 0, None),
)
TEXT_LAYERS = ("txt_attn.q_proj", "txt_attn.k_proj", "txt_attn.v_proj", "txt_attn.proj", "txt_mlp.0", "txt_mlp.2")

OUTSIDE_SAVED: tuple[Saved, ...] = (
    Saved("final layer: the last block's image output, its norm output and the modulated linear input", 3, "D",
          False, False, True, ("final_layer",)),
    Saved("latent-sized tensors: x_t and the condition (img_in, cond_in inputs), the loss error", 5, "1", False,
          False, True, on="latent"),
    Saved("caption (txt_in input)", 1, "C", True, False, True, ("txt_in",), on="caption"),
)


def _rope_table(num_heads: int) -> tuple:
    return (("the RoPE table of [text; image] (cos, sin: head_dim values)", 1 / num_heads, "D", False, False, 0,
             None),)


def _entries(table, share: float, kind: str) -> tuple[Saved, ...]:
    out = []
    for what, units, per, low, tp, selective, autocast in table:
        for on in ("tokens", "caption"):
            out.append(Saved(f"{kind} ({on}): {what}", units * share, per, low, tp, bool(selective), (),
                             on=on, selective_units=selective * share,
                             autocast_units=None if autocast is None else autocast * share))
    return tuple(out)


def profile(depth: int, depth_single: int, num_heads: int) -> ActivationProfile:
    """The per-block profile of a model of ``depth`` double and ``depth_single`` single blocks."""
    blocks = max(depth + depth_single, 1)
    block = (_entries(_DOUBLE, depth / blocks, "double") + _entries(_SINGLE, depth_single / blocks, "single")
             + _entries(_rope_table(num_heads), 1.0, "both"))
    return ActivationProfile(block=block, outside=OUTSIDE_SAVED, caption_layers=TEXT_LAYERS,
                             sp_gathered=0.0, sp_local=1.0, caption_stream=True)


def block_units(kind: str, bf16: bool, mlp_ratio: float, num_heads: int, hidden: int) -> float:
    """Bytes one token keeps in one block of ``kind``, over 4 x hidden (what the test measures)."""
    m = mlp_ratio * hidden
    total = 0.0
    for _, units, per, low, _, _, autocast in (*(_DOUBLE if kind == "double" else _SINGLE), *_rope_table(num_heads)):
        width = {"D": hidden, "M": m, "H": num_heads, "1": 1}[per]
        count = autocast if (bf16 and autocast is not None) else units
        total += count * width * (2 if (bf16 and low) else 4)
    return total / (4 * hidden)
