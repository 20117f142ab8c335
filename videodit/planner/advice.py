"""What to change when a bucket does not fit at batch 1: first on the GPUs the job has (the
world size given, default what the config's parallel sizes imply), then on more of them.

Each change is a :class:`Fix`: the table's wording, the ``key=value`` settings that make it so (to
paste after the config on a command line), the planner's changes to try it, and the GPUs it runs on.
On the same GPUs the levers come in order of their step-time cost (``planner/levers.py``:
checkpointing, 8-bit AdamW or the fp8 base, sequence parallelism within the FSDP group, offload,
the fewest swapped blocks, FSDP's CPU offload). More GPUs are for what they buy: the smallest
multiple of the GPUs given on which the config (FSDP over every rank, ``parallel.dp_shard=-1``)
fits without a host-memory lever (offload, swapped blocks, CPU offload), else with one.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Iterator

from videodit.errors import UserError
from videodit.planner.levers import IN_FLIGHT

MAX_SUGGESTED_WORLD = 1024   # more GPUs than this are not suggested
_HOST_LEVERS = ("memory.offload=true", "memory.swap_blocks=", "parallel.cpu_offload=true")


@dataclass(frozen=True)
class Fix:
    label: str                       # the table's wording: "lora.base_dtype=fp8 with memory.checkpointing=full"
    settings: tuple[str, ...]        # the overrides that make it so
    changes: dict = field(default_factory=dict, compare=False)   # Planner.estimate's changes
    world: int = 1                   # GPUs it runs on

    @property
    def uses_host(self) -> bool:
        """Whether it moves weights or activations to host memory (slow: bounded by PCIe)."""
        return any(s.startswith(_HOST_LEVERS) for s in self.settings)


@dataclass
class Advice:
    """The change under which every bucket that does not fit takes batch 1: on the GPUs given
    (``fix``) and on more (``more``); each with the worst bucket's batch-1 peak under it."""
    world: int
    fix: Fix | None
    fix_peak: int
    more: Fix | None
    more_peak: int
    stuck: list = field(default_factory=list)   # the buckets (BucketFit) that do not fit as configured

    @property
    def buckets(self) -> int:
        return len(self.stuck)

    def as_dict(self) -> dict:
        def one(fix, peak):
            return None if fix is None else {"gpus": fix.world, "settings": list(fix.settings), "peak_bytes": peak,
                                             "label": fix.label}
        return {"gpus": self.world, "buckets": self.buckets, "same_gpus": one(self.fix, self.fix_peak),
                "more_gpus": one(self.more, self.more_peak)}


