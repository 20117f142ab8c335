"""A deterministic, resumable bucket batch sampler split across data-parallel ranks.

Every epoch, each sample is assigned to a bucket (or dropped) by a deterministic function
of (seed, epoch, sample) — see ``data/buckets/``. Within a bucket the samples are
shuffled and cut into batches of that bucket's batch size; the incomplete last batch of
each bucket is dropped (``drop_last``: a batch must have one shape and one size). All
batches of the epoch are then shuffled into one *global* order.

Ranks take global batches round-robin: rank r gets global batches r, r + dp, r + 2 dp, ...
The tail that would leave ranks with unequal counts is dropped, so every rank takes the
same number of steps. Everything is computed from (seed, epoch) on every rank without
communication; ranks of one sequence/tensor-parallel group pass the same ``dp_rank`` and
so receive identical batches.

The position is the number of *global* batches consumed in the epoch. Resuming at a
different data-parallel size continues from the same global batch: within the epoch no
sample is seen twice and none is skipped (except the usual unequal tail).

The sampler yields lists of ``(index, epoch, bucket)`` keys: the dataset decodes at the
bucket's shape and seeds its per-sample randomness from the key, which keeps data
bitwise reproducible on resume, with or without DataLoader workers.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

import numpy as np

from videodit.errors import UserError

AssignFn = Callable[[int], np.ndarray]   # epoch -> bucket per sample (-1 = dropped)


class BucketBatchSampler:
    def __init__(self, assign: AssignFn, batch_sizes: Sequence[int], *, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1, fingerprint: str = ""):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside dp_size={dp_size}")
        self.assign = assign
        self.batch_sizes = list(batch_sizes)
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.fingerprint = fingerprint
        self.epoch = 0
        self.offset = 0            # global batches of ``epoch`` already consumed
        self._plan: tuple[int, list[tuple[int, np.ndarray]]] | None = None

    # ------------------------------------------------------------------ the epoch plan

    def global_batches(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """All (bucket, sample indices) batches of ``epoch`` in global order (cached)."""
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, self._make_plan(epoch))
        return self._plan[1]

    def _make_plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        buckets = np.asarray(self.assign(epoch))
        rng = np.random.default_rng([self.seed, epoch])
        batches = []
        for bucket in np.unique(buckets[buckets >= 0]):
            members = np.flatnonzero(buckets == bucket)
            members = members[rng.permutation(len(members))]
            size = self.batch_sizes[bucket]
            for start in range(0, len(members) - size + 1, size):
                batches.append((int(bucket), members[start : start + size]))
        order = rng.permutation(len(batches))
        return [batches[i] for i in order]

    def steps_in_epoch(self, epoch: int, offset: int = 0) -> int:
        """Batches each rank takes in ``epoch`` starting at global batch ``offset``."""
        return max(len(self.global_batches(epoch)) - offset, 0) // self.dp_size

    def __len__(self) -> int:
        """Batches this rank yields from the current position to the end of the epoch."""
        return self.steps_in_epoch(self.epoch, self.offset)

    # ------------------------------------------------------------------ position

    def set_position(self, epoch: int, offset: int = 0) -> None:
        """The next iteration yields ``epoch`` from its ``offset``-th global batch."""
        self.epoch, self.offset = epoch, offset

    def __iter__(self):
        epoch, offset = self.epoch, self.offset
        remaining = self.global_batches(epoch)[offset:]
        usable = len(remaining) // self.dp_size * self.dp_size
        for bucket, indices in remaining[self.dp_rank : usable : self.dp_size]:
            yield [(int(i), epoch, bucket) for i in indices]

    def state_dict(self, epoch: int, offset: int) -> dict:
        return {"epoch": epoch, "offset": offset, "dp_size": self.dp_size, "seed": self.seed,
                "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict, on_change: str = "error") -> tuple[int, int]:
        """Check a saved position against this sampler; returns the (epoch, offset) to resume at.

        A changed dataset or bucket config makes the saved offset meaningless: with
        ``on_change="error"`` that is a UserError saying so; with ``"restart_epoch"`` the
        saved epoch starts over from its first batch.
        """
        epoch, offset = int(state["epoch"]), int(state["offset"])
        changed = [what for what, saved, now in (("seed", state.get("seed"), self.seed),
                                                 ("dataset or bucket config", state.get("fingerprint"),
                                                  self.fingerprint)) if saved != now]
        if changed:
            if on_change != "restart_epoch":
                raise UserError(f"the {' and '.join(changed)} changed since the checkpoint, so its data "
                                "position no longer applies; set data.on_change=restart_epoch to restart "
                                f"epoch {epoch} from its first batch")
            return epoch, 0
        return epoch, min(offset, len(self.global_batches(epoch)))


def fingerprint(*parts) -> str:
    """A short digest of whatever defines the epoch plan (dataset rows, bucket config)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(repr(part).encode())
        digest.update(b"\x00")
    return digest.hexdigest()[:16]
