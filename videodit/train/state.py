"""What a training checkpoint holds, registered once: the model, its EMA, the optimizer, the
LR schedule, the data position and every random generator.

``TrainState.save`` turns them into the files ``checkpoint/`` writes and
``TrainState.load`` puts a checkpoint written by any layout back into this one:

- ``model``/``ema``: whole tensors (``*.safetensors``), gathered from every shard and
  pipeline stage, so sampling and export read them on one process;
- ``optimizer``: name-keyed (``optimizer.pt``) when nothing is sharded. Sharded runs keep it
  in the DCP shards only (``dcp/``, with model and EMA), since gathering it would not fit;
- ``state.json``: step, epoch, data position, LR schedule, Python and NumPy RNG;
  ``rng.safetensors``: torch's CPU (and CUDA) generator.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from videodit.checkpoint import CheckpointManager, LoadedCheckpoint
from videodit.data.sampler import BucketBatchSampler
from videodit.parallel.parallelize import ParallelModel
from videodit.parallel.state import (full_tensors, gather_stages, load_model_state, load_optimizer_state,
                                     load_shards, optimizer_state, save_shards)
from videodit.train.ema import EMA


@dataclass
class Progress:
    step: int = 0      # optimizer steps done
    epoch: int = 0
    offset: int = 0    # global batches of this epoch consumed (see data/sampler.py)


class TrainState:
    def __init__(self, parallel: ParallelModel, optimizer: torch.optim.Optimizer, scheduler, ema: EMA | None,
                 sampler: BucketBatchSampler):
        self.parallel = parallel
        self.ctx = parallel.ctx
        self.model = parallel.local_model
        self.optimizer, self.scheduler, self.ema, self.sampler = optimizer, scheduler, ema, sampler
        self.progress = Progress()

    def gather(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole model's tensors on rank 0 from every rank's shards and stages (a collective)."""
        return gather_stages(full_tensors(tensors), self.ctx)

    def eval_weights(self) -> dict[str, torch.Tensor]:
        """The weights to sample and validate with: the EMA's if there is one, gathered whole
        on rank 0 (a collective)."""
        return self.gather(self.ema.state_dict() if self.ema is not None else self.model.state_dict())

    def save(self, manager: CheckpointManager, *, config_yaml: str, metrics: dict | None,
             blocking: bool) -> Path | None:
        """Save on every rank (gathering and DCP shards are collectives); rank 0 writes the
        files and returns the checkpoint's path."""
        tensors = {"model": self.gather(self.model.state_dict())}
        if self.ema is not None:
            tensors["ema"] = self.gather(self.ema.state_dict())
        ema_shards = self.ema.state_dict() if self.ema is not None else None
        sharded = self.parallel.sharded

        def write_shards(staging: Path | None) -> None:
            save_shards(self.ctx.broadcast(staging), self.model, self.optimizer, ema_shards)

        if not self.ctx.is_main:
            if sharded:
                write_shards(None)
            self.ctx.barrier()
            return None
        tensors["rng"] = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            tensors["rng"]["torch_cuda"] = torch.cuda.get_rng_state()
        progress = self.progress
        np_state = np.random.get_state()
        json_state = {
            "step": progress.step, "epoch": progress.epoch,
            "data": self.sampler.state_dict(progress.epoch, progress.offset),
            "scheduler": self.scheduler.state_dict(),
            "python_rng": _jsonable(random.getstate()),
            "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        }
        torch_states = {} if sharded else {"optimizer": optimizer_state(self.model, self.optimizer)}
        path = manager.save(progress.step, tensors=tensors, torch_states=torch_states, json_state=json_state,
                            config_yaml=config_yaml, metrics=metrics, blocking=blocking,
                            write_shards=write_shards if sharded else None)
        self.ctx.barrier()
        return path

    def load(self, ckpt: LoadedCheckpoint, on_data_change: str) -> None:
        """Load a checkpoint written by any layout (DCP shards or whole tensors) into this one."""
        ema = self.ema.state_dict() if self.ema is not None and ckpt.has("ema") else None
        if ckpt.has_shards:
            load_shards(ckpt.path, self.model, self.optimizer, ema)
        else:
            load_model_state(self.model, ckpt.tensors("model"))
            if ema is not None:
                self.ema.load_state_dict(ckpt.tensors("ema"))
            load_optimizer_state(self.model, self.optimizer, ckpt.torch_state("optimizer"))
        state = ckpt.json_state()
        self.scheduler.load_state_dict(state["scheduler"])
        epoch, offset = self.sampler.load_state_dict(state["data"], on_data_change)
        self.progress = Progress(state["step"], epoch, offset)
        rng = ckpt.tensors("rng")
        torch.set_rng_state(rng["torch_cpu"])
        if "torch_cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["torch_cuda"])
        random.setstate(_tuplify(state["python_rng"]))
        kind, keys, *rest = state["numpy_rng"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def _tuplify(value):
    return tuple(_tuplify(v) for v in value) if isinstance(value, list) else value