def fixes(planner) -> Iterator[Fix]:
    """Changes in order of their step-time cost: checkpointing, then the levers of
    ``planner/levers.py`` (each with full checkpointing and the cheaper levers before it),
    sequence parallelism, offload, block swapping, FSDP's CPU offload. Sequence parallelism runs
    on the same GPUs where FSDP shards over them, else on ``sp`` times as many."""
    m, p, heads, world = planner.memory, planner.parallel, planner.geometry.num_heads, planner.world_size
    cfg = planner.config
    if m.checkpointing == "none":
        yield Fix("memory.checkpointing=selective", ("memory.checkpointing=selective",),
                  {"memory": {"checkpointing": "selective"}}, world)
    # Every block: memory.checkpoint_blocks (first n per kind) gives way to the plain counts.
    full = {"checkpointing": "full", "checkpoint_every": 1, "checkpoint_fraction": 1.0, "checkpoint_blocks": None}
    full_settings = ("memory.checkpointing=full",) + (("memory.checkpoint_every=1",) if m.checkpoint_every > 1 else ()) \
        + (("memory.checkpoint_fraction=1.0",) if m.checkpoint_fraction < 1 else ()) \
        + (("memory.checkpoint_blocks=null",) if m.checkpoint_blocks is not None else ())
    some = m.checkpoint_every > 1 or m.checkpoint_fraction < 1 if m.checkpoint_blocks is None else \
        len(m.checkpointed_blocks(planner.counts.depth_blocks, list(planner.counts.kinds))) < planner.counts.depth_blocks
    if m.checkpointing != "full" or some:
        yield Fix("memory.checkpointing=full (all blocks)", full_settings, {"memory": full}, world)
    levers, said, lever_settings = {}, [], ()   # the cheap levers, accumulated
    if planner.lora is None and planner.levers.optimizer == "adamw":
        levers["optimizer"] = "adamw8bit"
        said.append("train.optimizer=adamw8bit")
        lever_settings += ("train.optimizer=adamw8bit",)
        yield Fix(f"{' with '.join(said)} with memory.checkpointing=full", lever_settings + full_settings,
                  {"memory": full, "levers": dict(levers)}, world)
    if planner.lora is not None and not planner.levers.fp8_base and p.tp == 1:
        levers["fp8_base"] = True
        said.append("lora.base_dtype=fp8")
        lever_settings += ("lora.base_dtype=fp8",)
        yield Fix(f"{' with '.join(said)} with memory.checkpointing=full", lever_settings + full_settings,
                  {"memory": full, "levers": dict(levers)}, world)
    fill = ("parallel.dp_shard=-1",) if cfg is not None and cfg.parallel.dp_shard != -1 else ()
    for sp in (2, 4, 8, 16):
        # On the same GPUs (FSDP shards over dp_shard x sp, a fixed number), or on sp GPUs
        # where there is one: the default dp_shard=-1 then shards over the SP ranks.
        same_gpus = p.shard > 1
        if sp > p.sp and heads % (sp * p.tp) == 0 and (not same_gpus or p.shard % sp == 0):
            yield Fix(f"parallel.sp={sp} with memory.checkpointing=full",
                      (f"parallel.sp={sp}",) + (() if same_gpus else fill) + full_settings,
                      {"memory": full, "parallel": {"sp": sp, "shard": p.shard if same_gpus else sp}},
                      world if same_gpus else world * sp // p.sp)
    yield Fix("memory.offload=true with memory.checkpointing=selective",
              ("memory.offload=true", "memory.checkpointing=selective"),
              {"memory": {"checkpointing": "selective", "offload": True}}, world)
    offload = {**full, "offload": True}   # the checkpointed blocks' inputs on the host too
    said.append("memory.offload=true")
    lever_settings += ("memory.offload=true",)
    yield Fix(f"{' with '.join(said)} with memory.checkpointing=full", lever_settings + full_settings,
              {"memory": offload, "levers": dict(levers)}, world)
    if planner.lora is not None and p.shard == 1 and p.tp == 1 and p.pp == 1:   # block swapping's own limits
        for count in range(max(planner.levers.swap_blocks, IN_FLIGHT) + 1, planner.counts.depth_blocks + 1):
            yield Fix(" with ".join([*said, f"memory.swap_blocks={count}", "memory.checkpointing=full"]),
                      lever_settings + (f"memory.swap_blocks={count}",) + full_settings,
                      {"memory": offload, "levers": {**levers, "swap_blocks": count}}, world)
    if p.shard > 1:
        yield Fix("parallel.cpu_offload=true with memory.checkpointing=full",
                  ("parallel.cpu_offload=true",) + full_settings, {"memory": full, "parallel": {"cpu_offload": True}},
                  world)


def batch_one_peak(planner, buckets, fix: Fix | None = None) -> int:
    """The largest batch-1 (a pipeline's smallest batch) peak over ``buckets`` under ``fix``."""
    changes = {} if fix is None else fix.changes
    return max(planner.estimate(planner.batch_multiple, b.num_frames, b.height, b.width,
                                **copy.deepcopy(changes)).peak for b in buckets)


def cheapest_fix(planner, buckets) -> tuple[Fix, int] | None:
    """The first change on the GPUs given under which every one of ``buckets`` takes batch 1."""
    for fix in fixes(planner):
        if fix.world == planner.world_size:
            peak = batch_one_peak(planner, buckets, fix)
            if peak <= planner.budget:
                return fix, peak
    return None


def on_more_gpus(planner, buckets) -> tuple[Fix, int] | None:
    """The smallest multiple of the GPUs given (up to MAX_SUGGESTED_WORLD) on which ``buckets``
    take batch 1 without a host-memory lever, else with one: the config's layout with FSDP over
    every rank (``parallel.dp_shard=-1``), plus the cheapest change it still needs."""
    if planner.config is None:
        return None
    cfg = planner.config
    grown = []
    world = planner.world_size * 2
    while world <= MAX_SUGGESTED_WORLD:
        bigger = _on(planner, cfg, world)
        if bigger is not None:
            grown.append(bigger)
        world *= 2
    fill = (("parallel.dp_shard=-1",) if cfg.parallel.dp_shard != -1 else ()) \
        + (("memory.swap_blocks=0",) if cfg.memory.swap_blocks else ())
    for host_allowed in (False, True):
        for bigger in grown:
            plain = Fix(f"{bigger.world_size} GPUs", fill, {}, bigger.world_size)
            for fix in (plain, *(f for f in fixes(bigger) if f.world == bigger.world_size)):
                if fix.uses_host and not host_allowed:
                    continue
                peak = batch_one_peak(bigger, buckets, fix)
                if peak <= bigger.budget:
                    settings = tuple(dict.fromkeys(fill + fix.settings))
                    return dataclasses.replace(fix, settings=settings, world=bigger.world_size), peak
    return None


def advise(planner, plans) -> Advice | None:
    """What makes every bucket of ``plans`` that does not fit take batch 1 (None: all fit); each
    change's settings only where they differ from the config's."""
    stuck = [p for p in plans if not p.max_batch_size]
    if not stuck:
        return None
    same = cheapest_fix(planner, stuck)
    more = None
    if same is None or same[0].uses_host:   # more GPUs are worth it where they spare host round trips
        more = on_more_gpus(planner, stuck)
    same, more = (None if found is None else (_needed(planner.config, found[0]), found[1]) for found in (same, more))
    return Advice(planner.world_size, *(same or (None, 0)), *(more or (None, 0)), stuck)


def _needed(cfg, fix: Fix) -> Fix:
    """``fix`` without the settings ``cfg`` has already (``memory.checkpointing=full`` of a config
    that checkpoints every block)."""
    import yaml

    if cfg is None:
        return fix
    kept = []
    for setting in fix.settings:
        key, value = setting.split("=", 1)
        current = cfg
        for part in key.split("."):
            current = getattr(current, part, None)
        if current != yaml.safe_load(value):
            kept.append(setting)
    return dataclasses.replace(fix, settings=tuple(kept))


def _on(planner, cfg, world: int):
    """``planner`` on ``world`` GPUs with FSDP over every rank left over, or None where the
    config's other sizes do not divide ``world`` (training's checks refuse that layout)."""
    from videodit.planner.estimate import parallel_from_config

    # FSDP holds a block whole only while it runs: block swapping is refused with it, and not needed.
    wider = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp_shard=-1),
                                memory=dataclasses.replace(cfg.memory, swap_blocks=0))
    try:
        parallel = parallel_from_config(wider, world)
    except UserError:
        return None
    bigger = copy.copy(planner)   # the meta model and counts are the same: not built again
    bigger.parallel, bigger.world_size, bigger.config = parallel, world, wider
    bigger.memory, bigger.levers = wider.memory, dataclasses.replace(planner.levers, swap_blocks=0)
    return bigger
