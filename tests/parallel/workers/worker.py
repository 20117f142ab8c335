"""Run under torchrun by tests/parallel/test_distributed.py: train a few steps per layout, save results.

Usage: torchrun --nproc-per-node N tests/parallel/workers/worker.py SPEC.json
SPEC: {"out": dir, "runs": [{"name": ..., "overrides": [...], "steps": k}]}. For every run,
rank 0 writes OUT/NAME.pt with the whole final weights, the losses, per rank the sample keys of
every batch it trained on, and the FSDP2 schedule each FSDP unit ran with (``fsdp_schedule``). A
run with ``"fsdp": "torch_defaults"`` undoes videodit's schedule (``apply_fsdp``) before training:
torch's implicit prefetching and a root resharded after forward, as before issue #40.
"""

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from torch.distributed.fsdp import FSDPModule

from videodit.config import load_config
from videodit.train.trainer import Trainer


def fsdp_units(model: torch.nn.Module) -> dict[str, FSDPModule]:
    return {name or "<root>": m for name, m in model.named_modules() if isinstance(m, FSDPModule)}


def fsdp_schedule(model: torch.nn.Module) -> dict[str, dict]:
    """Per FSDP unit (by module name): whether it reshards after forward (None: it holds no
    parameters of its own) and the units its forward and backward prefetch, read from FSDP2's state."""
    names = {id(m): name for name, m in fsdp_units(model).items()}
    schedule = {}
    for name, unit in fsdp_units(model).items():
        state = unit._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None) or [g for g in [state._fsdp_param_group] if g]
        schedule[name] = {
            "reshard": None if not groups else any(g.post_forward_mesh_info is not None for g in groups),
            "forward": [names[id(s._modules[0])] for s in state._states_to_forward_prefetch],
            "backward": [names[id(s._modules[0])] for s in state._states_to_backward_prefetch]}
    return schedule


def undo_schedule(model: torch.nn.Module) -> None:
    """torch's defaults over videodit's schedule: no explicit prefetching, the root resharded."""
    for unit in fsdp_units(model).values():
        unit.set_modules_to_forward_prefetch([])
        unit.set_modules_to_backward_prefetch([])
    model.set_reshard_after_forward(True, recurse=False)


def train(name: str, overrides: list[str], steps: int, out: Path, fsdp: str = "videodit") -> None:
    cfg = load_config("tiny", overrides)
    trainer = Trainer(cfg, out / name)
    if fsdp == "torch_defaults":
        undo_schedule(trainer.parallel.local_model)
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
                    "graphs": None if stats is None else stats.graphs,
                    "fsdp_schedule": fsdp_schedule(trainer.parallel.local_model)}, out / f"{name}.pt")


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for run in spec["runs"]:
        train(run["name"], run["overrides"], run["steps"], Path(spec["out"]), run.get("fsdp", "videodit"))
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
