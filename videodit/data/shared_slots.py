"""Shared-memory batch buffers that DataLoader workers reuse instead of allocating per batch.

A worker's batch reaches the main process through shared memory. Fresh shared memory costs
the worker a zero-filled allocation and a page fault per 4 KiB page it writes, and the main
process a new mapping and a fault per page it reads: for a batch of four 832x480 x 33-frame
uint8 clips, 410 ms against 97 ms for writing a buffer already mapped (2-core VM), about as
much as decoding the clips. Torch has no way to reuse them: only the main process knows when
a batch is no longer used.

So each worker keeps a few buffers ("slots"), and the main process says when one is free:

* a ``SlotBoard``, made in the main process before the workers start and handed to them inside
  the dataset, holds one shared flag per (worker, slot);
* a worker takes a free slot (big enough, else it grows one), marks it busy, writes the batch
  into it and sends it with a ``Lease`` naming the slot;
* the main process, as the batch arrives (``Lease.arrived``), keeps the slot's storage mapped
  (the next batch in it arrives with no new mapping) and marks the slot free again once
  nothing but its own record uses that storage: torch's use count of the storage drops to one
  when every tensor, view and NumPy array of the batch is gone (a pinned copy included: pinning
  releases the slot). Checked whenever a batch arrives.

A worker that finds no free slot allocates fresh shared memory as before: nothing ever waits.
Without ``torch._C._storage_Use_Count`` (another torch) no board is made and nothing changes.
"""

from __future__ import annotations

import itertools
import math
import os
import secrets
import threading
import weakref
from dataclasses import dataclass

import torch

FREE, BUSY = 0, 1

_use_count = getattr(torch._C, "_storage_Use_Count", None)
_LOCK = threading.Lock()
_FLAGS: dict[str, tuple[int, object]] = {}   # token -> (pid, flags as NumPy) of the board made in process pid
_HELD: dict[tuple[str, int, int], "_Held"] = {}   # (token, worker, slot) -> the slot's storage, mapped here
_ALLOCATIONS = itertools.count()


def available() -> bool:
    return _use_count is not None


def fresh_shared(shape: tuple[int, ...]) -> torch.Tensor:
    """Contiguous uint8 ``shape`` in new shared memory (what torch's collate allocates per batch)."""
    return _over(torch.UntypedStorage._new_shared(math.prod(shape)), shape)


def _over(storage: torch.UntypedStorage, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous uint8 tensor over the start of ``storage``, itself no view (``_base`` None)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, shape)


@dataclass(frozen=True)
class Lease:
    """A batch's claim on a worker's slot; travels with the batch to the main process."""

    token: str
    worker: int
    slot: int
    allocation: tuple[int, int]   # (worker pid, number): which buffer the slot holds now

    def arrived(self, video: torch.Tensor) -> None:
        """In the main process, as the batch whose ``video`` lives in the slot is unpickled: hold
        the slot's storage, mark it in use, and free the slots nothing uses any more."""
        pid, _ = _FLAGS.get(self.token, (None, None))
        if pid != os.getpid():   # unpickled elsewhere than where the board was made: nothing to do
            return
        storage = video.untyped_storage()
        key = (self.token, self.worker, self.slot)
        with _LOCK:
            held = _HELD.get(key)
            if held is None or held.allocation != self.allocation:   # a new or grown buffer
                held = _HELD[key] = _Held(self.allocation, storage)
            elif held.storage.data_ptr() != storage.data_ptr():   # a copy of the batch (deepcopy)
                return
            held.busy = True
            _release_unused()


@dataclass
class _Held:
    allocation: tuple[int, int]
    storage: torch.UntypedStorage
    busy: bool = True


def _release_unused() -> None:
    """Mark free every busy slot whose storage only ``_HELD`` refers to (under ``_LOCK``)."""
    for (token, worker, slot), held in _HELD.items():
        if held.busy and _use_count(held.storage._cdata) == 1:
            held.busy = False
            _FLAGS[token][1][worker, slot] = FREE


def _forget(token: str) -> None:
    with _LOCK:
        _FLAGS.pop(token, None)
        for key in [key for key in _HELD if key[0] == token]:
            del _HELD[key]


class SlotBoard:
    """``keep`` reusable batch buffers per worker for ``num_workers`` workers. Made in the main
    process before the workers start; ``take`` is called in the workers."""

    def __init__(self, num_workers: int, keep: int):
        self.token = secrets.token_hex(8)
        self.keep = keep
        self.flags = torch.zeros(num_workers, keep, dtype=torch.uint8).share_memory_()
        self._mine: _WorkerSlots | None = None
        _FLAGS[self.token] = (os.getpid(), self.flags.numpy())
        weakref.finalize(self, _forget, self.token)

    def __getstate__(self) -> dict:   # to a spawned worker: the flags, not this process's slots
        return {**self.__dict__, "_mine": None}

    def take(self, worker: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, Lease | None]:
        """In worker ``worker``: contiguous uint8 shared memory of ``shape`` for a batch, and its
        lease (None: fresh memory, no slot was free)."""
        if self._mine is None or self._mine.pid != os.getpid():   # a forked copy starts empty
            self._mine = _WorkerSlots(self.flags[worker].numpy(), self.keep)
        slot, allocation = self._mine.take(math.prod(shape))
        if slot is None:
            return fresh_shared(shape), None
        return _over(self._mine.buffers[slot], shape), Lease(self.token, worker, slot, allocation)


class _WorkerSlots:
    """One worker's slots: its buffers, and its row of the board's flags."""

    def __init__(self, flags, keep: int):
        self.pid = os.getpid()
        self.flags = flags
        self.buffers: list[torch.UntypedStorage | None] = [None] * keep
        self.allocations: list[tuple[int, int] | None] = [None] * keep

    def take(self, nbytes: int) -> tuple[int | None, tuple[int, int] | None]:
        """A free slot holding at least ``nbytes`` (the smallest such), else a free slot given a
        new buffer of ``nbytes`` (an empty one first, then the smallest); None if none is free.
        Flags still busy from a worker that held this row before are left to the main process."""
        free = [k for k, flag in enumerate(self.flags) if flag == FREE]
        fits = [k for k in free if self.buffers[k] is not None and self.buffers[k].nbytes() >= nbytes]
        if fits:
            slot = min(fits, key=lambda k: self.buffers[k].nbytes())
        elif free:
            slot = min(free, key=lambda k: -1 if self.buffers[k] is None else self.buffers[k].nbytes())
            self.buffers[slot] = None   # the old buffer goes before the new one is made
            self.buffers[slot] = torch.UntypedStorage._new_shared(nbytes)
            self.allocations[slot] = (self.pid, next(_ALLOCATIONS))
        else:
            return None, None
        self.flags[slot] = BUSY
        return slot, self.allocations[slot]
