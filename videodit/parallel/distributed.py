"""The process group of one job: who am I, which device, and the few collectives the loop needs.

``torchrun`` sets ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``; without them the job is one
process and every collective below is a no-op, so the trainer has one code path.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from videodit.config import Config
from videodit.errors import UserError
from videodit.parallel.dims import ParallelDims, check_layout
from videodit.parallel.float8 import check_float8


@dataclass
class DistContext:
    dims: ParallelDims
    rank: int
    local_rank: int
    device: torch.device
    meshes: dict | None = None    # name -> DeviceMesh (see ParallelDims.build_meshes); None for one process
    pp_stages_per_rank: int = 1   # pipeline stages this rank holds (see ParallelDims.check_pipeline)
    pp_microbatches: int = 1      # micro-batches each pipeline step cuts a batch into

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.meshes is not None

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ranks that receive different batches."""
        return self.rank_in("dp")

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    def rank_in(self, name: str) -> int:
        """This rank's index along one mesh axis (``pp``, ``tp``, ...)."""
        return self.meshes[name].get_local_rank() if self.distributed else 0

    def group(self, name: str):
        return self.meshes[name].get_group()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def broadcast(self, value):
        """Rank 0's ``value`` on every rank (any picklable object)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, fn):
        """Run ``fn`` on rank 0 alone and return its result on every rank; a ``UserError`` it
        raises is raised on every rank with the same message, so all ranks stop alike."""
        if not self.distributed:
            return fn()
        outcome = None
        if self.is_main:
            try:
                outcome = ("ok", fn())
            except UserError as exc:
                outcome = ("error", str(exc))
        kind, value = self.broadcast(outcome)
        if kind == "error":
            raise UserError(value)
        return value

    def mean(self, value: float) -> float:
        """The mean of ``value`` over all ranks (for logging)."""
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self._collective_device)
        dist.all_reduce(tensor)
        return tensor.item() / self.world_size

    def sum_over(self, name: str, value: float) -> float:
        """The sum of ``value`` over one mesh axis (e.g. the loss, known on the last pipeline stage)."""
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self._collective_device)
        dist.all_reduce(tensor, group=self.group(name))
        return tensor.item()

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on one (a stop signal, a save decision)."""
        if not self.distributed:
            return flag
        tensor = torch.tensor([int(flag)], device=self._collective_device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return bool(tensor.item())

    @property
    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def close(self) -> None:
        """Leave the process group. Drop the trainer first: its model and meshes hold gloo groups
        whose worker threads must be joined now, while Python is whole. Joined at interpreter exit,
        a worker that frees a tensor needs the GIL of a dying interpreter and aborts the rank."""
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
            gc.collect()


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto``, ``cpu`` or ``cuda``; with CUDA, the GPU of this process's ``local_rank``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cuda":
        return torch.device(name)
    if not torch.cuda.is_available():
        raise UserError("train.device=cuda but no GPU is visible; use train.device=cpu or auto")
    if local_rank >= torch.cuda.device_count():
        raise UserError(f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible; start "
                        "fewer processes per node (torchrun --nproc-per-node)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(cfg: Config) -> DistContext:
    """Check the parallel sizes against the world and the model, then join the process group.

    Everything that can be wrong with the sizes is reported here, before any model exists.
    """
    world = launched_world_size()
    dims, per_rank, microbatches = check_layout(cfg, world)   # the checks `videodit plan` runs too
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(cfg.train.device, local_rank)
    if cfg.train.fp8:
        check_float8(device, tp=dims.tp, lora_rank=cfg.lora.rank)
    if world == 1:
        return DistContext(dims, rank, local_rank, device)
    if not dist.is_initialized():   # a caller (a test harness) may have joined already
        join_process_group(device, timedelta(minutes=cfg.parallel.timeout_minutes))
    return DistContext(dims, rank, local_rank, device, dims.build_meshes(device.type), per_rank, microbatches)



def join_process_group(device: torch.device, timeout: timedelta) -> None:
    """``init_process_group`` from torchrun's environment, one store namespace per restart.

    torchrun keeps its agent's store for all restarts of a group, so without a namespace a
    restarted gloo rank can read the address its killed predecessor published and wait on
    that dead socket until the timeout (seen in about one restart in four)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        return
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"videodit/attempt-{attempt}", agent_store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timeout, device_id=device_id)


def on_main_then_all(fn):
    """``fn()`` on rank 0 alone (a folder prepared once), its result (or its UserError) on every rank:
    a collective where a process group is up, a plain call where none is."""
    if not dist.is_initialized():
        return fn()
    outcome = None
    if dist.get_rank() == 0:
        try:
            outcome = ("ok", fn())
        except UserError as exc:
            outcome = ("error", str(exc))
    box = [outcome]
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "error":
        raise UserError(box[0][1])
    return box[0][1]
