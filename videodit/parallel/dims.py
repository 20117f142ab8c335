"""ParallelDims: the one object that owns the parallel sizes and builds the DeviceMesh.

Ranks are laid out as a mesh ``pp x dp_replicate x dp_shard x sp x tp`` (row-major, so
``tp`` varies fastest and its ranks share a node). Flattened views used elsewhere:

- ``dp``          = dp_replicate x dp_shard: ranks that see different batches (the sampler);
- ``dp_shard_sp`` = dp_shard x sp: the FSDP shard group. Ranks of one SP group hold the
  same weights and each computes gradients from its part of the tokens, so they shard
  and reduce together, as torchtitan does with context parallelism;
- ``dp_sp``       = dp_replicate x dp_shard x sp: every rank whose gradients are averaged
  (the DDP group when nothing is sharded).

Sizes are checked against the world size and the model before anything is built, with a
one-line error listing the sizes that would work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from videodit.config import ParallelConfig
from videodit.errors import UserError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "sp", "tp")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _listing(values: list[int]) -> str:
    return ", ".join(map(str, values)) if values else "none"


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    sp: int
    tp: int
    pp: int
    world_size: int

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> "ParallelDims":
        """Resolve ``dp_shard=-1`` and check that the sizes multiply to ``world_size``."""
        fixed = {"dp_replicate": cfg.dp_replicate, "sp": cfg.sp, "tp": cfg.tp, "pp": cfg.pp}
        if cfg.dp_shard == 0:
            raise UserError("parallel.dp_shard=0 is not a size; use -1 (all ranks left over), 1 (no "
                            "sharding) or a positive size")
        other = math.prod(fixed.values())
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if world_size % other:
                raise UserError(
                    f"parallel sizes {_product(fixed)} multiply to {other}, which does not divide the world size "
                    f"{world_size}; choose sizes whose product divides {world_size} (divisors: "
                    f"{_listing(divisors(world_size))})")
            dp_shard = world_size // other
        dims = cls(dp_shard=dp_shard, world_size=world_size, **fixed)
        total = other * dp_shard
        if total != world_size:
            raise UserError(
                f"parallel sizes {_product({**fixed, 'dp_shard': dp_shard})} multiply to {total} but the job has "
                f"{world_size} process(es); make the product {world_size} (parallel.dp_shard=-1 fills the rest)")
        return dims

    # ------------------------------------------------------------------ checks against the model

    def check_model(self, *, num_heads: int, hidden_size: int, depth: int) -> None:
        """Raise a UserError if a size cannot split this model."""
        if num_heads % self.sp:
            # Images and frame counts that do not split fall back to head-parallel attention.
            raise UserError(f"parallel.sp={self.sp} does not divide model.num_heads={num_heads}; valid: "
                            f"{_listing(divisors(num_heads))}")
        if self.tp > 1:
            valid = [d for d in divisors(num_heads) if hidden_size % d == 0]
            if num_heads % self.tp or hidden_size % self.tp:
                raise UserError(f"parallel.tp={self.tp} does not divide model.num_heads={num_heads} and "
                                f"model.hidden_size={hidden_size}; valid: {_listing(valid)}")
            raise UserError("parallel.tp > 1: tensor parallelism is not available yet; use parallel.dp_shard "
                            "and parallel.sp to split the job")
        if self.pp > 1:
            blocks = 2 * depth
            if self.pp > blocks:
                raise UserError(f"parallel.pp={self.pp} exceeds the model's {blocks} blocks; valid: 1 to {blocks}")
            raise UserError("parallel.pp > 1: pipeline parallelism is not available yet; use parallel.dp_shard "
                            "and parallel.sp to split the job")

    # ------------------------------------------------------------------ derived sizes

    @property
    def dp_size(self) -> int:
        """Ranks that receive different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def data_parallel(self) -> str:
        """How gradients are shared: none (one rank), ddp, fsdp or hsdp."""
        if self.dp_shard > 1:
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        return "ddp" if self.dp_replicate * self.sp > 1 else "none"

    def describe(self) -> str:
        parts = [f"{name}={getattr(self, name)}" for name in MESH_DIMS if getattr(self, name) > 1]
        return f"world {self.world_size}: " + (" x ".join(parts) or "single process") + \
            f" ({self.data_parallel})"

    # ------------------------------------------------------------------ the mesh

    def build_meshes(self, device_type: str) -> dict:
        """The DeviceMesh over all ranks (``world``), its ``sp`` axis, the flattened ``dp``,
        ``dp_shard_sp`` and ``dp_sp`` views, and for HSDP the 2D ``hsdp`` mesh
        (dp_replicate x dp_shard_sp)."""
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        shape = tuple(getattr(self, name) for name in MESH_DIMS)
        world = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        meshes = {"world": world, "sp": world["sp"],
                  "dp": world["dp_replicate", "dp_shard"]._flatten("dp"),
                  "dp_shard_sp": world["dp_shard", "sp"]._flatten("dp_shard_sp"),
                  "dp_sp": world["dp_replicate", "dp_shard", "sp"]._flatten("dp_sp")}
        if self.data_parallel == "hsdp":
            sizes, names = (self.dp_replicate, self.dp_shard * self.sp), ("dp_replicate", "dp_shard_sp")
            if hasattr(DeviceMesh, "_unflatten"):   # newer torch: keep flattened meshes out of slicing
                meshes["hsdp"] = meshes["dp_sp"]._unflatten(0, sizes, names)
            else:
                meshes["hsdp"] = world[names]
        return meshes


def _product(sizes: dict[str, int]) -> str:
    """``dp_replicate=2 x sp=3``: the sizes above 1 in mesh order."""
    shown = [f"{name}={sizes[name]}" for name in MESH_DIMS if sizes.get(name, 1) > 1]
    return " x ".join(shown) or "all 1"
