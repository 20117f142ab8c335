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
    """Forward FLOPs of one sample of ``tokens`` video tokens. A ti2v model trains with a time per
    token (its image frame at time 0), so its time MLPs run per token; an i2v model with CLIP
    features embeds 257 image tokens, which every cross-attention reads with its own k/v."""
    d, text, image = g.dim, g.text_len, g.image_tokens
    times = tokens if g.task == "ti2v" else 1
    patch_values = g.in_channels * math.prod(g.patch_size)
    patch_in = tokens * 2 * d * patch_values                       # the Conv3d patchify
    text_in = text * 2 * g.text_dim * d                            # text_embedding.0, fed by the text encoder
    time_in = times * 2 * g.freq_dim * d                           # time_embedding.0, fed by the sinusoid
    image_in = image * 2 * (g.image_dim or 0) ** 2                 # img_emb's first linear (after a LayerNorm
                                                                   # with weights: its input needs a gradient)
    embed = (patch_in + text_in + text * 2 * d * d                 # + text_embedding.2
             + time_in + times * (2 * d * d + 2 * d * 6 * d)       # + time_embedding.2, time_projection
             + image_in + image * 2 * (g.image_dim or 0) * d)      # + img_emb's second linear
    attention = 4 * d * tokens * (tokens + text + image)           # QK^T + AV: self, cross to text and image
    linears = (4 * tokens * 2 * d * d                              # self q, k, v, o
               + 2 * tokens * 2 * d * d + 2 * text * 2 * d * d     # cross q, o on video; k, v on text
               + 2 * image * 2 * d * d                             # k_img, v_img on the image tokens
               + tokens * 2 * 2 * d * g.ffn_dim)                   # the FFN
    final = tokens * 2 * d * g.out_channels * math.prod(g.patch_size)
    return FlopCount(float(embed), (float(linears + attention),) * g.num_layers, float(final),
                     (float(attention),) * g.num_layers, float(patch_in + text_in + time_in))
