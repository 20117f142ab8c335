"""Run under torchrun by tests/parallel/test_full_attention_sp.py: full-attention sequence
parallelism (Ulysses, ring, USP) on a tiny Wan-like stand-in model against one process.

Usage: torchrun --nproc-per-node N full_attention_worker.py SPEC.json
SPEC: {"out": file, "layouts": [{"name", "sp", "ring", "lengths": [...], "per_token": bool,
"group": "world" | "mesh", "checkpoint": null | "full" | "selective", "rope_kwarg": bool,
"dtype": "float32" | "float64"}]}.
Every rank builds the same seeded model, runs the unsharded copy as the reference, then the
SP copy on the same batch; the SP gradients are averaged over all ranks (the data-parallel
mean includes the SP ranks). Rank 0 writes, per layout, the largest relative difference of
the output and of any parameter gradient, and how many self-attention calls ran.
"""

import copy
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from videodit.models.layers import SDPA, merge_heads, split_heads
from videodit.parallel.activation_checkpoint import checkpoint_module
from videodit.parallel.full_attention import apply_full_attention_sp

DIM, HEADS, DEPTH, IN_DIM, TEXT = 32, 4, 3, 8, 5


def apply_rope(x, rope):
    """x [B, H, L, hd] rotated by rope [L, hd/2, 2] (cos, sin), like Wan."""
    cos, sin = rope.unbind(-1)
    pairs = x.unflatten(-1, (-1, 2))
    a, b = pairs.unbind(-1)
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    calls = 0   # self-attention calls, to see checkpointing recompute

    def __init__(self, kind):
        super().__init__()
        self.kind, self.head_dim = kind, DIM // HEADS
        self.q, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(3))
        # No key bias in cross-attention: its exact gradient is 0 (softmax ignores a shift
        # shared by all keys), and comparing rounding noise relatively says nothing.
        self.k = nn.Linear(DIM, DIM, bias=kind == "self")
        self.backend = SDPA

    def forward(self, x, context=None, rope=None):
        source = x if context is None else context
        q, k, v = (split_heads(p(s), self.head_dim) for p, s in ((self.q, x), (self.k, source), (self.v, source)))
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.kind == "self":
            Attention.calls += 1
        return self.o(merge_heads(self.backend(q, k, v, kind=self.kind)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM, elementwise_affine=False)
        self.self_attn = Attention("self")
        self.norm3 = nn.LayerNorm(DIM)
        self.cross_attn = Attention("cross")
        self.norm2 = nn.LayerNorm(DIM, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(approximate="tanh"), nn.Linear(2 * DIM, DIM))
        self.modulation = nn.Parameter(torch.randn(1, 6, DIM) / DIM ** 0.5)

    def forward(self, x, e0, context, rope):
        if e0.dim() == 4:   # per token [B, L, 6, D]
            e = (self.modulation.unsqueeze(1) + e0).unbind(2)
        else:               # shared [B, 6, D]
            e = [p.unsqueeze(1) for p in (self.modulation + e0).unbind(1)]
        x = x + self.self_attn(self.norm1(x) * (1 + e[1]) + e[0], rope=rope) * e[2]
        x = x + self.cross_attn(self.norm3(x), context=context)
        return x + self.ffn(self.norm2(x) * (1 + e[4]) + e[3]) * e[5]


class Model(nn.Module):
    def __init__(self, rope_kwarg=False):
        super().__init__()
        self.rope_kwarg = rope_kwarg
        self.embed, self.text = nn.Linear(IN_DIM, DIM), nn.Linear(IN_DIM, DIM)
        self.time = nn.Sequential(nn.SiLU(), nn.Linear(DIM, 6 * DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.head = nn.Linear(DIM, IN_DIM)

    def forward(self, x, t, context, rope):
        x, context = self.embed(x), self.text(context)
        e0 = self.time(t).unflatten(-1, (6, DIM))
        for block in self.blocks:
            x = block(x, e0, context, rope=rope) if self.rope_kwarg else block(x, e0, context, rope)
        return self.head(x)


def batch(length, per_token, generator):
    x = torch.randn(2, length, IN_DIM, generator=generator)
    t = torch.randn(*((2, length) if per_token else (2,)), DIM, generator=generator)
    context = torch.randn(2, TEXT, IN_DIM, generator=generator)
    angles = torch.rand(length, DIM // HEADS // 2, generator=generator) * 6.28
    weights = torch.randn(2, length, IN_DIM, generator=generator)
    return (x, t, context, torch.stack((angles.cos(), angles.sin()), dim=-1)), weights


def step(model, inputs, weights):
    out = model(*inputs)
    (out * weights).sum().backward()
    return out.detach()


def relative(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def run(layout, world):
    sp, ring = layout["sp"], layout["ring"]
    if layout.get("group", "world") == "world":
        assert sp == world
        group = dist.group.WORLD
    else:   # dp x sp mesh: the sp axis is handed over as a 1-D DeviceMesh
        group = init_device_mesh("cpu", (world // sp, sp), mesh_dim_names=("dp", "sp"))["sp"]
    torch.manual_seed(0)
    reference = Model(layout.get("rope_kwarg", False)).to(getattr(torch, layout.get("dtype", "float32")))
    model = copy.deepcopy(reference)
    rope_arg = "rope" if layout.get("rope_kwarg") else 3
    apply_full_attention_sp(model.blocks, group, ring_degree=ring, sequence_args={0: 1, 1: (1, 4), rope_arg: 0})
    if layout.get("checkpoint"):
        for block in model.blocks:
            checkpoint_module(block, layout["checkpoint"])
    generator = torch.Generator().manual_seed(1)
    out_diff, calls = 0.0, 0
    for length in layout["lengths"]:   # gradients add up over the lengths
        inputs, weights = batch(length, layout.get("per_token", False), generator)
        inputs, weights = [t.to(reference.head.weight.dtype) for t in inputs], weights.to(reference.head.weight.dtype)
        want = step(reference, inputs, weights)
        Attention.calls = 0
        got = step(model, inputs, weights)
        calls += Attention.calls
        out_diff = max(out_diff, relative(got, want))
    grads = []
    for p, q in zip(model.parameters(), reference.parameters()):
        dist.all_reduce(p.grad)
        grads.append((p.grad / world, q.grad))
    grad_diff = max(relative(got, want) for got, want in grads)
    return {"out": out_diff, "grad": grad_diff, "self_attention_calls": calls}


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    results = {}
    for layout in spec["layouts"]:
        results[layout["name"]] = run(layout, world)
        gc.collect()   # free the layout's groups while Python is whole (see worker.py)
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
