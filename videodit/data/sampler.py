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

The plan is computed over index arrays (``make_epoch_plan``): 10M samples in 626 buckets take
about a second, and the position saved in a checkpoint is two numbers, not a list of samples.

The position is the number of *global* batches consumed in the epoch. Resuming at a
different data-parallel size continues from the same global batch: within the epoch no
sample is seen twice and none is skipped (except the usual unequal tail).

The sampler yields lists of ``(index, epoch, bucket)`` keys: the dataset decodes at the
bucket's shape and seeds its per-sample randomness from the key, which keeps data
bitwise reproducible on resume, with or without DataLoader workers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

import numpy as np

from videodit.errors import UserError

AssignFn = Callable[[int], np.ndarray]   # epoch -> bucket per sample (-1 = dropped)
_CODE = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()   # shared plans of other code are not used


class EpochPlan(Sequence):
    """One epoch's global batches as flat arrays, no Python object per sample or batch.

    ``members`` holds the batched sample indices bucket by bucket (each bucket shuffled);
    global batch ``g`` is ``members[start[g] : start[g] + size[g]]`` from bucket ``bucket[g]``.
    Indexing gives ``(bucket, indices)`` as the list of batches used to.
    """

    def __init__(self, members: np.ndarray, start: np.ndarray, size: np.ndarray, bucket: np.ndarray):
        self.members, self.start, self.size, self.bucket = members, start, size, bucket

    def arrays(self) -> dict:
        return {"members": self.members, "start": self.start, "size": self.size, "bucket": self.bucket}

    def __len__(self) -> int:
        return len(self.start)

    def __getitem__(self, g):
        if isinstance(g, slice):
            return [self[i] for i in range(*g.indices(len(self)))]
        start = int(self.start[g])
        return int(self.bucket[g]), self.members[start : start + int(self.size[g])]


def make_epoch_plan(buckets: np.ndarray, batch_sizes: Sequence[int], seed: int, epoch: int) -> EpochPlan:
    """Shuffle each bucket, cut it into full batches, shuffle the batches: the same random
    stream, in the same order of calls, as the loop over buckets this replaces, so the same
    batches come out (``tests/data/test_sampler.py`` holds that loop as the reference)."""
    buckets = np.asarray(buckets)
    rng = np.random.default_rng([seed, epoch])
    ids = buckets.astype(np.int16 if len(batch_sizes) < 2**15 else np.int32)   # int16 sorts by radix: O(n)
    grouped = np.argsort(ids, kind="stable")   # dropped (-1) first, then by bucket, each by index
    edges = np.searchsorted(ids[grouped], np.arange(-1, len(batch_sizes) + 1, dtype=ids.dtype))
    counts, lo = np.diff(edges)[1:], int(edges[1])
    del ids
    index = np.int32 if len(buckets) < 2**31 else np.int64
    members, starts, sizes, ids, done = [], [], [], [], 0
    for bucket in np.flatnonzero(counts):
        count, size = int(counts[bucket]), batch_sizes[bucket]
        group = grouped[lo : lo + count][rng.permutation(count)]
        lo, full = lo + count, count // size * size
        members.append(group[:full].astype(index))
        starts.append(done + np.arange(0, full, size, dtype=np.int64))
        sizes.append(np.full(full // size, size, np.int64))
        ids.append(np.full(full // size, bucket, np.int32))
        done += full
    join = lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype)
    starts, sizes, ids = join(starts, np.int64), join(sizes, np.int64), join(ids, np.int32)
    order = rng.permutation(len(starts))
    return EpochPlan(join(members, index), starts[order], sizes[order], ids[order])


class BucketBatchSampler:
    """``share(name, build)`` (``Metadata.shared``), when given, makes each epoch's plan once per
    node and maps it on every rank; ``share_key`` names the assignment it comes from."""

    def __init__(self, assign: AssignFn, batch_sizes: Sequence[int], *, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1, fingerprint: str = "",
                 legacy_fingerprint: Callable[[], str] | None = None,
                 share: Callable[[str, Callable[[], dict]], dict] | None = None, share_key: str = ""):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} outside dp_size={dp_size}")
        self.assign = assign
        self.batch_sizes = list(batch_sizes)
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.fingerprint = fingerprint
        self.legacy_fingerprint = legacy_fingerprint
        self.share, self.share_key = share, share_key
        self.epoch = 0
        self.offset = 0            # global batches of ``epoch`` already consumed
        self._plan: tuple[int, EpochPlan] | None = None

    # ------------------------------------------------------------------ the epoch plan

    def global_batches(self, epoch: int) -> EpochPlan:
        """All (bucket, sample indices) batches of ``epoch`` in global order (cached)."""
        if self._plan is None or self._plan[0] != epoch:
            self._plan = None   # free the old plan first
            make = lambda: make_epoch_plan(self.assign(epoch), self.batch_sizes, self.seed, epoch)
            if self.share is None:
                self._plan = (epoch, make())
            else:
                key = fingerprint(self.share_key, self.seed, self.batch_sizes, _CODE)
                self._plan = (epoch, EpochPlan(**self.share(f"plan-{key}-epoch{epoch}", lambda: make().arrays())))
        return self._plan[1]

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
        plan = self.global_batches(epoch)
        usable = max(len(plan) - offset, 0) // self.dp_size * self.dp_size
        for g in range(offset + self.dp_rank, offset + usable, self.dp_size):
            bucket, indices = plan[g]
            yield [(i, epoch, bucket) for i in indices.tolist()]

    def state_dict(self, epoch: int, offset: int) -> dict:
        return {"epoch": epoch, "offset": offset, "dp_size": self.dp_size, "seed": self.seed,
                "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict, on_change: str = "error") -> tuple[int, int]:
        """Check a saved position against this sampler; returns the (epoch, offset) to resume at.

        A changed dataset or bucket config makes the saved offset meaningless: with
        ``on_change="error"`` that is a UserError saying so; with ``"restart_epoch"`` the
        saved epoch starts over from its first batch. A checkpoint written before the
        columnar metadata reader holds the old kind of fingerprint, checked against
        ``legacy_fingerprint()`` (computed only then).
        """
        epoch, offset = int(state["epoch"]), int(state["offset"])
        saved = state.get("fingerprint")
        same_data = saved == self.fingerprint or (
            self.legacy_fingerprint is not None and isinstance(saved, str) and len(saved) == 16
            and saved == self.legacy_fingerprint())
        changed = [what for what, differs in (("seed", state.get("seed") != self.seed),
                                              ("dataset or bucket config", not same_data)) if differs]
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
