"""Zero graph breaks in every family's block (``train.compile`` compiles each block with
``fullgraph=True``, ``videodit/parallel/compile.py``: a break there is an error, and a break
anywhere would cost a graph and a round trip through Python per block).

Each family's tiny model runs once eagerly; a pre-hook keeps the inputs of the first block of each
kind (STDiT spatial and temporal, Wan's block, the MMDiT's double and single blocks, LTX-2's block
with the video stream alone and with both streams). Each such block then

- traces under ``torch._dynamo.explain`` in one graph with no break (the count and reasons are
  asserted, so a break names its cause in the failure), with dynamic shapes as ``train.compile``
  marks them (``ModelSpec.dynamic_dims``) and without, bare and inside selective activation
  checkpointing's wrapper (what ``train.compile`` compiles when ``memory.checkpointing`` is on);
- compiles with ``torch.compile(block, fullgraph=True, backend="aot_eager")`` (AOTAutograd's
  forward/backward split, as inductor traces), and its outputs and the gradients of its inputs
  and parameters follow eager's.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

from tiny_families import build
from videodit.models.families import spec_of
from videodit.parallel.activation_checkpoint import checkpoint_module


FAMILIES = {"stdit": lambda: build("stdit", 1), "wan": lambda: build("wan", 1),
            "mmdit": lambda: build("mmdit", 1, masked=True),   # the caption's key mask too
            "ltx2": lambda: build("ltx2", 1), "ltx2-audio": lambda: build("ltx2", 1, audio=True)}
KINDS = {"stdit": {"spatial", "temporal"}, "wan": {"block"}, "mmdit": {"double", "single"},
         "ltx2": {"block"}, "ltx2-audio": {"block"}}


def block_inputs(family: str) -> tuple[nn.Module, dict[str, tuple[nn.Module, tuple]]]:
    """The model of ``family`` (random, non-zero weights) and, per block kind, its first block and
    the positional arguments it was called with in a forward."""
    torch.manual_seed(0)
    model, run = FAMILIES[family]()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)   # no zero-initialised layer: every gradient flows
    spec, seen = spec_of(model), {}

    def keep(block, args):
        seen.setdefault(spec.block_kind(block), (block, args))

    hooks = [block.register_forward_pre_hook(keep) for block in model.blocks]
    with torch.no_grad():
        run()
    for hook in hooks:
        hook.remove()
    return model, seen


def _leaves(args):
    """The floating tensors of ``args`` (dataclasses and tuples of them included), in order."""
    if isinstance(args, torch.Tensor):
        return [args] if args.is_floating_point() else []
    if isinstance(args, (tuple, list)):
        return [t for a in args for t in _leaves(a)]
    if hasattr(args, "__dataclass_fields__"):
        return [t for name in args.__dataclass_fields__ for t in _leaves(getattr(args, name))]
    return []


def _fresh(args):
    """``args`` with every floating tensor a new leaf that requires grad (dataclasses rebuilt)."""
    import dataclasses
    if isinstance(args, torch.Tensor):
        return args.detach().clone().requires_grad_(args.is_floating_point())
    if isinstance(args, tuple):
        return tuple(_fresh(a) for a in args)
    if isinstance(args, list):
        return [_fresh(a) for a in args]
    if dataclasses.is_dataclass(args):
        return dataclasses.replace(args, **{f.name: _fresh(getattr(args, f.name)) for f in dataclasses.fields(args)
                                            if f.init})
    return args


def forward_backward(fn, block: nn.Module, args: tuple):
    """Outputs of ``fn(*args)`` and the gradients of a fixed random projection of them with respect
    to the floating inputs and the block's parameters."""
    block.zero_grad(set_to_none=True)
    args = _fresh(args)
    out = fn(*args)
    outs = _leaves(out)
    gen = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    inputs = _leaves(args)
    params = [p for p in block.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, inputs + params, allow_unused=True)
    return [o.detach() for o in outs], list(grads)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_block_compiles_in_one_graph_forward_and_backward(family):
    torch._dynamo.reset()
    model, blocks = block_inputs(family)
    assert blocks.keys() == KINDS[family]
    spec = spec_of(model)
    for kind, (block, args) in blocks.items():
        checkpointed = copy.deepcopy(block)
        checkpoint_module(checkpointed, "selective")
        for traced, dynamic in itertools.product((block, checkpointed), (False, True)):
            torch._dynamo.reset()
            if dynamic:
                for tensor, dims in spec.dynamic_dims(args):
                    torch._dynamo.maybe_mark_dynamic(tensor, dims)
            explained = torch._dynamo.explain(traced.forward)(*args)
            reasons = [str(r.reason) for r in explained.break_reasons]
            where = (family, kind, "selective" if traced is checkpointed else "none", dynamic, reasons)
            assert (explained.graph_break_count, explained.graph_count) == (0, 1), where

        torch._dynamo.reset()
        want_out, want_grads = forward_backward(block, block, args)
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        got_out, got_grads = forward_backward(compiled, block, args)
        assert len(got_out) == len(want_out) and len(got_grads) == len(want_grads)
        for got, want in zip(got_out, want_out):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert want_grads[0] is not None and any(g is not None for g in want_grads[len(_leaves(args)):])
        for got, want in zip(got_grads, want_grads):
            assert (got is None) == (want is None), (family, kind)
            if want is not None:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
