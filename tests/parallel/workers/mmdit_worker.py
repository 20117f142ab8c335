"""Run under torchrun by tests/parallel/test_mmdit_parallel.py: the MMDiT family's parallel layouts
against one process, on every rank, on the same batch.

Usage: torchrun --nproc-per-node N mmdit_worker.py SPEC.json
SPEC: {"out": file, "layouts": [...]}, each layout one of
- {"name", "kind": "attention", "sp", "ring", "image": Li, "text": Lt, "mask": bool, "dtype"}: the joint
  backend alone (``parallel/joint_attention.py``) on random q/k/v against SDPA over [text; image];
- {"name", "kind": "model", "parallel": {ParallelConfig fields}, "memory": {MemoryConfig fields},
  "blocks": [double, single], "mask": bool, "lora": bool}: a tiny MMDiT through ``parallelize`` and
  one ``forward_backward`` against the unsharded copy;
- {"name", "kind": "checkpoint", "folder"}: TP over the world, DCP shards written and read back.
Rank 0 writes, per layout, the largest relative difference (to the largest magnitude) of the
output or loss and of any gradient, and what the layout did (offloaded inputs, block kinds).
"""

import copy
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from videodit.config import LoraConfig, MemoryConfig, ModelConfig, ParallelConfig
from videodit.models.families import spec_of
from videodit.models.layers import SDPA
from videodit.models.mmdit.model import MMDiT, MMDiTGeometry
from videodit.models.spec import Conditions
from videodit.parallel.activation_checkpoint import block_kinds, chosen_blocks
from videodit.parallel.checkpoint_offload import apply_checkpoint_input_offload, input_offload_stats
from videodit.parallel.dims import ParallelDims
from videodit.parallel.distributed import DistContext
from videodit.parallel.gradients import sum_partial_gradients
from videodit.parallel.joint_attention import JointAttentionSP
from videodit.parallel.lora import apply_lora
from videodit.parallel.parallelize import parallelize
from videodit.parallel.tensor import apply_tensor_parallel, dcp_state, restore_from_dcp

HEADS, HEAD_DIM = 4, 8


def relative(got, want):
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------- the joint backend alone

def attention_layout(layout, world):
    """q/k/v [B, H, Lt + Li, Dh] alike on every rank; each rank feeds [text; its image slice] and
    back-propagates its image slice's share of sum(out * w) plus 1/sp of the text's, so the
    gradients summed over the ranks are those of one process."""
    dtype = getattr(torch, layout.get("dtype", "float32"))
    sp, ring, text, image = layout["sp"], layout["ring"], layout["text"], layout["image"]
    group = dist.group.WORLD if sp == world else dist.new_group(list(range(sp)))
    if dist.get_rank() >= sp:
        return None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, HEADS, text + image, HEAD_DIM, generator=g, dtype=dtype) for _ in range(3))
    weights = torch.randn(q.shape, generator=g, dtype=dtype)
    mask = None
    if layout["mask"]:
        mask = torch.rand(2, text, generator=g) > 0.4
        mask[0, :] = False   # a sample whose every caption token is masked: image keys only
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = SDPA.joint(*leaves, text_tokens=text, text_mask=mask)
    (want * weights).sum().backward()

    plan = JointAttentionSP(group, ring_degree=ring)
    plan.length = image
    local = [plan._slice(t[:, :, text:], 2) for t in (q, k, v)]
    plan._slices = {}
    mine = [torch.cat([t[:, :, :text], piece], dim=2).requires_grad_() for t, piece in zip((q, k, v), local)]
    out = plan.joint(*mine, text, mask)
    piece = local[0].shape[2]
    start = dist.get_rank(group) * piece
    real = max(0, min(piece, image - start))   # this rank's real (unpadded) image tokens
    image_weights = weights[:, :, text + start:text + start + real]
    loss = (out[:, :, text:text + real] * image_weights).sum() + (out[:, :, :text] * weights[:, :, :text]).sum() / sp
    loss.backward()

    want_here = torch.cat([want[:, :, :text], want[:, :, text + start:text + start + real]], dim=2)
    out_diff = relative(out[:, :, :text + real].detach(), want_here.detach())
    grad_diff = 0.0
    for got, leaf in zip(mine, leaves):
        text_grad = got.grad[:, :, :text].contiguous()
        dist.all_reduce(text_grad, group=group)
        grad_diff = max(grad_diff, relative(text_grad, leaf.grad[:, :, :text]),
                        relative(got.grad[:, :, text:text + real], leaf.grad[:, :, text + start:text + start + real])
                        if real else 0.0)
    diffs = torch.tensor([out_diff, grad_diff], dtype=torch.float64)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX, group=group)
    return {"out": diffs[0].item(), "grad": diffs[1].item()}


