"""Sequence parallelism for full 3D attention (``parallel/full_attention.py``): Ulysses, ring and
USP against one process, on a tiny Wan-like stand-in model (the worker); the ring's blockwise
LSE merge on its own; the one-line size check.

Under torchrun every rank runs the unsharded model as the reference on the same batch, so one
launch per process count covers every layout. Lengths do not split evenly (padding, and with
sp=4 and 9 tokens a slice that is all padding). fp32 agrees to ~5e-7 relative (summation
order); the fp64 layouts show the maths is exact (~1e-15).
"""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import torchrun
from videodit.errors import UserError
from videodit.parallel.ring_attention import block_backward, block_forward, merge, valid_keys

WORKER = Path(__file__).parent / "workers" / "full_attention_worker.py"
DEPTH = 3   # the worker's model
TOLERANCE = {"float32": 1e-5, "float64": 1e-12}


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blockwise_attention_merged_by_lse_is_full_attention(kernel, dtype):
    """Key blocks of 3 over 10 tokens padded to 12 (the last block holds one real key): the
    merged blocks give SDPA's output, and each block's backward, given the merged output and
    LSE, gives SDPA's gradients."""
    g = torch.Generator().manual_seed(0)
    batch, heads, length, head_dim, block = 2, 3, 10, 8, 3
    q, k, v = (torch.randn(batch, heads, length, head_dim, generator=g, dtype=dtype, requires_grad=True)
               for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v)
    dout = torch.randn(want.shape, generator=g, dtype=dtype)
    want.backward(dout)

    scale = 1 / math.sqrt(head_dim)
    query = q.detach().transpose(1, 2).contiguous().transpose(1, 2)   # strided like split_heads' output
    blocks = [(start, valid_keys(length, i, block)) for i, start in enumerate(range(0, 12, block))]
    assert [valid for _, valid in blocks] == [3, 3, 3, 1]
    out = lse = None
    for start, valid in blocks:
        keys = slice(start, start + valid)
        block_out, block_lse, _ = block_forward(query, k.detach()[:, :, keys], v.detach()[:, :, keys], scale, kernel)
        out, lse = merge(out, lse, block_out, block_lse)
    out = out.to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out, want.detach(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(lse, torch.logsumexp(q.detach() @ k.detach().transpose(-2, -1) * scale, -1),
                               rtol=tolerance, atol=tolerance)

    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for start, valid in blocks:
        keys = slice(start, start + valid)
        bq, bk, bv = block_backward(dout, query, k.detach()[:, :, keys].contiguous(),
                                    v.detach()[:, :, keys].contiguous(), out, lse, scale, kernel, ())
        dq += bq
        dk[:, :, keys] += bk
        dv[:, :, keys] += bv
    for got, tensor in ((dq, q), (dk, k), (dv, v)):
        torch.testing.assert_close(got, tensor.grad, rtol=tolerance, atol=tolerance)


def test_impossible_layouts_are_one_line_user_errors():
    from videodit.models.families import get_spec
    check = get_spec("wan").check_sequence_parallel   # the family checks its sizes (parallel/dims.py asks)
    check(12, tp=1, sp=8, ring=2)    # 4 Ulysses ranks split 12 heads
    check(5, tp=1, sp=4, ring=4)     # ring only: any head count
    with pytest.raises(UserError, match=r"^parallel.sp=8 with parallel.sp_ring=1 leaves 8 Ulysses ranks, which "
                                        r"do not divide the 12 attention heads per tensor-parallel rank; valid "
                                        r"parallel.sp_ring: 2, 4, 8 "):
        check(12, tp=1, sp=8, ring=1)
    with pytest.raises(UserError, match=r"^parallel.sp_ring=3 does not divide parallel.sp=4; valid: 1, 2, 4$"):
        check(12, tp=1, sp=4, ring=3)
    with pytest.raises(UserError, match="6 attention heads per tensor-parallel rank"):
        check(12, tp=2, sp=4, ring=1)


def run_layouts(tmp_path, nproc: int, layouts: list[dict]) -> dict:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out": str(tmp_path / "results.json"), "layouts": layouts}))
    result = torchrun(nproc, str(WORKER), str(spec))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((tmp_path / "results.json").read_text())


def assert_matches_one_process(layouts: list[dict], results: dict) -> None:
    for layout in layouts:
        got = results[layout["name"]]
        tolerance = TOLERANCE[layout.get("dtype", "float32")]
        assert got["out"] < tolerance and got["grad"] < tolerance, (layout["name"], got)
        recomputed = 2 if layout.get("checkpoint") else 1   # checkpointing reruns self-attention in backward
        assert got["self_attention_calls"] == DEPTH * len(layout["lengths"]) * recomputed, (layout["name"], got)


def test_two_processes_match_one(tmp_path):
    layouts = [
        {"name": "ulysses", "sp": 2, "ring": 1, "lengths": [13, 6]},   # e0 [B, 6, D] with 6 tokens: stays whole
        {"name": "ring", "sp": 2, "ring": 2, "lengths": [13, 6], "per_token": True},
        {"name": "ring_fp64", "sp": 2, "ring": 2, "lengths": [13], "per_token": True, "dtype": "float64"},
        {"name": "ring_checkpoint", "sp": 2, "ring": 2, "lengths": [11], "checkpoint": "selective",
         "rope_kwarg": True},
    ]
    assert_matches_one_process(layouts, run_layouts(tmp_path, 2, layouts))


def test_four_processes_match_one(tmp_path):
    layouts = [
        {"name": "ring", "sp": 4, "ring": 4, "lengths": [9, 14]},   # 9 tokens: rank 3 holds only padding
        {"name": "ulysses", "sp": 4, "ring": 1, "lengths": [9], "per_token": True},
        {"name": "usp", "sp": 4, "ring": 2, "lengths": [13, 9], "per_token": True},
        {"name": "usp_fp64", "sp": 4, "ring": 2, "lengths": [13], "dtype": "float64"},
        # Sub-groups from the unflattened 1-D DeviceMesh instead of the bare ProcessGroup.
        {"name": "usp_mesh_checkpoint", "sp": 4, "ring": 2, "group": "mesh", "lengths": [13],
         "checkpoint": "full", "rope_kwarg": True},
        {"name": "ring_times_dp", "sp": 2, "ring": 2, "group": "mesh", "lengths": [13]},   # dp=2 x sp=2
    ]
    assert_matches_one_process(layouts, run_layouts(tmp_path, 4, layouts))
