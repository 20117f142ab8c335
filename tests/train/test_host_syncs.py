"""No hidden host-device synchronisation in a training step (issue #40: a sync stalls the host
until the device has drained its queue, so the next step's kernels are launched late).

On CPU nothing waits, so the test counts the calls that would wait on an accelerator, from
inside the step: every ``aten._local_scalar_dense`` (what ``.item()``, ``bool(t)``,
``float(t)``, ``int(t)`` and ``if t:`` run), every op whose output size depends on the data
(``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``, ...: all seen by a
``TorchDispatchMode``), and the Python-level reads ``.tolist()``, ``.numpy()``, ``.cpu()`` and
``.to("cpu")`` (named as a string: on a CPU run ``.to(ctx.device)`` is a move to the same
device, which is not a read, and cannot be told apart from a move to the host by the device).
Reads of host tensors are not counted: the optimizer's ``step`` counters (torch keeps them on the
host with ``capturable=False``, the default, so Adam's ``_get_value(step)`` waits for nothing) and
the draws of a CPU ``torch.Generator`` (the trainer draws noise, timesteps and Open-Sora 2.0's
condition modes on the host from each batch's seed: ``draw_modes`` reads its uniforms with
``.tolist()`` before anything reaches the device).

A step of ``train.grad_accum`` = k micro-batches makes exactly k + 1 syncs, all designated:

- ``ParallelModel.forward_backward`` reads each micro-batch's scaled loss (``loss.item()``), which
  ``Trainer.train_step`` sums into the step's loss (then averaged over the ranks on the host);
- ``clip_gradients`` reads the global gradient norm (``float(norm)``), which decides whether to
  clip and, with the loss, whether the update is skipped (``train.on_nonfinite``): that check needs
  both on the host every step, log step or not, before ``optimizer.step``.

Nothing else (noise and timestep draws, masks, the model's forward and backward, clipping's
scaling, AdamW, the LR schedule, EMA) reads the device. Every family's path is checked: STDiT
(``tiny``), Wan (``wan-tiny``), Open-Sora 2.0's MMDiT (``mmdit-tiny`` with its frame conditions)
and LTX-2 (``ltx2-tiny``, video), with one and with two micro-batches.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_overrides
from videodit.config import load_config
from videodit.train.trainer import Trainer

_aten = torch.ops.aten
# Ops that read a value to the host (scalar) or size their output by the data.
DATA_DEPENDENT = {name for name in ("_local_scalar_dense", "nonzero", "nonzero_static", "masked_select",
                                    "_unique", "_unique2", "unique_dim", "unique_consecutive",
                                    "repeat_interleave", "is_nonzero", "equal")}
HOST_READS = ("tolist", "numpy", "cpu")


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _site() -> str:
    """Where in videodit (or the test) the sync was asked for: the innermost such frame."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/videodit/" in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
    return "outside videodit"


class SyncCounter(TorchDispatchMode):
    """Records (what, where) for every host-device sync while active; ``host`` tensors (the
    optimizer's step counters) are exempt."""

    def __init__(self, host: list[torch.Tensor] = ()):
        super().__init__()
        self.kept = list(host)   # alive while counting: no device tensor reuses their storage
        self.host = {_storage(t) for t in host}
        self.syncs: list[tuple[str, str]] = []

    def on_host(self, tensor) -> bool:
        return isinstance(tensor, torch.Tensor) and _storage(tensor) in self.host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name == "repeat_interleave" and (kwargs or {}).get("output_size") is not None:
            name = None   # sized by the caller: no read
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            name = "index (boolean mask)"
        if (name in DATA_DEPENDENT or name == "index (boolean mask)") and not (args and self.on_host(args[0])):
            self.syncs.append((name, _site()))
        out = func(*args, **(kwargs or {}))
        generator = (kwargs or {}).get("generator")
        if generator is not None and generator.device.type == "cpu" and isinstance(out, torch.Tensor):
            self.kept.append(out)   # a host generator's draw: on the CPU whatever the run's device
            self.host.add(_storage(out))
        return out


