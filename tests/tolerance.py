"""Comparing computed floating-point values with expected ones, with bounds that hold everywhere.

A fixture recorded on one machine is reproduced on another only up to rounding: a different CPU,
BLAS build, thread count or torch/transformers release sums in another order. So a comparison
of computed floats against a stored fixture (or of two different computations of the same value)
is the largest deviation relative to the expected tensor's largest magnitude, checked against a
bound set a stated factor above the worst deviation measured across environments
(docs/testing.md lists them and the figures). Exact comparisons stay where exactness holds by
construction: copies, round trips of stored bytes, integer arithmetic.

Two switches serve the measurement:

* ``VIDEODIT_DEVIATIONS=FILE`` makes a measuring run: every comparison appends its deviation to
  FILE as a JSON line (test, what, deviation, bound) and none fails, so one run measures them all.
  That is how the bounds' figures were collected, and how they are measured again after a release
  (``scripts/measure_deviations.py`` gathers the worst per comparison);
* ``VIDEODIT_PERTURB=F`` moves the computed value's largest element by F times the bound before
  comparing: with F = 10 every comparison must fail (a test keeps its teeth).
"""

from __future__ import annotations

import json
import os

import torch


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float64 (where ``want`` is all zero: max |got|)."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != expected {tuple(want.shape)}"
    if not want.numel():
        return 0.0
    scale = float(want.abs().max()) or 1.0
    return float((got - want).abs().max()) / scale


def assert_close(got: torch.Tensor, want: torch.Tensor, bound: float, what: str = "") -> float:
    """Assert ``relative(got, want) <= bound``; returns the deviation."""
    got = _perturbed(torch.as_tensor(got).double(), torch.as_tensor(want), bound)
    deviation = relative(got, want)
    if _record(what, deviation, bound):
        return deviation
    assert deviation <= bound, f"{what or 'value'}: relative deviation {deviation:.3g} > {bound:.3g}"
    return deviation


def _perturbed(got: torch.Tensor, want: torch.Tensor, bound: float) -> torch.Tensor:
    factor = float(os.environ.get("VIDEODIT_PERTURB", 0))
    if not factor:
        return got
    got = got.clone(memory_format=torch.contiguous_format)   # a view of any layout: outputs may be strided
    flat = got.view(-1)
    flat[flat.abs().argmax()] += factor * bound * (float(want.abs().max()) or 1.0)
    return got


def _record(what: str, deviation: float, bound: float) -> bool:
    """Append the deviation in a measuring run (True), else nothing (False)."""
    path = os.environ.get("VIDEODIT_DEVIATIONS")
    if not path:
        return False
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    with open(path, "a") as out:
        out.write(json.dumps({"test": test, "what": what, "deviation": deviation, "bound": bound}) + "\n")
    return True
