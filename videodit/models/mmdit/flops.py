"""The FLOP model of the MMDiT (``models/mmdit/model.py``), part by part (see
``models/flop_count.py`` for what is counted). ``tests/models/test_mmdit.py`` holds it against
FlopCounterMode on a real model, exactly.

Every block runs its linears on the text tokens as well as the image tokens (the double blocks
with their own text weights, the single blocks on [text; image]) and attends over both, so the
caption length counts everywhere: without a mask Open-Sora's T5 gives all 512 tokens.
"""

from __future__ import annotations

from videodit.models.flop_count import FlopCount
from videodit.models.mmdit.model import TIME_FREQ_DIM, MMDiTGeometry


def grid_flops(g: MMDiTGeometry, tokens: int, caption_tokens: int) -> FlopCount:
    """Forward FLOPs of one sample of ``tokens`` image tokens and ``caption_tokens`` text tokens."""
    d, m, text = g.hidden_size, g.mlp_hidden, caption_tokens
    joint = tokens + text
    data_fed = (tokens * 2 * g.in_channels * d                      # img_in, fed by x_t
                + (tokens * 2 * g.cond_channels * d if g.cond_embed else 0)   # cond_in, fed by the condition
                + text * 2 * g.context_in_dim * d                   # txt_in, fed by the text encoder
                + 2 * TIME_FREQ_DIM * d + 2 * g.vec_in_dim * d)     # time_in, vector_in first layers
    embed = data_fed + 2 * (2 * d * d)                              # + their second layers
    attention = 4 * d * joint * joint                               # QK^T + AV over [text; image]
    double = (2 * 2 * d * 6 * d                                     # img_mod, txt_mod
              + joint * (4 * 2 * d * d + 2 * 2 * d * m)             # q, k, v, proj and the MLP, per stream
              + attention)
    single = (2 * d * 3 * d                                         # modulation
              + joint * (2 * 2 * d * d + 2 * 2 * d * (d + m))       # q, k; v_mlp and linear2
              + attention)
    final = 2 * d * 2 * d + tokens * 2 * d * g.in_channels          # adaLN modulation, linear
    return FlopCount(float(embed), (float(double),) * g.depth + (float(single),) * g.depth_single_blocks,
                     float(final), (float(attention),) * (g.depth + g.depth_single_blocks), float(data_fed))