# ---------------------------------------------------------------------------- the model

def tiny_model(double: int, single: int, lora: bool):
    geometry = MMDiTGeometry(hidden_size=HEADS * HEAD_DIM, num_heads=HEADS, depth=double, depth_single_blocks=single,
                             latent_channels=4, vec_in_dim=8, context_in_dim=16, axes_dim=(2, 2, 4))
    torch.manual_seed(0)
    model = MMDiT(geometry)
    with torch.no_grad():   # nothing zero: zero-initialised layers hide mistakes
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    if lora:
        targets = [f"double_blocks.{i}.{name}" for i in range(double)
                   for name in ("img_attn.q_proj", "txt_attn.v_proj", "img_attn.proj", "txt_mlp.0", "img_mlp.2")]
        targets += [f"single_blocks.{i}.{name}" for i in range(single) for name in ("k_proj", "v_mlp", "linear2")]
        apply_lora(model, LoraConfig(rank=2, targets=targets))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn_like(param) * 0.2)
    return model


def batch(geometry, mask: bool, grid=(5, 4, 2), text: int = 5):
    """Latents of ``grid`` (patched 2x2: the default's 10 image tokens pad for sp 3 and 4) and
    ``text`` caption tokens, the second sample's last ones masked."""
    g = torch.Generator().manual_seed(1)
    x_t = torch.randn(2, geometry.latent_channels, *grid, generator=g)
    t = torch.rand(2, generator=g)
    y = torch.randn(2, text, geometry.context_in_dim, generator=g)
    y_mask = torch.ones(2, text, dtype=torch.bool)
    y_mask[1, text // 2:] = False
    cond = torch.randn(2, geometry.latent_channels + 1, *x_t.shape[2:], generator=g)
    conditions = Conditions(y=y, y_mask=y_mask if mask else None, pooled=torch.randn(2, geometry.vec_in_dim,
                                                                                    generator=g), given=cond)
    target = torch.randn(x_t.shape, generator=g)
    return spec_of(geometry).model_inputs(x_t, t, conditions), target


def mse(out, x_t, t, target, *rest):
    return ((out.float() - target) ** 2).mean()


def full_gradients(model) -> dict:
    """Every parameter's whole gradient on every rank (DTensor shards gathered; pipeline stages
    exchanged)."""
    mine = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            mine[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {name: grad for part in every for name, grad in part.items()}


class CountingBackend:
    """A block's attention backend, counting its joint attentions (a checkpointed block runs twice)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def joint(self, *args, **kwargs):
        self.calls += 1
        return self.inner.joint(*args, **kwargs)


def model_layout(layout, world):
    double, single = layout.get("blocks", [2, 2])
    model = tiny_model(double, single, layout.get("lora", False))
    reference = copy.deepcopy(model)
    inputs, target = batch(model.geometry, layout.get("mask", True), layout.get("grid", (5, 4, 2)),
                           layout.get("text", 5))
    want = mse(reference(*inputs), inputs[0], inputs[1], target)
    want.backward()
    want_grads = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}

    cfg = ParallelConfig(**layout["parallel"])
    memory = MemoryConfig(**layout.get("memory", {}))
    dims = ParallelDims.from_config(cfg, world)
    spec = spec_of(model)
    blocks = spec.blocks_of(ModelConfig(depth=double, depth_single=single))   # what init_distributed checks
    assert blocks == len(model.blocks), (blocks, len(model.blocks))
    dims.check_model(num_heads=HEADS, hidden_size=HEADS * HEAD_DIM, depth=double, spec=spec, sp_ring=cfg.sp_ring,
                     blocks=blocks)
    per_rank, microbatches = dims.check_pipeline(cfg, blocks=blocks)
    ctx = DistContext(dims, dist.get_rank(), dist.get_rank(), torch.device("cpu"), dims.build_meshes("cpu"),
                      per_rank, microbatches)
    parallel = parallelize(model, ctx, cfg, memory=memory, loss_fn=mse)
    if layout.get("offload"):   # memory.offload's CPU stand-in (on CPU the lever itself moves nothing)
        apply_checkpoint_input_offload(parallel.local_model, chosen_blocks(parallel.local_model, memory),
                                       stand_in=True, streams=spec_of(model).block_streams)
    for block in parallel.local_model.blocks:
        block.backend = CountingBackend(block.backend)
    loss = parallel.forward_backward(inputs, target, scale=1.0, sync=True)
    loss = parallel.global_loss(loss)   # under pp: the last stage's
    if parallel.partial_gradients:
        sum_partial_gradients(parallel.local_model, parallel.partial_gradients, ctx.group("tp"))
    got = full_gradients(parallel.local_model)
    assert got.keys() == want_grads.keys(), sorted(set(got) ^ set(want_grads))
    grad_diff, worst = max((relative(got[name], want_grads[name]), name) for name in want_grads)
    stats = input_offload_stats(parallel.local_model)
    # Joint attentions per block and micro-batch: a checkpointed block runs its attention again in backward.
    calls = [[kind, block.backend.calls / microbatches]
             for kind, block in zip(block_kinds(parallel.local_model), parallel.local_model.blocks)]
    del parallel
    return {"out": relative(torch.tensor(loss), want.detach()), "grad": grad_diff, "worst": worst,
            "gradients": len(want_grads),
            "offloaded": stats.offloaded, "unprefetched": stats.unprefetched, "calls": calls}


def checkpoint_layout(layout, world):
    """TP=2: DCP shards of the model (through ``parallel/tensor.py``'s ``dcp_state``) read back as one
    process's state dict, and loaded into a TP model whose weights were changed."""
    folder = Path(layout["folder"])
    model = tiny_model(2, 2, False)
    whole = {name: t.clone() for name, t in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (world,))
    apply_tensor_parallel(model, mesh)
    dcp.save(dcp_state(model.state_dict()), checkpoint_id=str(folder / "dcp"))
    dist.barrier()
    read = 0.0
    if dist.get_rank() == 0:
        dcp_to_torch_save(str(folder / "dcp"), str(folder / "whole.pt"))
        saved = torch.load(folder / "whole.pt", weights_only=True)
        assert saved.keys() == whole.keys()
        read = max((saved[name] - whole[name]).abs().max().item() for name in whole)
    with torch.no_grad():
        for param in model.parameters():
            (param.to_local() if isinstance(param, DTensor) else param).mul_(-1)
    live = model.state_dict()
    loaded = dcp_state(live)
    dcp.load(loaded, checkpoint_id=str(folder / "dcp"))
    restore_from_dcp(live, loaded)
    back = max((t.full_tensor() if isinstance(t, DTensor) else t).sub(whole[name]).abs().max().item()
               for name, t in model.state_dict().items())
    strided = sum("_StridedShard" in str(t.placements) for t in live.values() if isinstance(t, DTensor))
    return {"read": read, "reloaded": back, "strided": strided}


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    results = {}
    for layout in spec["layouts"]:
        run = {"attention": attention_layout, "model": model_layout, "checkpoint": checkpoint_layout}[layout["kind"]]
        results[layout["name"]] = run(layout, world)
        gc.collect()   # free the layout's groups while Python is whole (see worker.py)
        dist.barrier()
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
