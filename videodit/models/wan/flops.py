"""The FLOP model of a Wan DiT (``models/wan/model.py``), part by part (see
``models/flop_count.py`` for what is counted). ``tests/models/test_flops.py`` holds it against
FlopCounterMode on a real model.

Wan's text always has ``text_len`` tokens (zero-padded inside the model, attended without a
mask), so the caption length is the geometry's, not the caption's.
"""

from __future__ import annotations

import math

from videodit.models.flop_count import FlopCount
from videodit.models.wan.model import WanGeometry


def grid_flops(g: WanGeometry, tokens: int) -> FlopCount:
    """Forward FLOPs of one sample of ``tokens`` video tokens."""
    d, text = g.dim, g.text_len
    patch_values = g.in_channels * math.prod(g.patch_size)
    patch_in = tokens * 2 * d * patch_values                       # the Conv3d patchify
    text_in = text * 2 * g.text_dim * d                            # text_embedding.0, fed by the text encoder
    time_in = 2 * g.freq_dim * d                                   # time_embedding.0, fed by the sinusoid
    embed = (patch_in + text_in + text * 2 * d * d                 # + text_embedding.2
             + time_in + 2 * d * d + 2 * d * 6 * d)                # + time_embedding.2, time_projection
    attention = 4 * d * tokens * (tokens + text)                   # QK^T + AV: self, then cross to the text
    linears = (4 * tokens * 2 * d * d                              # self q, k, v, o
               + 2 * tokens * 2 * d * d + 2 * text * 2 * d * d     # cross q, o on video; k, v on text
               + tokens * 2 * 2 * d * g.ffn_dim)                   # the FFN
    final = tokens * 2 * d * g.out_channels * math.prod(g.patch_size)
    return FlopCount(float(embed), (float(linears + attention),) * g.num_layers, float(final),
                     (float(attention),) * g.num_layers, float(patch_in + text_in + time_in))
