"""What one sample costs, in FLOPs, part by part: the counts every family's FLOP model
returns (``models/<family>/flops.py``) and the step costs computed from them.

Counts are matmul FLOPs, 2 x multiply-accumulates, as ``torch.utils.flop_counter.FlopCounterMode``
counts them: every linear layer, the patch embedding, and attention's QK^T and AV at the real
sequence lengths. Norms, modulation, RoPE, softmax and other elementwise work are left out
(O(D) per token against the matmuls' O(D^2)).

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


@dataclass(frozen=True)
class FlopCount:
    """Forward FLOPs of one sample. ``blocks`` in execution order."""
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



def step_costs(count: FlopCount, memory: MemoryConfig | None = None, fused_attention: bool = True,
               kinds: tuple[str, ...] | None = None) -> list[float]:
    """Hardware FLOPs of one training step per block, the embedding added to the first and the
    final layer to the last (what a pipeline stage holding those parts runs). ``kinds``: each
    block's kind, which ``memory.checkpoint_blocks`` (first n blocks per kind) needs."""
    checkpointed = set(memory.checkpointed_blocks(len(count.blocks), kinds)) \
        if memory is not None and memory.checkpointing == "full" else set()
    costs = [3 * f + (a / 2 if fused_attention else 0) + (f if i in checkpointed else 0)
             for i, (f, a) in enumerate(zip(count.blocks, count.attention))]
    costs[0] += 3 * count.embed - count.data_fed
    costs[-1] += 3 * count.final
    return costs
