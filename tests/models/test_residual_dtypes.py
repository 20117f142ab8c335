"""The residual stream and the adaLN modulation under bf16 autocast keep the dtypes each family's
reference keeps (issue #40; the table in docs/architecture.md, "Residual and modulation dtypes").

- Wan 2.1/2.2 (``wan/modules/model.py``): the modulation and every residual add run in fp32
  (``autocast(dtype=float32)`` sections), so the stream between blocks is fp32;
- Open-Sora 2.0's MMDiT, STDiT (Open-Sora 1.2) and LTX-2 (ltx-core) train with the whole model in
  bf16: stream and modulation are bf16, the compute dtype.

Each tiny model (two blocks of each kind, so a block's input is also the previous block's output)
runs once under CPU bf16 autocast; hooks record the dtype of every block's token streams, in and
out, and of the shift/scale/gate tensors where the family makes them.
"""

from __future__ import annotations

import pytest
import torch

from tiny_families import build

FP32, BF16 = torch.float32, torch.bfloat16


# family -> (build, residual dtype, modulation dtype) as the reference keeps them under bf16
REFERENCE = {
    "wan": (lambda: build("wan", 2), FP32, FP32),
    "stdit": (lambda: build("stdit", 2), BF16, BF16),
    "mmdit": (lambda: build("mmdit", 2), BF16, BF16),
    "mmdit-no-frame-given": (lambda: build("mmdit", 2, given=False), BF16, BF16),
    "ltx2": (lambda: build("ltx2", 2), BF16, BF16),
    "ltx2-audio": (lambda: build("ltx2", 2, audio=True), BF16, BF16),
}


def _streams(block, args, out) -> list[torch.Tensor]:
    """The token streams a block takes and gives (its first ``len(out)`` arguments)."""
    outs = [t for t in (out if isinstance(out, tuple) else (out,))]
    return [t for t in (*args[:len(outs)], *outs) if t is not None]


def _modulation_recorders(monkeypatch, seen: list, in_block: list):
    """Record the dtype of every shift/scale/gate tensor a block makes, at the function each family
    makes them in (``in_block[0]``: a block is running; the heads' own modulation is not counted)."""
    import videodit.models.ltx2.block as ltx2_block
    import videodit.models.mmdit.model as mmdit_model
    import videodit.models.stdit.model as stdit_model
    import videodit.models.wan.model as wan_model

    def wrap(module, name, tensors):
        original = getattr(module, name)

        def recording(*args, **kwargs):
            out = original(*args, **kwargs)
            if in_block[0]:
                seen.extend(t.dtype for t in tensors(args, out))
            return out
        monkeypatch.setattr(module, name, recording)

    wrap(wan_model, "split_modulation", lambda args, out: out)
    wrap(ltx2_block, "rows", lambda args, out: out)
    wrap(stdit_model, "modulate", lambda args, out: args[1:])        # (x, shift, scale)
    wrap(mmdit_model.Modulation, "forward", lambda args, out: out)


@pytest.mark.parametrize("family", list(REFERENCE))
def test_residual_stream_and_modulation_keep_the_reference_dtypes_under_bf16(family, monkeypatch):
    build, residual, modulation = REFERENCE[family]
    torch.manual_seed(0)
    model, run = build()
    streams, mods, in_block = [], [], [False]
    _modulation_recorders(monkeypatch, mods, in_block)

    def enter(block, args):
        in_block[0] = True

    def leave(block, args, out):
        in_block[0] = False
        streams.append([t.dtype for t in _streams(block, args, out)])
    hooks = [hook for block in model.blocks
             for hook in (block.register_forward_pre_hook(enter), block.register_forward_hook(leave))]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        run()
    for hook in hooks:
        hook.remove()
    assert len(streams) == len(model.blocks) and mods
    assert all(dtype == residual for block in streams for dtype in block), streams
    assert set(mods) == {modulation}


@pytest.mark.parametrize("family", ["stdit", "mmdit-no-frame-given"])
def test_fp32_forward_stays_fp32(family):
    """Without autocast every family's stream and modulation stay fp32 (the casts above are no-ops)."""
    build = REFERENCE[family][0]
    torch.manual_seed(0)
    model, run = build()
    dtypes = set()
    hooks = [block.register_forward_hook(lambda block, args, out: dtypes.update(t.dtype for t in
                                                                               _streams(block, args, out)))
             for block in model.blocks]
    with torch.no_grad():
        out = run()
    for hook in hooks:
        hook.remove()
    assert dtypes == {FP32} and out.dtype == FP32
