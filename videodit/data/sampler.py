"""A deterministic, resumable batch sampler split across data-parallel ranks.

Each epoch's order is a permutation drawn from (seed, epoch), so every rank computes the
same plan without communicating, and a resumed run re-creates it exactly. Batches are
dealt round-robin to the ``dp_size`` ranks; the tail that would give ranks unequal counts
is dropped (``drop_last``), so every rank takes the same number of steps.

The sampler yields lists of ``(index, epoch)`` keys: the dataset seeds its per-sample
randomness (temporal window) from them, which keeps the data bitwise reproducible on
resume even with DataLoader workers.
"""

from __future__ import annotations

import numpy as np

from videodit.errors import UserError


class BatchSampler:
    def __init__(self, num_samples: int, batch_size: int, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1):
        if num_samples < batch_size * dp_size:
            raise UserError(f"the dataset has {num_samples} usable samples, fewer than one global batch "
                            f"({batch_size} x {dp_size} ranks); lower train.batch_size or add data")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.epoch = 0
        self.start_batch = 0

    def __len__(self) -> int:
        """Batches this rank yields in a full epoch."""
        return self.num_samples // (self.batch_size * self.dp_size)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch``, in order."""
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        global_batches = len(self) * self.dp_size
        batches = order[: global_batches * self.batch_size].reshape(global_batches, self.batch_size)
        return batches[self.dp_rank :: self.dp_size].tolist()

    def set_position(self, epoch: int, batch: int = 0) -> None:
        """The next iteration yields ``epoch`` starting at its ``batch``-th batch."""
        self.epoch, self.start_batch = epoch, batch

    def __iter__(self):
        epoch = self.epoch
        for batch in self.epoch_batches(epoch)[self.start_batch :]:
            yield [(index, epoch) for index in batch]
