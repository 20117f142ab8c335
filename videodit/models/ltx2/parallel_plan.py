"""What the LTX-2 family declares to ``videodit/parallel`` (data only, no torch.distributed): its
tensor-parallel plan, its sequence-parallel scheme and the one-line check of an SP layout.
``LTX2Spec`` hands these on.

**Tensor parallelism**, Megatron pairs in every block, per stream and for the cross-modal
attentions: each attention's ``to_q``/``to_k``/``to_v`` (and LTX-2.3's per-head
``to_gate_logits``) column-wise, so rank r holds heads r H/tp .. (r+1) H/tp of every attention;
``to_out.0`` row-wise; each FFN's ``net.0.proj`` column-wise and ``net.2`` row-wise. The q/k
RMSNorms span all heads (as Wan's): ``sharded_norms``, their weights sharded with the columns and
their mean of squares all-reduced. RoPE gives each head its own frequency band, so the (cos, sin)
tables [B, H, T, head_dim / 2] handed to an attention (``rope``, ``k_rope``) are cut to the rank's
heads (style ``head_tables``). The time embedders, the modulation tables and the output layers
stay whole (their gradients are alike on every TP rank); LTX-2.0's caption projections are a
column/row pair at the root.

**Sequence parallelism** (``full_attention``; Ulysses x ring over the video tokens): before the
first block every rank keeps its contiguous slice of the video tokens and of every per-video-token
input (the video stream's modulation when it is per token, its self-attention and cross-modal
RoPE tables, its cross-modal modulation); after the last block the video is gathered. The text is
whole on every rank (every text cross-attention is local). The audio stream, when given, is whole
on every rank too (it is short: 25 tokens a second) and runs unsharded: its self- and text
attentions are local; audio -> video attention (queries the rank's video tokens, keys the whole
audio) is local; video -> audio attention (queries the whole audio, keys the sharded video) runs
as ring attention over the whole SP group (``whole_query_kinds``), whose backward sends each
video key block's gradient home summed over the ranks, so the audio stream's gradients, different
per rank, add up over the SP ranks to sp x one process's, as the video's do. No gather of the
video keys, no extra copy of the audio: the simplest scheme that is exact.
"""

from __future__ import annotations

from torch import nn

from videodit.errors import UserError
from videodit.models.spec import TensorParallelPlan, check_ulysses_ring

SEQUENCE_PARALLEL = "full_attention"
# block(vx [B, Tv, d], ax [B, Ta, a] or None, video StreamInputs, audio StreamInputs or None):
# the video tokens on dim 1; of the video's inputs, the per-token fields (one row: shared, left
# whole); the audio stream and its inputs stay whole.
SEQUENCE_ARGS = {0: 1, 2: {"modulation": 1, "rope": 2, "cross_rope": 2, "cross_modulation": 1}}
# Attention kinds whose queries are whole on every rank and whose keys are the sharded video.
WHOLE_QUERY_KINDS = ("v2a",)
# The block outputs (vx, ax) that the next block takes as its first two arguments.
BLOCK_STREAMS = 2

ATTENTIONS = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
FEED_FORWARDS = ("ff", "audio_ff")
ROPE_ARGS = ("rope", "k_rope")


def block_plan(block: nn.Module) -> dict:
    plan = {}
    for name in ATTENTIONS:
        attention = block.get_submodule(name)
        plan.update({f"{name}.to_q": "colwise", f"{name}.to_k": "colwise", f"{name}.to_v": "colwise",
                     f"{name}.to_out.0": "rowwise", name: ("head_tables", ROPE_ARGS)})
        if attention.to_gate_logits is not None:
            plan[f"{name}.to_gate_logits"] = "colwise"
    for name in FEED_FORWARDS:
        plan.update({f"{name}.net.0.proj": "colwise", f"{name}.net.2": "rowwise"})
    return plan


def tensor_parallel_plan() -> TensorParallelPlan:
    root = {}
    for name in ("caption_projection", "audio_caption_projection"):   # LTX-2.0 only (parallel/ skips absent ones)
        root.update({f"{name}.linear_1": "colwise", f"{name}.linear_2": "rowwise"})
    return TensorParallelPlan(block=block_plan, root=root, sharded_norms=("q_norm", "k_norm"))


def check_sequence_parallel(num_heads: int, *, tp: int, sp: int, ring: int) -> None:
    """sp = Ulysses x ring over the video tokens (text and audio whole on every rank)."""
    try:
        check_ulysses_ring(num_heads, tp=tp, sp=sp, ring=ring)
    except UserError as exc:
        raise UserError(f"LTX-2 shards its video tokens over parallel.sp (text and audio whole on every rank): "
                        f"{exc}") from None