@contextmanager
def counting(host: list[torch.Tensor] = ()):
    """A :class:`SyncCounter` active, with ``Tensor.tolist/numpy/cpu`` and ``Tensor.to(cpu)``
    (which dispatch nothing on a CPU tensor) counted as well."""
    counter = SyncCounter(host)
    originals = {name: getattr(torch.Tensor, name) for name in (*HOST_READS, "to")}

    def read(name):
        def wrapper(self, *args, **kwargs):
            if not counter.on_host(self):
                counter.syncs.append((name, _site()))
            return originals[name](self, *args, **kwargs)
        return wrapper

    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, str) and torch.device(target).type == "cpu":
            counter.syncs.append(("to(cpu)", _site()))
        return originals["to"](self, *args, **kwargs)

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, read(name))
        torch.Tensor.to = to
        with counter:
            yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def test_the_counter_sees_every_kind_of_sync():
    """The counter itself: each way of reading the device is one sync; shape reads, device-side
    reductions and masks that stay tensors are none."""
    x, host = torch.arange(6.0), torch.zeros(())
    with counting([host]) as counter:
        x.sum().item(), bool(x[0] > 0), float(x[1]), int(x[2]), x.tolist(), x.cpu(), x.to("cpu")
        x[x > 2], x.nonzero(), torch.masked_select(x, x > 1), x.unique(), host.item()
        torch.rand(3, generator=torch.Generator().manual_seed(0)).tolist()   # a host draw: no sync
        torch.rand(3).tolist()   # the global generator: counted (on a GPU run it could be anywhere)
        if x.any():
            pass
        torch.where(x > 2, x, 0).sum(), x.shape[0] * 2, x.any(dim=0), torch.isfinite(x).all()
    assert [name for name, _ in counter.syncs] == [
        "_local_scalar_dense", "_local_scalar_dense", "_local_scalar_dense", "_local_scalar_dense", "tolist",
        "cpu", "to(cpu)", "index (boolean mask)", "nonzero", "masked_select", "_unique2", "tolist",
        "_local_scalar_dense"]
    assert {site for _, site in counter.syncs} == {"outside videodit"}


FAMILIES = {"stdit": {}, "wan": {"model.preset": "wan-tiny", "model.depth": 2},
            # Open-Sora 2.0's objective with its frame conditions (masks drawn per sample)
            "mmdit": {"model.preset": "mmdit-tiny", "model.hidden_size": 64, "model.patch_size": "[1,2,2]",
                      "text.dim": 32, "diffusion.shift_rule": "opensora2", "diffusion.prediction": "velocity",
                      "diffusion.loss_space": "velocity", "diffusion.condition_config":
                      "{t2v: 1, i2v_head: 5, i2v_loop: 1, i2v_tail: 1}", "diffusion.no_i2v_ref_loss": "true"},
            "ltx2": {"model.preset": "ltx2-tiny", "model.depth": 2, "model.patch_size": "[1,1,1]", "text.dim": 32,
                     "data.height": 8, "data.width": 8, "diffusion.prediction": "velocity",
                     "diffusion.loss_space": "velocity"}}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_training_step_syncs_only_for_its_loss_and_gradient_norm(toy_dir, tmp_path, family, grad_accum):
    overrides = tiny_overrides(toy_dir, **{"train.batch_size": 2, "train.ema_decay": 0.9, "train.grad_clip": 1e-3,
                                           "train.log_every": 100, "train.max_steps": 100, **FAMILIES[family]})
    trainer = Trainer(load_config("tiny", overrides), tmp_path / "run")
    batches = trainer.batches()
    first = [next(batches) for _ in range(grad_accum)]
    trainer.train_step(first)   # the first step creates the optimizer's state: counted from the second
    micro_batches = [next(batches) for _ in range(grad_accum)]
    steps = [state["step"] for state in trainer.optimizer.state.values() if "step" in state]
    assert steps and all(step.device.type == "cpu" for step in steps)   # host counters, as on a GPU
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with counting(steps) as counter:
        loss, grad_norm = trainer.train_step(micro_batches)

    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())   # a real update
    assert grad_norm > 1e-3   # clipped (the scaling ran inside the counted step)
    want = [("_local_scalar_dense", "parallelize.py", "forward_backward")] * grad_accum \
        + [("_local_scalar_dense", "gradients.py", "clip_gradients")]
    got = [(name, site.split(":")[0], site.split(" ")[-1]) for name, site in counter.syncs]
    assert got == want, counter.syncs
