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
    # parallel.dp_shard=-1 ("every rank left over"): shard over the SP ranks too, even when no
    # other rank is left (sp = world size), so that every GPU holds a shard, not the model.
    shard_over_sp: bool = False

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
        dims = cls(dp_shard=dp_shard, world_size=world_size, shard_over_sp=cfg.dp_shard == -1, **fixed)
        total = other * dp_shard
        if total != world_size:
            raise UserError(
                f"parallel sizes {_product({**fixed, 'dp_shard': dp_shard})} multiply to {total} but the job has "
                f"{world_size} process(es); make the product {world_size} (parallel.dp_shard=-1 fills the rest)")
        return dims

    # ------------------------------------------------------------------ checks against the model

    def check_model(self, *, num_heads: int, hidden_size: int, depth: int, spec, sp_ring: int = 1,
                    blocks: int | None = None) -> None:
        """Raise a UserError if a size cannot split this model (``spec``: its family, which knows
        how many blocks ``depth`` means and what its sequence parallelism needs; ``blocks``: the
        model's repeated blocks where ``depth`` does not give them all, ``spec.blocks_of``)."""
        if num_heads % self.tp or hidden_size % self.tp:
            valid = [d for d in divisors(num_heads) if hidden_size % d == 0]
            raise UserError(f"parallel.tp={self.tp} does not divide model.num_heads={num_heads} and "
                            f"model.hidden_size={hidden_size}; valid: {_listing(valid)}")
        spec.check_sequence_parallel(num_heads, tp=self.tp, sp=self.sp, ring=sp_ring)
        blocks = spec.num_blocks(depth) if blocks is None else blocks
        if self.pp > blocks:
            raise UserError(f"parallel.pp={self.pp} exceeds the model's {blocks} blocks; valid: 1 to {blocks}")

    def check_pipeline(self, cfg: ParallelConfig, *, blocks: int) -> tuple[int, int]:
        """Check the pipeline options; return (stages per rank, micro-batches per step)."""
        interleaved = cfg.pp_schedule == "interleaved_1f1b"
        per_rank = cfg.pp_stages_per_rank or (2 if interleaved else 1)
        microbatches = cfg.pp_microbatches or self.pp * per_rank
        if self.pp == 1:
            return 1, 1
        if self.sp > 1:
            raise UserError(f"parallel.pp={self.pp} with parallel.sp={self.sp} is not supported; combine pipeline "
                            "stages with dp_shard, dp_replicate and tp, or sequence parallelism without pp")
        if interleaved and per_rank < 2:
            raise UserError("parallel.pp_schedule=interleaved_1f1b needs parallel.pp_stages_per_rank >= 2; "
                            "use 1f1b for one stage per rank")
        if not interleaved and per_rank != 1:
            raise UserError(f"parallel.pp_stages_per_rank={per_rank} needs parallel.pp_schedule=interleaved_1f1b; "
                            f"{cfg.pp_schedule} runs one stage per rank")
        if self.pp * per_rank > blocks:
            raise UserError(f"parallel.pp={self.pp} x pp_stages_per_rank={per_rank} = {self.pp * per_rank} stages "
                            f"but the model has {blocks} blocks; lower one of them")
        if cfg.pp_schedule != "gpipe" and (microbatches < self.pp or microbatches % self.pp):
            raise UserError(f"parallel.pp_microbatches={microbatches}: {cfg.pp_schedule} needs a multiple of "
                            f"parallel.pp={self.pp}; valid: {', '.join(str(self.pp * k) for k in range(1, 5))}, ...")
        return per_rank, microbatches

    def check_compile(self) -> None:
        """Raise a UserError for a layout ``train.compile`` cannot compile correctly. Compiled
        blocks compose with checkpointing, DDP, FSDP2/HSDP, SP and PP. Tensor-parallel blocks
        (DTensor) do not, in torch 2.13: with dynamic shapes AOTAutograd's tracing recurses
        without end, and with static shapes the caption's gradient misses its all-reduce over
        the TP group (the caption MLP then learns from this rank's heads only)."""
        if self.tp > 1:
            raise UserError(f"train.compile=true with parallel.tp={self.tp} is not supported: torch does not "
                            "compile tensor-parallel (DTensor) blocks correctly; turn one of them off (parallel.sp "
                            "splits activations too and compiles)")

    def check_block_swap(self, swap_blocks: int, *, blocks: int, frozen_base: bool) -> None:
        """Raise a UserError for a ``memory.swap_blocks`` this run cannot use (``blocks``: the
        model's repeated blocks, per expert; ``frozen_base``: a LoRA run, whose base never trains).
        Swapping moves whole frozen blocks between one process's host and GPU; sharded layouts
        already split them."""
        if not swap_blocks:
            return
        if swap_blocks > blocks:
            raise UserError(f"memory.swap_blocks={swap_blocks} exceeds the model's {blocks} blocks; valid: 0 (off) "
                            f"to {blocks}")
        if not frozen_base:
            raise UserError(f"memory.swap_blocks={swap_blocks} swaps frozen weights only and this run trains every "
                            "weight; use LoRA (lora.rank > 0), or shard a full fine-tune with parallel.dp_shard and "
                            "parallel.cpu_offload=true")
        if self.tp > 1 or self.pp > 1:
            name, size = ("tp", self.tp) if self.tp > 1 else ("pp", self.pp)
            raise UserError(f"memory.swap_blocks={swap_blocks} with parallel.{name}={size} is not supported: each "
                            f"rank then holds only part of the blocks already; use one of them")
        if self.data_parallel in ("fsdp", "hsdp"):
            raise UserError(f"memory.swap_blocks={swap_blocks} with FSDP sharding ({self.describe()}) is redundant: "
                            "FSDP already holds a block's whole weights only while it runs; use FSDP alone "
                            "(parallel.cpu_offload=true keeps the shards in host memory), or parallel.dp_shard=1 "
                            "to swap blocks")

    # ------------------------------------------------------------------ derived sizes

    @property
    def dp_size(self) -> int:
        """Ranks that receive different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def data_parallel(self) -> str:
        """How gradients are shared: none (one rank), ddp, fsdp or hsdp. FSDP shards over the
        dp_shard x sp ranks; with ``dp_shard=-1`` that holds when only SP ranks are left."""
        if self.dp_shard > 1 or (self.sp > 1 and self.shard_over_sp):
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        if self.dp_replicate * self.sp == 1:
            return "none"
        if self.tp > 1 or self.pp > 1:
            # DDP does not take DTensor (TP) parameters or pipeline stages: FSDP2 over a
            # shard group of the SP ranks (size 1 without SP) replicates just as well.
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        return "ddp"

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
        meshes = {"world": world, "sp": world["sp"], "tp": world["tp"], "pp": world["pp"],
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


def check_layout(cfg, world_size: int) -> tuple[ParallelDims, int, int]:
    """Every check of a config's parallel sizes against ``world_size`` processes and its model,
    before anything is built: the one check that training (``init_distributed``) and the planner
    (``videodit plan``) both run, so that a plan is never made for a layout training refuses.
    Returns (dims, pipeline stages per rank, micro-batches per step)."""
    from videodit.models.families import get_spec

    dims = ParallelDims.from_config(cfg.parallel, world_size)
    m = cfg.model
    spec = get_spec(m.family)
    blocks = spec.blocks_of(m)   # the MMDiT: its double and single blocks
    dims.check_model(num_heads=m.num_heads, hidden_size=m.hidden_size, depth=m.depth, spec=spec,
                     sp_ring=cfg.parallel.sp_ring, blocks=blocks)
    per_rank, microbatches = dims.check_pipeline(cfg.parallel, blocks=blocks)
    dims.check_block_swap(cfg.memory.swap_blocks, blocks=blocks, frozen_base=cfg.lora.rank > 0)
    if m.image_dim is not None and dims.pp > 1:
        raise UserError(f"parallel.pp={dims.pp}: the pipeline does not carry Wan 2.1 I2V's image features between "
                        "stages; split the model with parallel.tp, parallel.sp or parallel.dp_shard (FSDP2) instead")
    if m.expert == "both" and dims.pp > 1:
        raise UserError(f"parallel.pp={dims.pp} cannot split a model.expert=both run (two experts, one of them "
                        "active per step); shard it with parallel.dp_shard (FSDP2), or train one expert per run "
                        "with model.expert=high|low")
    if cfg.train.compile:
        dims.check_compile()
    return dims, per_rank, microbatches


def _product(sizes: dict[str, int]) -> str:
    """``dp_replicate=2 x sp=3``: the sizes above 1 in mesh order."""
    shown = [f"{name}={sizes[name]}" for name in MESH_DIMS if sizes.get(name, 1) > 1]
    return " x ".join(shown) or "all 1"
