"""Open-Sora 2.0's overlapping-tile encode/decode (``DCAE.spatial_tiled_*`` / ``temporal_tiled_*``),
so a long or large clip runs in bounded memory and gives Open-Sora's numbers.

Tiles of ``size`` start every ``stride`` along the axis; each tile's output is blended
linearly into the previous (already blended) tile's over ``blend`` positions, then its first
``keep`` positions are kept. The blend weights are computed in double precision and cast once,
as Open-Sora's Python-float loop does, so the result matches it to the bit.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def _blend(prev: Tensor, tile: Tensor, extent: int, dim: int) -> None:
    """In place: the first ``extent`` positions of ``tile`` fade in over the last of ``prev``."""
    extent = min(prev.shape[dim], tile.shape[dim], extent)
    if extent <= 0:
        return
    shape = [1] * tile.ndim
    shape[dim] = extent
    ramp = [i / extent for i in range(extent)]
    into = torch.tensor(ramp, dtype=tile.dtype, device=tile.device).view(shape)
    away = torch.tensor([1 - r for r in ramp], dtype=tile.dtype, device=tile.device).view(shape)
    head = tile.narrow(dim, 0, extent)
    head.copy_(prev.narrow(dim, prev.shape[dim] - extent, extent) * away + head * into)


def tile_space(x: Tensor, run: Callable[[Tensor], Tensor], size: int, stride: int, blend: int,
               keep: int) -> Tensor:
    """``run`` over overlapping ``size`` x ``size`` tiles of H, W (the last two dims)."""
    rows = []
    for i in range(0, x.shape[-2], stride):
        row = []
        for j in range(0, x.shape[-1], stride):
            tile = run(x[..., i:i + size, j:j + size])
            if rows:
                _blend(rows[-1][len(row)], tile, blend, -2)
            if row:
                _blend(row[-1], tile, blend, -1)
            row.append(tile)
        rows.append(row)
    return torch.cat([torch.cat([t[..., :keep, :keep] for t in row], dim=-1) for row in rows], dim=-2)


def tile_time(x: Tensor, run: Callable[[Tensor], Tensor], size: int, stride: int, blend: int,
              keep: int, min_last: int = 1) -> Tensor:
    """``run`` over overlapping ``size``-frame tiles of T (dim 2). A last tile shorter than
    ``min_last`` frames is not run; the tile before it (which reaches the end) is kept whole."""
    starts = list(range(0, x.shape[2], stride))
    # Open-Sora runs such a tile too; for the DC-AE one latent frame decodes to one frame, not 4.
    short = len(starts) > 1 and x.shape[2] - starts[-1] < min_last and starts[-2] + size >= x.shape[2]
    if short:
        starts.pop()
    outs: list[Tensor] = []
    for i in starts:
        tile = run(x[:, :, i:i + size])
        if outs:
            _blend(outs[-1], tile, blend, 2)
        outs.append(tile)
    kept = [t[:, :, :keep] for t in outs[:-1]] + [outs[-1] if short else outs[-1][:, :, :keep]]
    return torch.cat(kept, dim=2)


__all__ = ["tile_space", "tile_time"]
