"""Measure tensor memory on any device, CPU included: the ruler the planner is checked with.

:class:`LiveMemory` is a ``TorchDispatchMode`` that sees every tensor an op creates while
it is active and keeps a weak reference to its storage. "Live" bytes are those of storages
created under the mode that are still alive; the peak is taken after every op. Unlike
``saved_tensors_hooks`` it also sees what non-reentrant activation checkpointing keeps
(the checkpointed block's inputs) and the temporaries of backward. On CUDA,
``torch.cuda.max_memory_allocated`` is the ground truth; this is what CPU tests have.

:func:`measure_step` runs one forward/backward/optimizer step and splits the memory the
way the planner predicts it: parameters, gradients, optimizer state, activations (held
from the end of forward until backward starts) and the peak.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from videodit.data.dataset import Batch
from videodit.models.lora import adapter_parameters


class LiveMemory(TorchDispatchMode):
    """Bytes of storages created by ops under this mode that are still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self._storages: dict[StorageWeakRef, int] = {}
        self.peak = 0

    @property
    def live(self) -> int:
        for ref in [ref for ref in self._storages if ref.expired()]:
            del self._storages[ref]
        return sum(self._storages.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # A view shares its input's storage: parameters seen through ``.t()`` are not new memory.
        inputs = {StorageWeakRef(t.untyped_storage()) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                ref = StorageWeakRef(tensor.untyped_storage())
                if ref not in inputs:
                    self._storages.setdefault(ref, tensor.untyped_storage().nbytes())
        self.peak = max(self.peak, self.live)
        return out


@dataclass
class StepMemory:
    params: int
    grads: int
    optimizer: int
    activations: int    # held between the end of forward and the start of backward
    peak: int           # everything the step allocated at its worst moment, parameters excluded

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among ``tensors`` (the local shard of a DTensor; the inner
    tensors of a wrapper subclass such as torchao's 8-bit optimizer states)."""
    seen: dict[int, int] = {}
    for t in _plain(tensors):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _plain(tensors):
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
            names, _ = t.__tensor_flatten__()
            yield from _plain(getattr(t, name) for name in names)
        else:
            yield t


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0)


def measure_step(model: torch.nn.Module, forward_loss: Callable[[], torch.Tensor],
                 optimizer: torch.optim.Optimizer) -> StepMemory:
    """One training step under :class:`LiveMemory`. ``forward_loss`` runs the forward and
    returns the scalar loss; gradients and optimizer state are created by this step (the
    optimizer must not have stepped yet)."""
    params = list(model.parameters())
    for p in params:
        p.grad = None
    # Compiled code does not run under a dispatch mode (torchao's 8-bit AdamW compiles its step):
    # eager gives the same tensors.
    with torch.compiler.set_stance("force_eager"), LiveMemory() as tracker:
        loss = forward_loss()
        # Reference cycles that forward left behind are garbage, not activations; whether
        # Python's collector has run yet is chance.
        gc.collect()
        activations = tracker.live
        loss.backward()
        del loss
        optimizer.step()
    grads = tensor_bytes(p.grad for p in params)
    return StepMemory(params=tensor_bytes(params), grads=grads, optimizer=optimizer_bytes(optimizer),
                      activations=activations, peak=tracker.peak)


def synthetic_batch(batch: int, num_frames: int, height: int, width: int, fps: float = 8.0) -> Batch:
    """A training batch (random pixels, one toy caption) for memory trials."""
    generator = torch.Generator().manual_seed(0)
    return Batch(video=torch.rand(batch, 3, num_frames, height, width, generator=generator) * 2 - 1,
                 text=["a red circle moving left"] * batch, fps=torch.full((batch,), float(fps)))


def measure_trainer(trainer, batch: Batch) -> StepMemory:
    """One step of a freshly built Trainer (its model, parallelism, levers and optimizer)."""
    return measure_step(trainer.model, lambda: trainer.loss(batch), trainer.optimizer)



@dataclass
class DistillMemory:
    """A DMD2 step: the bytes each role holds before it (``roles``, read off the tensors) and the
    peak of what the step itself allocates (``step_peak``, :class:`LiveMemory`: gradients,
    activations, transients; the student's gradients are freed before the critic's are made)."""
    roles: dict[str, int]
    step_peak: int
    activations: int    # held when the student's graded forward and its scoring end (before its backward)

    @property
    def peak(self) -> int:
        return sum(self.roles.values()) + self.step_peak


def measure_distill_step(trainer, batch: Batch, warm_steps: int = 1) -> DistillMemory:
    """One DMD2 step of a freshly built Trainer (``trainer.distill``) on ``batch``, after
    ``warm_steps`` unmeasured ones (the optimizers' state then exists: the steady state). The
    trainer's step counter stays where it is: at 0 every step is one of the student's turns."""
    dmd = trainer.distill
    for _ in range(warm_steps):
        dmd.train_step([batch])
    ema = [] if trainer.ema is None else list(trainer.ema.shadow.values())
    critic = adapter_parameters(dmd.critic.local_model, dmd.critic_adapter)   # a shared base: its adapter
    mine = {id(p) for p in critic} if dmd.shared_base else set()
    roles = {"student weights": tensor_bytes(p for p in trainer.model.parameters() if id(p) not in mine),
             "student optimizer": optimizer_bytes(trainer.optimizer), "student EMA": tensor_bytes(ema),
             "critic weights": tensor_bytes(critic),
             "critic optimizer": optimizer_bytes(dmd.critic_optimizer),
             "teacher": 0 if dmd.shared_base else tensor_bytes(dmd.teacher.parameters()),
             "frozen encoders": 0 if trainer.text is None else
             tensor_bytes([*trainer.text.parameters(), *trainer.text.buffers()])}
    held = {}
    original = dmd._dmd_gradient

    def scoring(*args, **kwargs):   # the student's graded activations, while teacher and critic score
        gc.collect()
        held["activations"] = tracker.live
        return original(*args, **kwargs)

    gc.collect()
    dmd._dmd_gradient = scoring
    try:
        with torch.compiler.set_stance("force_eager"), LiveMemory() as tracker:
            dmd.train_step([batch])
    finally:
        del dmd._dmd_gradient
    return DistillMemory(roles, tracker.peak, held.get("activations", 0))
