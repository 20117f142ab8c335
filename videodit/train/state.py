"""What a training checkpoint holds, registered once: the model, its EMA, the optimizer, the
LR schedule, the data position and every random generator.

``TrainState.save`` turns them into the files ``checkpoint/`` writes and
``TrainState.load`` puts a checkpoint written by any layout back into this one:

- ``model``/``ema``: whole tensors (``*.safetensors``), gathered from every shard and
  pipeline stage, so sampling and export read them on one process;
- ``optimizer``: name-keyed (``optimizer.pt``) when nothing is sharded. Sharded runs keep it
  in the DCP shards only (``dcp/``, with model and EMA), since gathering it would not fit;
  8-bit moments (``train.optimizer=adamw8bit``) as their codes and scales (``moments8bit.py``);
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
from videodit.errors import UserError
from videodit.checkpoint.lora import check_base, init_weights
from videodit.models.families import get_spec, released_spec
from videodit.models.lora import ADAPTER
from videodit.parallel.parallelize import ParallelModel
from videodit.parallel.state import (full_tensors, gather_stages, load_model_state, load_optimizer_state,
                                     load_shards, optimizer_state, save_shards, saved_state)
from videodit.train.ema import EMA
from videodit.train.moments8bit import plain_moments, restored_moments
from videodit.train.optimizer import scheduler_state


@dataclass
class Role:
    """A trained network beside the run's model (DMD2's critic): saved as ``{name}.safetensors``,
    ``{name}_optimizer.pt`` and its LR schedule in state.json, restored exactly on resume. On a
    shared base (``train/shared_base.py``) it is one ``adapter`` of the run's own model."""
    parallel: ParallelModel
    optimizer: torch.optim.Optimizer
    scheduler: object
    adapter: str = ADAPTER


@dataclass
class Progress:
    step: int = 0      # optimizer steps done
    epoch: int = 0
    offset: int = 0    # global batches of this epoch consumed (see data/sampler.py)


