"""Run under torchrun by tests/train/test_fp8_base.py: fp8-base LoRA runs under FSDP2.

Usage: torchrun --nproc-per-node N tests/train/fp8_base_worker.py SPEC.json
SPEC: {"out": dir, "runs": [{"name": ..., "overrides": [...], "steps": k}]}. For every run, rank 0
writes OUT/NAME.pt with the whole final weights (fp8 bits included), the losses, per rank the bytes
of fp8 storage it holds (its shards) and the placements of that storage, and the dtypes of the
gathered weight and scale each fp8 layer computed with (FSDP2's mixed precision must not cast the bits).
"""

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from videodit.config import load_config
from videodit.parallel.fp8_base import Float8BaseLinear, fp8_storage_bytes
from videodit.train.trainer import Trainer


def placements(model) -> list[str]:
    return sorted({str(getattr(param, "placements", "plain")) for module in model.modules()
                   if isinstance(module, Float8BaseLinear) for param in (module.weight_fp8, module.weight_scale)})


def train(name: str, overrides: list[str], steps: int, out: Path) -> None:
    cfg = load_config("tiny", overrides)
    trainer = Trainer(cfg, out / name)
    gathered = set()
    for module in trainer.model.modules():
        if isinstance(module, Float8BaseLinear):
            module.register_forward_pre_hook(lambda m, args: gathered.add((str(m.weight_fp8.dtype),
                                                                           str(m.weight_scale.dtype))))
    batches = trainer.batches()
    losses = [trainer.train_step([next(batches) for _ in range(cfg.train.grad_accum)])[0] for _ in range(steps)]
    weights = trainer.state.gather(trainer.model.state_dict())
    local = [None] * dist.get_world_size()
    dist.all_gather_object(local, (fp8_storage_bytes(trainer.model), placements(trainer.model)))
    if dist.get_rank() == 0:
        torch.save({"weights": {k: v.cpu() for k, v in weights.items()}, "losses": losses, "ranks": local,
                    "gathered": sorted(gathered)},
                   out / f"{name}.pt")


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for run in spec["runs"]:
        train(run["name"], run["overrides"], run["steps"], Path(spec["out"]))
        gc.collect()   # free each run's gloo groups while Python is whole (see tests/parallel/workers/worker.py)
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
