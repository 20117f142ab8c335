"""Run under torchrun by tests/parallel/test_distributed.py: train a few steps per layout, save results.

Usage: torchrun --nproc-per-node N tests/parallel/workers/worker.py SPEC.json
SPEC: {"out": dir, "runs": [{"name": ..., "overrides": [...], "steps": k}]}. For every run,
rank 0 writes OUT/NAME.pt with the whole final weights, the losses and, per rank, the
sample keys of every batch it trained on.
"""

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from videodit.config import load_config
from videodit.train.trainer import Trainer


def train(name: str, overrides: list[str], steps: int, out: Path) -> None:
    cfg = load_config("tiny", overrides)
    trainer = Trainer(cfg, out / name)
    batches = trainer.batches()
    losses, keys = [], []
    for _ in range(steps):
        micro = [next(batches) for _ in range(cfg.train.grad_accum)]
        keys.append([batch.noise_seed for batch in micro] + [str(batch.video.shape) for batch in micro])
        losses.append(trainer.train_step(micro)[0])
    weights = trainer.state.gather(trainer.model.state_dict())   # every shard and pipeline stage
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, keys)
    stats = trainer.parallel.compile_stats   # under train.compile: rank 0's graphs, (kind, input shape) each
    if dist.get_rank() == 0:
        torch.save({"weights": {k: v.cpu() for k, v in weights.items()}, "losses": losses, "keys": gathered,
                    "graphs": None if stats is None else stats.graphs}, out / f"{name}.pt")


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for run in spec["runs"]:
        train(run["name"], run["overrides"], run["steps"], Path(spec["out"]))
        # A run's model, optimizer and meshes form reference cycles that hold its gloo groups and their
        # worker threads. Freed at interpreter exit, a worker that drops a tensor then needs the GIL
        # Python is tearing down, and the rank aborts ("terminate called without an active
        # exception", seen in CI); freed here, while Python is whole, the threads are joined cleanly.
        gc.collect()
    dist.barrier()   # nobody closes its sockets while a peer still talks
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
