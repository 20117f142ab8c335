"""Regional compilation: ``torch.compile`` on every transformer block, applied from outside.

As torchtitan's ``apply_compile``, each block is compiled on its own (the blocks repeat, so
one graph per block kind serves all of them: STDiT's spatial and temporal, Wan's one), in torchtitan's place: after sequence
parallelism and activation checkpointing, before FSDP2/DDP (torchtitan also compiles after
tensor parallelism; torch 2.13 gets DTensor blocks wrong, so ``ParallelDims.check_compile``
refuses TP with compile). What is compiled is the
block's ``forward`` as the earlier steps left it (the checkpoint wrapper included, which
Dynamo traces as one region that backward recomputes); the hooks around the block stay
eager: sequence parallelism's layout switches (all-to-alls between blocks) and FSDP2's
all-gathers and reduce-scatters run between compiled regions, exactly as without compile.
The offload and compression levers wrap the compiled forward from outside, so their hooks
see the tensors the compiled graph saves for backward. Parameter names, state dicts and
checkpoints are unchanged (nothing is re-registered, no ``_orig_mod.`` prefix).

Bucketed data changes the block input shapes between batches: batch, frames and positions
per frame (the caption length is fixed). ``dynamic`` marks those dimensions dynamic before
each call (which ones, the family says: ``ModelSpec.dynamic_dims``), so one graph per block kind serves every video bucket; sizes 0 and 1 are always
specialised, so image buckets (one frame) and batches of one get a graph of their own.
``static`` compiles one graph per bucket shape (specialised kernels, for a few buckets);
``auto`` is ``dynamic`` when the data has more than one bucket shape, else ``static``.

Every graph Dynamo compiles for the blocks is counted by :class:`CompileStats` (kind and
input shape), so a run can report its recompiles and tests can bound them.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from videodit.errors import UserError
from videodit.models.families import spec_of

BACKENDS = ("inductor", "aot_eager", "eager")
DYNAMIC = ("auto", "dynamic", "static")


@dataclass(frozen=True)
class CompileOptions:
    backend: str = "inductor"
    dynamic: str = "auto"          # auto, dynamic or static (see the module docstring)
    fullgraph: bool = True         # a graph break inside a block is a bug here: fail loudly

    def resolved(self, shapes: int) -> "CompileOptions":
        """``auto`` decided for data with ``shapes`` distinct bucket shapes."""
        if self.dynamic != "auto":
            return self
        return dataclasses.replace(self, dynamic="dynamic" if shapes > 1 else "static")


@dataclass
class CompileStats:
    """The graphs compiled for the blocks: one (kind, block input shape) per compilation."""

    graphs: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    @property
    def compiles(self) -> int:
        return len(self.graphs)

    @property
    def recompiles(self) -> int:
        """Compilations after the first of each block kind (spatial, temporal)."""
        return self.compiles - len({kind for kind, _ in self.graphs})

    def by_kind(self) -> dict[str, list[tuple[int, ...]]]:
        out: dict[str, list[tuple[int, ...]]] = {}
        for kind, shape in self.graphs:
            out.setdefault(kind, []).append(shape)
        return out

    def summary(self) -> str:
        """One line: the graphs per block kind and the block input shape each was compiled at."""
        kinds = "; ".join(f"{kind} {len(shapes)} ({', '.join('x'.join(map(str, s)) for s in shapes)})"
                          for kind, shapes in self.by_kind().items())
        return f"train.compile: {self.compiles} graphs for the blocks, {self.recompiles} recompiles: {kinds or 'none'}"


def compile_options(train) -> CompileOptions | None:
    """The options of ``train.compile`` (a ``TrainConfig``); None when compile is off."""
    return CompileOptions(train.compile_backend, train.compile_dynamic) if train.compile else None


def _graphs_so_far() -> int:
    """Dynamo's count of graphs compiled in this process (every frame and backend)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def compile_block(block: nn.Module, options: CompileOptions, stats: CompileStats, spec) -> None:
    """Replace ``block.forward`` (on the instance) by its compiled version. ``spec`` (the model's
    family) names the block's kind and which dimensions of its inputs vary between buckets."""
    kind = spec.block_kind(block)
    compiled = torch.compile(block.forward, backend=options.backend, fullgraph=options.fullgraph,
                             dynamic=False if options.dynamic == "static" else None)
    dynamic = options.dynamic == "dynamic"

    @functools.wraps(block.forward)
    def forward(*args):
        if dynamic:   # ``maybe``: sizes 0 and 1 may specialise instead of failing
            for tensor, dims in spec.dynamic_dims(args):
                torch._dynamo.maybe_mark_dynamic(tensor, dims)
        before = _graphs_so_far()
        out = compiled(*args)
        stats.graphs.extend([(kind, tuple(args[0].shape))] * (_graphs_so_far() - before))
        return out

    block.forward = forward


def apply_compile(model: nn.Module, options: CompileOptions, *, shapes: int = 1,
                  stats: CompileStats | None = None) -> CompileStats:
    """Compile every block of ``model.blocks`` (a whole model, a pipeline stage or an expert) in
    place. ``shapes``: how many distinct bucket shapes the data has (decides ``auto``, and how
    many graphs Dynamo must be allowed to keep); ``stats``: counts to add to (the other experts')."""
    if options.backend not in BACKENDS:
        raise UserError(f"train.compile_backend={options.backend!r} is not one of {', '.join(BACKENDS)}")
    if options.dynamic not in DYNAMIC:
        raise UserError(f"train.compile_dynamic={options.dynamic!r} is not one of {', '.join(DYNAMIC)}")
    options = options.resolved(shapes)
    _raise_recompile_limit(2 * shapes + 8)
    stats = CompileStats() if stats is None else stats
    spec = spec_of(model)
    for block in model.blocks:
        compile_block(block, options, stats, spec)
    return stats


def _raise_recompile_limit(entries: int) -> None:
    """Spatial and temporal blocks share their code (``STBlock.forward``, or the checkpoint
    wrapper), so their graphs share one Dynamo cache: make room for a graph per kind and
    shape (static mode) rather than falling back to eager when Dynamo's default (8) is hit."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < entries:
        setattr(config, name, entries)
