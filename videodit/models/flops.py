"""The FLOP model of an STDiT (``models/stdit.py``): what one sample costs, part by part.

One model for every user: the pipeline balances its stages with it, the planner gives
buckets equal step time with it and ``videodit plan`` prints it. Counts are matmul FLOPs,
2 x multiply-accumulates, as ``torch.utils.flop_counter.FlopCounterMode`` counts them:
every linear layer, the Conv3d patch embedding, and attention's QK^T and AV at the real
sequence lengths. Norms, modulation, RoPE, softmax and other elementwise work are left out
(O(D) per token against the matmuls' O(D^2)). ``tests/models/test_flops.py`` holds this
against FlopCounterMode on real models.

Two totals for a training step:

* **model FLOPs**: forward + backward of the maths. Backward is 2x forward per matmul
  (input and weight gradients, attention's dQ, dK, dV and dP included), except that a
  matmul fed by data computes only its weight gradient.
* **hardware FLOPs**: what the GPU runs. Model FLOPs, plus the fused attention kernels'
  recompute of QK^T in backward (flash/efficient/cudnn SDPA; FlopCounterMode counts their
  backward as 2.5x forward), plus the forward of every block under full activation
  checkpointing. Selective checkpointing keeps all matmul and attention outputs and
  recomputes only elementwise ops, so it adds no matmul FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from videodit.config import MemoryConfig
from videodit.models.stdit import DiTGeometry

# The sin/cos feature width of the time and fps embedders (layers.ScalarEmbedder's default).
SCALAR_FEATURES = 256


@dataclass(frozen=True)
class FlopCount:
    """Forward FLOPs of one sample. ``blocks`` in execution order: spatial 0, temporal 0, ..."""
    embed: float
    blocks: tuple[float, ...]
    final: float
    attention: tuple[float, ...]   # per block, included in ``blocks``: QK^T + AV of self- and cross-attention
    data_fed: float                # included in ``embed``: matmuls whose input is data (no input gradient)

    @property
    def total(self) -> float:
        return self.embed + sum(self.blocks) + self.final

    @property
    def backward(self) -> float:
        """Model FLOPs of backward: 2x forward, 1x for the matmuls fed by data."""
        return 2 * self.total - self.data_fed


@dataclass(frozen=True)
class StepFlops:
    model: float       # forward + backward
    hardware: float    # + fused attention's QK^T recompute + checkpointed blocks' forward


def patch_grid(geometry: DiTGeometry, frames: int, height: int, width: int) -> tuple[int, int, int]:
    """(T', H', W') of a latent (frames, height, width): padded up to the patch, as STDiT.embed does."""
    pt, ph, pw = geometry.patch_size
    return -(-frames // pt), -(-height // ph), -(-width // pw)


def forward_flops(geometry: DiTGeometry, frames: int, height: int, width: int, caption_tokens: int,
                  fps: bool = True) -> FlopCount:
    """Forward FLOPs of one sample of latent shape (frames, height, width) with captions padded
    to ``caption_tokens`` (the mask does not shorten them); ``fps``: the fps embedder runs."""
    tp, hp, wp = patch_grid(geometry, frames, height, width)
    return grid_flops(geometry, tp, hp * wp, caption_tokens, fps)


def grid_flops(geometry: DiTGeometry, frames: int, positions: int, caption_tokens: int,
               fps: bool = True) -> FlopCount:
    """:func:`forward_flops` on the patched grid: ``frames`` (T') x ``positions`` (S = H' W')."""
    g, d = geometry, geometry.hidden_size
    tokens, length = frames * positions, caption_tokens
    patch = tokens * 2 * d * _patch_values(g)           # the Conv3d in, the final projection out
    scalar = 2 * (SCALAR_FEATURES * d + d * d)          # one ScalarEmbedder MLP
    data_fed = patch + 2 * SCALAR_FEATURES * d * (1 + fps)
    embed = (patch + scalar * (1 + fps) + 2 * d * 6 * d                 # t (and fps) embedders, t_block
             + length * 2 * (g.caption_channels * d + d * d)            # caption MLP
             + (4 * d * d if g.pooled_caption else 0))                  # pooled caption MLP
    attention = [_attention(g, frames, positions, length, temporal=i % 2 == 1) for i in range(2 * g.depth)]
    blocks = tuple(_block_linears(g, tokens, length) + a for a in attention)
    return FlopCount(float(embed), blocks, float(patch), tuple(float(a) for a in attention), float(data_fed))


def _patch_values(g: DiTGeometry) -> int:
    return g.in_channels * g.patch_size[0] * g.patch_size[1] * g.patch_size[2]


def _block_linears(g: DiTGeometry, tokens: int, length: int) -> float:
    """Every linear layer of one block. adaLN-single has none per block (a table added to t_mod)."""
    d, hidden = g.hidden_size, int(g.hidden_size * g.mlp_ratio)
    self_attention = 4 * tokens * 2 * d * d                # q, k, v, proj
    cross = 2 * tokens * 2 * d * d + 2 * length * 2 * d * d   # q, proj over the video; k, v over the caption
    mlp = tokens * 2 * 2 * d * hidden                      # fc1, fc2
    return float(self_attention + cross + mlp)


def _attention(g: DiTGeometry, frames: int, positions: int, length: int, temporal: bool) -> float:
    """QK^T and AV (2 x 2 x q_len x k_len x D per sequence) of self- and cross-attention."""
    d = g.hidden_size
    sequences, seq_len = (positions, frames) if temporal else (frames, positions)
    return float(4 * d * (sequences * seq_len * seq_len + frames * positions * length))


def train_step_flops(geometry: DiTGeometry, batch: int, frames: int, height: int, width: int,
                     caption_tokens: int, memory: MemoryConfig | None = None,
                     fused_attention: bool = True) -> StepFlops:
    """Model and hardware FLOPs of one training step (forward + backward) of ``batch`` samples,
    as the Trainer runs it: with fps and caption dropout (the null-caption ``where`` gives the
    caption a gradient, so only the patch embedding and the first layer of the time and fps
    embedders are fed by data). ``fused_attention``: SDPA runs a fused kernel (GPU), whose
    backward recomputes QK^T; the math path (CPU under FlopCounterMode) keeps it."""
    count = forward_flops(geometry, frames, height, width, caption_tokens)
    hardware = sum(step_costs(count, memory, fused_attention))
    return StepFlops(batch * (count.total + count.backward), batch * hardware)


def step_costs(count: FlopCount, memory: MemoryConfig | None = None, fused_attention: bool = True) -> list[float]:
    """Hardware FLOPs of one training step per block, the embedding added to the first and the
    final layer to the last (what a pipeline stage holding those parts runs)."""
    checkpointed = set(memory.checkpointed_blocks(len(count.blocks))) \
        if memory is not None and memory.checkpointing == "full" else set()
    costs = [3 * f + (a / 2 if fused_attention else 0) + (f if i in checkpointed else 0)
             for i, (f, a) in enumerate(zip(count.blocks, count.attention))]
    costs[0] += 3 * count.embed - count.data_fed
    costs[-1] += 3 * count.final
    return costs


def block_costs(geometry: DiTGeometry, frames: int, positions: int, caption_tokens: int) -> list[float]:
    """Pipeline stage balance: :func:`step_costs` on the patched grid (``frames`` T' x
    ``positions`` S). Checkpoint recompute is left out: under pipeline parallelism the
    checkpointed blocks are chosen per stage, after the split these costs decide."""
    return step_costs(grid_flops(geometry, frames, positions, caption_tokens))
