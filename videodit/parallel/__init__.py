"""Parallelism and the runtime memory levers, applied to a model from outside: sizes and
meshes (``dims``), the process group (``distributed``), PP -> TP -> SP -> levers -> FSDP2/DDP
(``parallelize``) and the training state across layouts (``state``)."""

from videodit.parallel.dims import ParallelDims
from videodit.parallel.distributed import DistContext, init_distributed
from videodit.parallel.parallelize import ParallelModel, parallelize

__all__ = ["DistContext", "ParallelDims", "ParallelModel", "init_distributed", "parallelize"]
