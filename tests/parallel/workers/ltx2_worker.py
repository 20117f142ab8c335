"""Run under torchrun by tests/parallel/test_ltx2_parallel.py: the LTX-2 family's parallel layouts
against one process, on every rank, on the same batch.

Usage: torchrun --nproc-per-node N ltx2_worker.py SPEC.json
SPEC: {"out": file, "layouts": [...]}, each layout
{"name", "parallel": {ParallelConfig fields}, "memory": {MemoryConfig fields}, "version": "2.0" or
"2.3", "audio": bool, "lora": bool, "dtype": "float32" or "float64", "compile": bool (aot_eager,
dynamic shapes; then a second grid, whose recompiles are reported)}: a tiny LTX-2 (4 heads: 1 or 2 per rank) through
``parallelize`` and one forward and backward against the unsharded copy, on the trainer's path
(``spec.model_inputs``: a frame mask, so a time per token, the first sample's first frame given)
through ``ParallelModel.forward_backward``; with audio, the inputs carry the audio stream's too and
the loss of both outputs (:class:`BothStreams`) takes its audio target as the trainer's does
(``train/audio_stream.py``: waiting beside the loss, or cut per micro-batch by a pipeline). Rank 0
writes, per layout, the largest relative difference (to the largest magnitude) of the loss and of
any gradient, the parameter that has it and how many gradients were compared.
"""

import copy
import dataclasses
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from videodit.config import LoraConfig, MemoryConfig, ModelConfig, ParallelConfig
from videodit.models.families import spec_of
from videodit.models.ltx2.geometry import LTX2_0, LTX2_3
from videodit.models.ltx2.model import LTX2Model
from videodit.models.spec import Conditions
from videodit.parallel.compile import CompileOptions
from videodit.parallel.dims import ParallelDims
from videodit.parallel.distributed import DistContext
from videodit.parallel.gradients import sum_partial_gradients
from videodit.parallel.lora import apply_lora
from videodit.parallel.parallelize import parallelize

HEADS, HEAD_DIM, AUDIO_HEAD_DIM = 4, 8, 4
GRID, TEXT, AUDIO_TOKENS = (3, 3, 3), 5, 7    # 27 video tokens: a padded slice at sp=2


def relative(got, want):
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def tiny_model(version: str, lora: bool):
    base = LTX2_0 if version == "2.0" else LTX2_3
    geometry = dataclasses.replace(base, num_layers=2, num_heads=HEADS, head_dim=HEAD_DIM,
                                   audio_head_dim=AUDIO_HEAD_DIM, in_channels=8, audio_in_channels=6,
                                   caption_channels=None if base.caption_channels is None else 24)
    torch.manual_seed(0)
    model = LTX2Model(geometry)
    with torch.no_grad():   # nothing zero: zero-initialised layers hide mistakes
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    if lora:
        targets = [f"transformer_blocks.{i}.{name}" for i in range(2)
                   for name in ("attn1.to_q", "attn1.to_out.0", "attn2.to_k", "attn2.to_v", "ff.net.2")]
        apply_lora(model, LoraConfig(rank=2, targets=targets))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn_like(param) * 0.2)
    return model


def batch(model, grid=GRID):
    """Model inputs as the trainer builds them (the first sample's first frame given), the target
    and the audio stream's inputs."""
    g = model.geometry
    gen = torch.Generator().manual_seed(1)
    x_t = torch.randn(2, g.in_channels, *grid, generator=gen)
    t = torch.rand(2, generator=gen)
    y = torch.randn(2, TEXT, g.caption_channels or g.dim, generator=gen)
    x_mask = torch.ones(2, grid[0], dtype=torch.bool)
    x_mask[0, 0] = False
    cond = Conditions(y=y, y_mask=torch.ones(2, TEXT, dtype=torch.bool), fps=torch.tensor([24.0, 12.0]),
                      x_mask=x_mask)
    inputs = spec_of(model).model_inputs(x_t, t, cond)
    target = torch.randn(x_t.shape, generator=gen)
    audio = dict(audio=torch.randn(2, AUDIO_TOKENS, g.audio_in_channels, generator=gen),
                 audio_t=torch.rand(2, generator=gen),
                 audio_context=torch.randn(2, TEXT, g.caption_channels or g.audio_dim, generator=gen))
    audio_target = torch.randn(2, AUDIO_TOKENS, g.audio_in_channels, generator=gen)
    return inputs, target, audio, audio_target


def _cast(x, dtype):
    return x.to(dtype) if x.is_floating_point() else x


def mse(out, x_t, t, target, *rest):
    return ((out - target) ** 2).mean()


