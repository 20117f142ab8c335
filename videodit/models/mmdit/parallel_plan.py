"""What the MMDiT family declares to ``videodit/parallel`` (data only, no torch.distributed): its
tensor-parallel plan, its sequence-parallel scheme and the block arguments that are per image
token, and the one-line check of an SP layout. ``MMDiTSpec`` hands these on.

Tensor parallelism is Open-Sora 2.0's ``MMDiTPolicy`` (``opensora/models/mmdit/distributed.py``):
in a double block each stream's q/k/v column-wise and its ``proj`` row-wise, its MLP's [0]
column-wise and [2] row-wise; in a single block q/k column-wise, the fused ``v_mlp`` (outputs
[v; MLP input]) column-wise per part and the fused ``linear2`` (inputs [attention; MLP
activation]) row-wise per part: each rank takes its slice of each part, so its v heads are its
q/k heads (``parallel/tensor.py``'s fused styles). The per-head q/k RMSNorms (a scale of
head_dim) stay whole on every rank; each rank sees only its heads, so their gradients are
summed over the TP group (``partial``). Modulations, embedders and the final layer stay whole.
"""

from __future__ import annotations

from torch import nn

from videodit.models.spec import TensorParallelPlan, check_ulysses_ring

# parallel/parallelize.py's name for joint [text; image] attention (parallel/joint_attention.py).
SEQUENCE_PARALLEL = "joint_attention"
# block(img [B, Li, D], txt, vec, rope [Li, Dh/2, 2][, text_mask]): the image tokens on dim 1 and
# the RoPE rows on dim 0 are per image token; the text stream, vec and the mask stay whole.
SEQUENCE_ARGS = {0: 1, 3: 0}
# The block outputs (img, txt) that the next block takes as its first two arguments: what
# memory.offload sends to the host for a checkpointed block.
BLOCK_STREAMS = 2


def _double_plan() -> dict:
    plan = {}
    for stream in ("img", "txt"):
        plan.update({f"{stream}_attn.q_proj": "colwise", f"{stream}_attn.k_proj": "colwise",
                     f"{stream}_attn.v_proj": "colwise", f"{stream}_attn.proj": "rowwise",
                     f"{stream}_mlp.0": "colwise", f"{stream}_mlp.2": "rowwise"})
    return plan


def _single_plan(block: nn.Module) -> dict:
    parts = (block.hidden_size, block.v_mlp.out_features - block.hidden_size)   # (v, MLP hidden)
    return {"q_proj": "colwise", "k_proj": "colwise", "v_mlp": ("fused_colwise", parts),
            "linear2": ("fused_rowwise", parts)}


def block_plan(block: nn.Module) -> dict:
    """The plan of one block: a double block has ``img_attn``, a single block ``v_mlp``."""
    return _single_plan(block) if hasattr(block, "v_mlp") else _double_plan()


def tensor_parallel_plan() -> TensorParallelPlan:
    return TensorParallelPlan(block=block_plan, partial=("query_norm", "key_norm"))


def check_sequence_parallel(num_heads: int, *, tp: int, sp: int, ring: int) -> None:
    """sp = Ulysses x ring over the image tokens (the caption is whole on every rank)."""
    check_ulysses_ring(num_heads, tp=tp, sp=sp, ring=ring)


def sequence_parallel() -> str:
    return SEQUENCE_PARALLEL


def sequence_args() -> dict:
    return dict(SEQUENCE_ARGS)
