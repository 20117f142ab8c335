"""Parallel layouts on one world: per-rank memory and communication of a training step.

    python benchmarks/parallel.py [--world 4] [--preset S] [--layouts fsdp tp2_dp2 ...] [--device cpu]

Each layout runs the real Trainer (toy data, one bucket: ``--frames`` frames of 32x32
pixel latents, batch 2 per data-parallel rank, fp32) in ``--world`` processes (gloo on CPU, NCCL on GPU). After a
warm-up step, one measured step reports per rank (the largest rank is shown):

- parameter and gradient bytes this rank holds (local shards, local pipeline stages);
- activation bytes saved for backward over the step (``saved_tensors_hooks``, counted
  once per storage, weights excluded). Summed over a pipeline step's micro-batches; a
  1F1B stage holds at most ``pp - stage`` of them at once;
- bytes this rank hands to collectives in the step: the input of every all-reduce,
  all-gather, reduce-scatter and all-to-all, and every tensor sent point-to-point,
  counted by wrapping ``torch.distributed`` and its functional collectives (FSDP2,
  DTensor TP, sequence parallelism and pipelining all go through them);
- step time (wall clock; on a 2-core CPU with 4 processes it is for orientation only).

Ratios are against the first layout in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from sequence_parallel import free_port   # benchmarks/ is on the path when a script runs from it

LAYOUTS = {
    "fsdp": [],
    "ddp": ["parallel.dp_replicate=4", "parallel.dp_shard=1"],   # for --world 4
    "tp2_dp2": ["parallel.tp=2"],
    "sp2_dp2": ["parallel.sp=2"],
    "pp2_dp2": ["parallel.pp=2"],
    "pp2_tp2": ["parallel.pp=2", "parallel.tp=2"],
    "pp4_gpipe": ["parallel.pp=4", "parallel.pp_schedule=gpipe", "parallel.pp_microbatches=2"],
}


def _bytes(tensor) -> int:
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0


class CollectiveBytes:
    """Wraps the collectives and adds up the bytes this rank hands to them."""

    # name -> position of the input; FSDP2 uses the *_single names from torch 2.13, the
    # *_tensor ones before.
    DIST = {"all_reduce": 0, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, "all_gather_single": 1,
            "reduce_scatter_single": 1, "all_to_all_single": 1, "all_gather": 1, "broadcast": 0, "send": 0}
    INPUT_NAMES = ("input", "input_tensor", "tensor")
    FUNCTIONAL = ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single",
                  "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced")

    def __init__(self):
        self.total = 0
        self.counting = False

    def _count(self, value):
        if self.counting:
            self.total += sum(_bytes(t) for t in (value if isinstance(value, (list, tuple)) else [value]))

    def install(self):
        for name, position in self.DIST.items():
            if not hasattr(dist, name):
                continue
            original = getattr(dist, name)

            def wrapped(*args, _original=original, _position=position, **kwargs):
                named = [kwargs[key] for key in self.INPUT_NAMES if key in kwargs]
                self._count(args[_position] if len(args) > _position else named[0])
                return _original(*args, **kwargs)
            setattr(dist, name, wrapped)
        for name in ("get_fwd_send_ops", "get_bwd_send_ops"):   # pipelining's point-to-point sends
            original = getattr(PipelineStage, name)

            def wrapped(stage, *args, _original=original, **kwargs):
                ops = _original(stage, *args, **kwargs)
                self._count([op.tensor for op in ops])
                return ops
            setattr(PipelineStage, name, wrapped)
        for name in self.FUNCTIONAL:
            if hasattr(funcol, name):
                original = getattr(funcol, name)

                def wrapped(value, *args, _original=original, **kwargs):
                    self._count(value)
                    return _original(value, *args, **kwargs)
                setattr(funcol, name, wrapped)


def saved_bytes(run):
    seen: dict[int, int] = {}

    def pack(tensor):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if isinstance(tensor, nn.Parameter) or local.device.type == "meta":
            return tensor
        try:
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:   # a wrapper without storage (an async collective's result)
            seen[id(local)] = local.numel() * local.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def worker(rank: int, world: int, port: int, args, layout: list[str], result_file: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    counter = CollectiveBytes()
    counter.install()
    from videodit.config import load_config
    from videodit.train.trainer import Trainer

    toy = Path(args.toy)
    cfg = load_config("tiny", [
        f"data.csv={toy / 'train.csv'}", f"data.num_frames={args.frames}", "data.height=32", "data.width=32",
        "data.frame_interval=1", f"model.preset={args.preset}", "train.batch_size=2", "train.ema_decay=0",
        "validation.csv=null", "data.make_toy_if_missing=false",
        f"train.device={args.device}", "train.precision=fp32", *layout])
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank) if backend == "nccl" else None)
    trainer = Trainer(cfg, Path(tempfile.mkdtemp()))
    grads = []
    trainer.optimizer.register_step_pre_hook(
        lambda *_: grads.append(sum(_bytes(p.grad) for p in trainer.model.parameters() if p.grad is not None)))
    if isinstance(trainer.parallel.module, DistributedDataParallel):
        # Its reducer calls C++ directly; the same all-reduce through Python is counted.
        trainer.parallel.module.register_comm_hook(None, allreduce_hook)
    batches = trainer.batches()
    trainer.train_step([next(batches)])   # warm-up: schedules, buffers, allocator
    batch = next(batches)
    dist.barrier()
    counter.counting = True
    start = time.perf_counter()
    activations = saved_bytes(lambda: trainer.train_step([batch]))
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    counter.counting = False
    row = {"params": sum(_bytes(p) for p in trainer.model.parameters()), "grads": grads[-1],
           "activations": activations, "sent": counter.total, "seconds": seconds}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(result_file).write_text(json.dumps({"describe": trainer.ctx.dims.describe(), "rows": rows}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--preset", default="S")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--frames", type=int, default=4, help="frames per clip (32x32 pixels, pixel latents)")
    args = parser.parse_args()
    from videodit.toy.make import make_toy_dataset

    with tempfile.TemporaryDirectory() as tmp:
        args.toy = str(Path(tmp) / "toy")
        make_toy_dataset(Path(args.toy), clips_per_combination=1, num_frames=8, height=32, width=32, seed=0)
        results = {}
        for name in args.layouts:
            result_file = str(Path(tmp) / f"{name}.json")
            mp.spawn(worker, args=(args.world, free_port(), args, LAYOUTS[name], result_file), nprocs=args.world)
            results[name] = json.loads(Path(result_file).read_text())
    mib = 2**20
    base = None
    print(f"preset {args.preset}, world {args.world}, {args.device}, fp32, batch 2 per data-parallel rank, "
          f"{args.frames}x32x32 clips; per rank, largest rank shown")
    print("| layout | mesh | params MiB | grads MiB | saved activations MiB | sent MiB/step | step s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, result in results.items():
        worst = {key: max(row[key] for row in result["rows"]) for key in result["rows"][0]}
        base = base or worst
        ratio = {key: worst[key] / base[key] if base[key] else float("nan") for key in worst}
        print(f"| {name} | {result['describe']} | {worst['params'] / mib:.1f} ({ratio['params']:.2f}x) | "
              f"{worst['grads'] / mib:.1f} | {worst['activations'] / mib:.1f} ({ratio['activations']:.2f}x) | "
              f"{worst['sent'] / mib:.1f} ({ratio['sent']:.2f}x) | {worst['seconds']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