def both_streams(module, inputs, target, audio, audio_target):
    video, sound = module(*inputs, **audio)
    return mse(video, None, None, target) + mse(sound, None, None, audio_target)


class BothStreams:
    """The loss of both outputs with the trainer's protocol (``AudioStream.loss_fn``): the audio
    target waits in ``pending`` for the loss, or a pipeline takes it (``extra_targets``) and its last
    stage passes each micro-batch's slice back as a keyword."""

    def __init__(self):
        self.pending = None

    def extra_targets(self) -> dict:
        taken, self.pending = self.pending, None
        return {"audio_target": taken}

    def __call__(self, output, x_t, t, target, x_mask=None, audio_target=None):
        if audio_target is None:
            audio_target = self.extra_targets()["audio_target"]
        video, sound = output
        return mse(video, None, None, target) + mse(sound, None, None, audio_target)


def with_audio_inputs(inputs, audio):
    """The model inputs with the audio stream's, as ``model_inputs`` gives them (no text mask)."""
    return (*inputs, None, audio["audio"], audio["audio_t"], audio["audio_context"])


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


def model_layout(layout, world):
    dtype = getattr(torch, layout.get("dtype", "float32"))
    model = tiny_model(layout.get("version", "2.3"), layout.get("lora", False)).to(dtype)
    reference = copy.deepcopy(model)
    inputs, target, audio, audio_target = batch(model)
    inputs, target, audio_target = tuple(_cast(x, dtype) for x in inputs), target.to(dtype), audio_target.to(dtype)
    audio = {name: value.to(dtype) for name, value in audio.items()}
    with_audio = layout.get("audio", False)
    # Under PP the reference runs the pipeline's micro-batches one by one too (the same sums in the
    # same order: what is compared is the pipeline, not fp32's reduction order over a batch).
    pieces = 2 if layout["parallel"].get("pp", 1) > 1 else 1
    want = 0.0
    for i in range(pieces):
        part = slice(i * 2 // pieces, (i + 1) * 2 // pieces)
        if with_audio:
            piece = both_streams(reference, tuple(x[part] for x in inputs), target[part],
                                 {name: value[part] for name, value in audio.items()}, audio_target[part])
        else:
            piece = mse(reference(*(x[part] for x in inputs)), None, None, target[part])
        (piece / pieces).backward()
        want = want + piece.detach() / pieces
    want_grads = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}

    cfg = ParallelConfig(**layout["parallel"])
    memory = MemoryConfig(**layout.get("memory", {}))
    dims = ParallelDims.from_config(cfg, world)
    spec = spec_of(model)
    g = model.geometry
    blocks = spec.blocks_of(ModelConfig(preset="ltx2-tiny", depth=g.num_layers, hidden_size=g.dim,
                                        num_heads=g.num_heads))
    dims.check_model(num_heads=HEADS, hidden_size=g.dim, depth=g.num_layers, spec=spec, sp_ring=cfg.sp_ring,
                     blocks=blocks)
    per_rank, microbatches = dims.check_pipeline(cfg, blocks=blocks)
    ctx = DistContext(dims, dist.get_rank(), dist.get_rank(), torch.device("cpu"), dims.build_meshes("cpu"),
                      per_rank, microbatches)
    compile = CompileOptions("aot_eager", "dynamic") if layout.get("compile") else None
    loss_fn = BothStreams() if with_audio else mse
    parallel = parallelize(model, ctx, cfg, memory=memory, loss_fn=loss_fn, compile=compile)
    if with_audio:
        inputs, loss_fn.pending = with_audio_inputs(inputs, audio), audio_target
    loss = parallel.global_loss(parallel.forward_backward(inputs, target, scale=1.0, sync=True))
    if parallel.partial_gradients:
        sum_partial_gradients(parallel.local_model, parallel.partial_gradients, ctx.group("tp"))
    got = full_gradients(parallel.local_model)
    assert got.keys() == want_grads.keys(), sorted(set(got) ^ set(want_grads))
    grad_diff, worst = max((relative(got[name], want_grads[name]), name) for name in want_grads)
    result = {"out": relative(torch.tensor(loss), want.detach()), "grad": grad_diff, "worst": worst,
              "gradients": len(want_grads)}
    if compile is not None:   # another bucket's grid: the dynamic graphs serve it without recompiling
        other, other_target, _, _ = batch(model, grid=(2, 4, 3))
        parallel.forward_backward(other, other_target, scale=1.0, sync=True)
        result["recompiles"] = parallel.compile_metrics()["recompiles"]
    del parallel
    return result


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    results = {}
    for layout in spec["layouts"]:
        results[layout["name"]] = model_layout(layout, world)
        gc.collect()   # free the layout's groups while Python is whole (see worker.py)
        dist.barrier()
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
