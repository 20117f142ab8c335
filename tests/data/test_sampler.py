"""The bucket batch sampler: rank splits, equal counts, exact resume at any DP size."""

import numpy as np
import pytest

from videodit.data.sampler import BucketBatchSampler
from videodit.errors import UserError

BATCH_SIZES = [4, 3, 2]


def assign(epoch):
    """A stand-in bucket assignment: 200 samples over 3 buckets, some dropped, re-drawn per epoch."""
    rng = np.random.default_rng([99, epoch])
    return rng.choice([-1, 0, 1, 2], size=200, p=[0.1, 0.4, 0.3, 0.2])


def make(rank=0, size=1, seed=0, fp="data-v1"):
    return BucketBatchSampler(assign, BATCH_SIZES, seed=seed, dp_rank=rank, dp_size=size, fingerprint=fp)


def run_epoch(sampler, epoch, offset=0):
    sampler.set_position(epoch, offset)
    return list(sampler)


def test_batches_hold_one_bucket_at_its_batch_size():
    for batch in run_epoch(make(), 0):
        buckets = {bucket for _, _, bucket in batch}
        assert len(buckets) == 1
        bucket = buckets.pop()
        assert len(batch) == BATCH_SIZES[bucket]
        assert all(assign(0)[index] == bucket for index, _, _ in batch)


@pytest.mark.parametrize("epoch", [0, 1, 2])
def test_four_ranks_get_disjoint_batches_with_equal_counts(epoch):
    ranks = [make(rank, 4) for rank in range(4)]
    per_rank = [run_epoch(s, epoch) for s in ranks]
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1 and counts.pop() == len(ranks[0])
    seen = [index for batches in per_rank for batch in batches for index, _, _ in batch]
    assert len(seen) == len(set(seen))
    # Together the ranks cover the single-rank epoch except the unequal tail (< 4 batches).
    single = run_epoch(make(), epoch)
    assert len(single) - 4 < sum(len(b) for b in per_rank) <= len(single)


def test_order_is_reshuffled_each_epoch_and_reproducible():
    first = run_epoch(make(), 0)
    assert first == run_epoch(make(), 0)
    assert first != run_epoch(make(), 1)
    assert first != run_epoch(make(seed=1), 0)


def test_len_is_exact_and_follows_the_position():
    sampler = make(1, 3)
    sampler.set_position(2, 0)
    assert len(sampler) == len(list(sampler))
    sampler.set_position(2, 9)
    assert len(sampler) == len(list(sampler))


def consumed(batches):
    return [i for batch in batches for i, _, _ in batch]


@pytest.mark.parametrize("before, after", [(2, 2), (4, 2), (2, 4), (4, 1), (1, 3)])
def test_mid_epoch_resume_at_any_dp_size_sees_each_sample_once(before, after):
    epoch = 1
    # Ranks at `before` take k steps each, then save.
    k = 5
    old = [make(r, before) for r in range(before)]
    first = [run_epoch(s, epoch)[:k] for s in old]
    state = old[0].state_dict(epoch, offset=k * before)
    # Resume at `after` ranks.
    new = [make(r, after) for r in range(after)]
    resumed_epoch, offset = new[0].load_state_dict(state)
    assert (resumed_epoch, offset) == (epoch, k * before)
    rest = [run_epoch(s, epoch, offset) for s in new]

    seen = consumed(b for batches in first for b in batches) + consumed(b for batches in rest for b in batches)
    assert len(seen) == len(set(seen)), "a sample was seen twice"
    plan = make().global_batches(epoch)
    remaining = len(plan) - offset
    tail = plan[offset + remaining // after * after :]          # fewer than `after` batches
    assert len(tail) < after
    expected = {int(i) for _, idx in plan[: len(plan) - len(tail)] for i in idx}
    assert set(seen) == expected, "a sample was skipped"


def test_changed_dataset_is_explained_or_restarts_the_epoch():
    state = make().state_dict(3, 12)
    changed = make(fp="data-v2")
    with pytest.raises(UserError, match="dataset or bucket config changed since the checkpoint.*data.on_change"):
        changed.load_state_dict(state)
    assert changed.load_state_dict(state, on_change="restart_epoch") == (3, 0)
    with pytest.raises(UserError, match="seed"):
        make(seed=5).load_state_dict(state)


def reference_plan(buckets, batch_sizes, seed, epoch):
    """The loop over buckets the vectorized plan replaced: its batches, in its order."""
    rng = np.random.default_rng([seed, epoch])
    batches = []
    for bucket in np.unique(buckets[buckets >= 0]):
        members = np.flatnonzero(buckets == bucket)
        members = members[rng.permutation(len(members))]
        size = batch_sizes[bucket]
        for start in range(0, len(members) - size + 1, size):
            batches.append((int(bucket), members[start : start + size]))
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]


@pytest.mark.parametrize("trial", range(6))
def test_plan_is_the_bucket_loop_batch_for_batch(trial):
    rng = np.random.default_rng(trial)
    num_buckets = [1, 3, 626, 626, 40, 2][trial]
    n = [0, 50, 20_000, 3_000, 10_000, 7][trial]
    buckets = rng.integers(-1, num_buckets, n).astype(np.int32)
    sizes = [int(s) for s in rng.integers(1, 40, num_buckets)]
    sampler = BucketBatchSampler(lambda epoch: buckets, sizes, seed=trial)
    got, want = sampler.global_batches(trial % 3), reference_plan(buckets, sizes, trial, trial % 3)
    assert len(got) == len(want)
    assert all(b == c and np.array_equal(i, j) for (b, i), (c, j) in zip(got, want))
    sampler.set_position(trial % 3, 0)
    assert [[i for i, _, _ in batch] for batch in sampler] == [list(i) for _, i in want]


def test_a_shared_plan_is_made_once_and_is_the_same_plan():
    made = []
    store = {}

    def share(name, build):   # stands in for Metadata.shared: made once, then the same arrays
        if name not in store:
            made.append(name)
            store[name] = {key: np.array(value) for key, value in build().items()}
        return store[name]

    for epoch in (0, 1, 0):
        shared = BucketBatchSampler(assign, BATCH_SIZES, seed=3, share=share, share_key="k", dp_rank=1, dp_size=2)
        alone = BucketBatchSampler(assign, BATCH_SIZES, seed=3, dp_rank=1, dp_size=2)
        assert run_epoch(shared, epoch) == run_epoch(alone, epoch)
    assert len(made) == 2