class TrainState:
    def __init__(self, parallel: ParallelModel, optimizer: torch.optim.Optimizer, scheduler, ema: EMA | None,
                 sampler: BucketBatchSampler, lora_base: dict | None = None):
        self.parallel = parallel
        self.ctx = parallel.ctx
        self.model = parallel.local_model
        self.optimizer, self.scheduler, self.ema, self.sampler = optimizer, scheduler, ema, sampler
        self.progress = Progress()
        self.lora_base = lora_base   # a LoRA run's base (checkpoint/lora.py), recorded in state.json
        self.roles: dict[str, Role] = {}   # the objective's other trained roles (train/dmd2.py), saved whole

    def gather(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole model's tensors on rank 0 from every rank's shards and stages (a collective)."""
        return gather_stages(full_tensors(tensors), self.ctx)

    def eval_weights(self) -> dict[str, torch.Tensor]:
        """The weights to sample and validate with: the EMA's if there is one, gathered whole
        on rank 0 (a collective)."""
        return self.gather(self.ema.state_dict() if self.ema is not None else saved_state(self.model))

    def save(self, manager: CheckpointManager, *, config_yaml: str, metrics: dict | None,
             blocking: bool) -> Path | None:
        """Save on every rank (gathering and DCP shards are collectives); rank 0 writes the
        files and returns the checkpoint's path."""
        tensors = {"model": self.gather(saved_state(self.model))}   # a LoRA run: the adapters
        if self.ema is not None:
            tensors["ema"] = self.gather(self.ema.state_dict())
        role_moments = {}   # gathered whole on every rank alike (collectives) where the roles are sharded
        for name, role in self.roles.items():
            tensors[name] = self.gather(saved_state(role.parallel.local_model, role.adapter))
            role_moments[name] = optimizer_state(role.parallel.local_model, role.optimizer, whole=self.parallel.sharded)
        self._check_finite(tensors)
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
            "scheduler": scheduler_state(self.scheduler),   # numbers, also where the optimizer's LR is a tensor
            "python_rng": _jsonable(random.getstate()),
            "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        }
        if self.lora_base is not None:
            json_state["lora_base"] = self.lora_base
        torch_states = {} if sharded else {"optimizer": plain_moments(optimizer_state(self.model, self.optimizer))}
        for name, role in self.roles.items():
            torch_states[f"{name}_optimizer"] = plain_moments(role_moments[name])
            json_state.setdefault("roles", {})[name] = {"scheduler": scheduler_state(role.scheduler)}
        path = manager.save(progress.step, tensors=tensors, torch_states=torch_states, json_state=json_state,
                            config_yaml=config_yaml, metrics=metrics, blocking=blocking,
                            write_shards=write_shards if sharded else None)
        self.ctx.barrier()
        return path

    def _check_shapes(self, ckpt: LoadedCheckpoint) -> None:
        """The checkpoint's weights must fit this model (a changed model.* under
        checkpoint.on_config_change=continue does not): read from the file's header only."""
        saved = ckpt.tensor_shapes("model")
        for name, tensor in saved_state(self.model).items():   # DTensor shapes are the whole shapes
            if name not in saved:
                raise UserError(f"checkpoint {ckpt.path} has no weight {name}: it was written for another model; "
                                "resume with that run's model.* or start a new run with model.init_from")
            if saved[name] != tuple(tensor.shape):
                raise UserError(f"checkpoint {ckpt.path}: {name} is {saved[name]} there but {tuple(tensor.shape)} "
                                "here: model.* changed since it was saved; resume with that run's model.*, "
                                "or start a new run with model.init_from")

    def _check_finite(self, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
        """Never write a checkpoint with NaN/inf weights (rank 0 holds the whole tensors; it
        decides for every rank, so all stop alike)."""
        def problem() -> None:
            for stem, flat in tensors.items():
                bad = next((name for name, t in flat.items() if t.is_floating_point() and not t.isfinite().all()),
                           None)
                if bad is not None:
                    raise UserError(f"step {self.progress.step}: {stem} weight {bad} holds NaN/inf; not saving it "
                                    "(the previous checkpoint is intact); lower train.lr or check the data")
        self.ctx.on_main(problem)

    def load(self, ckpt: LoadedCheckpoint, on_data_change: str) -> None:
        """Load a checkpoint written by any layout (DCP shards or whole tensors) into this one."""
        self._check_shapes(ckpt)
        if self.lora_base is not None:   # the adapters were trained on that base: it must not have changed
            check_base(ckpt.json_state().get("lora_base") or {}, self.lora_base["path"])
        ema = self.ema.state_dict() if self.ema is not None and ckpt.has("ema") else None
        if ckpt.has_shards:
            load_shards(ckpt.path, self.model, self.optimizer, ema)
        else:
            load_model_state(self.model, ckpt.tensors("model"))
            if ema is not None:
                self.ema.load_state_dict(ckpt.tensors("ema"))
            load_optimizer_state(self.model, self.optimizer,
                                 restored_moments(ckpt.torch_state("optimizer"), self.optimizer, self.model))
        state = ckpt.json_state()
        self.scheduler.load_state_dict(state["scheduler"])
        for name, role in self.roles.items():
            if not ckpt.has(name):
                raise UserError(f"checkpoint {ckpt.path} has no {name} (it was not written by a run that trains one, "
                                "e.g. distill.method=dmd2): resume it with its own config, or start a new run "
                                "from it with model.init_from")
            load_model_state(role.parallel.local_model, ckpt.tensors(name), role.adapter)
            load_optimizer_state(role.parallel.local_model, role.optimizer, restored_moments(
                ckpt.torch_state(f"{name}_optimizer"), role.optimizer, role.parallel.local_model))
            role.scheduler.load_state_dict(state["roles"][name]["scheduler"])
        epoch, offset = self.sampler.load_state_dict(state["data"], on_data_change)
        self.progress = Progress(state["step"], epoch, offset)
        rng = ckpt.tensors("rng")
        torch.set_rng_state(rng["torch_cpu"])
        if "torch_cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["torch_cuda"])
        random.setstate(_tuplify(state["python_rng"]))
        kind, keys, *rest = state["numpy_rng"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))


def init_weights_from(model: torch.nn.Module, source: str) -> str:
    """Load the weights of a checkpoint or exported model folder into a freshly built model
    (``model.init_from``); returns which weights were taken. Shapes must match exactly."""
    fix = "set model.* as in that run's config.yaml"
    released = released_spec(source)
    if released is not None:   # released weights (Open-Sora STDiT3, Wan), converted on the fly
        fix = released.released_fix
    # What a source gives (checkpoint/lora.py): the same weights a LoRA run's sampling takes as its base.
    weights, taken = init_weights(source, like=getattr(model, "geometry", None))   # its architecture, too
    own = model.state_dict()
    for name, tensor in own.items():
        if name not in weights:
            raise UserError(f"model.init_from={source}: it has no tensor {name}; it was written for another "
                            f"model ({fix})")
        if tuple(weights[name].shape) != tuple(tensor.shape):
            raise UserError(f"model.init_from={source}: {name} is {tuple(weights[name].shape)} there but "
                            f"{tuple(tensor.shape)} here; {fix}")
    extra = sorted(weights.keys() - own.keys())
    if extra:
        raise UserError(f"model.init_from={source}: it has tensors this model lacks ({', '.join(extra[:3])}); {fix}")
    model.load_state_dict({name: weights[name].to(tensor.dtype) for name, tensor in own.items()})
    return taken


def expert_init_source(cfg) -> str:
    """``model.init_from``, where it holds a two-expert model (Wan 2.2 A14B): one expert's folder
    for ``model.expert=high|low``, the whole for ``both``; a one-model run is refused."""
    source, expert = cfg.model.init_from, cfg.model.expert
    spec = get_spec(cfg.model.family)
    if spec.expert_source(Path(source), "high") is None:
        return source
    if expert is None:
        raise UserError(f"model.init_from={source} holds a two-expert model; set model.expert=high or low (one "
                        "expert per run, on its timesteps) or both (the two in one run)")
    return source if expert == "both" else str(spec.expert_source(Path(source), expert))


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def _tuplify(value):
    return tuple(_tuplify(v) for v in value) if isinstance(value, list) else value
