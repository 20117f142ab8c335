"""The FLOP model of an STDiT: what one forward costs, block by block.

One model for every user: the pipeline balances its stages with it and the planner gives
buckets equal step time with it. Counts are 2 x multiply-accumulates of the matmuls (the
linear layers and attention's QK^T and AV); elementwise work is left out.
"""

from __future__ import annotations

from videodit.models.stdit import DiTGeometry


def block_costs(geometry: DiTGeometry, frames: int, positions: int, caption_tokens: int) -> list[float]:
    """Forward FLOPs of each block in execution order (spatial 0, temporal 0, spatial 1, ...)
    for one sample of ``frames`` x ``positions`` tokens (after patching), with the input
    embedding added to the first block and the output layer to the last."""
    g = geometry
    d, n, length = g.hidden_size, frames * positions, caption_tokens
    per_token = (12 + 4 * g.mlp_ratio) * d * d          # q, k, v, proj, cross q/proj, MLP: 2 x MACs
    costs = []
    for index in range(2 * g.depth):
        temporal = index % 2 == 1
        attention = 4 * d * (positions * frames * frames if temporal else frames * positions * positions)
        costs.append(n * per_token + 4 * length * d * d + 4 * n * length * d + attention)
    patch = g.in_channels * g.patch_size[0] * g.patch_size[1] * g.patch_size[2]
    costs[0] += 2 * n * d * patch + 2 * length * (g.caption_channels * d + d * d)
    costs[-1] += 2 * n * d * patch
    return costs
