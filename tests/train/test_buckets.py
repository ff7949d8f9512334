"""The pure batch schedule: buckets, token budget, stride interleaving, per-epoch shuffle.

The skewed mix below reproduces the old runs' failure: with a 49,152-token budget its longest
bucket holds 20% of the samples but makes ~52% of the batches. 10,000 samples, lengths uniform in
  60%: 32..512   15%: 513..1024   5%: 1025..2048   20%: 2049..3072
with boundaries [512, 1024, 2048] (batch sizes 96, 48, 24, 16).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from train.buckets import (
    assign_buckets,
    bucket_layout,
    interleave_order,
    longest_run,
    padded_tokens,
    plan_epoch,
    prefix_share_deviation,
    quantile_boundaries,
)

BUDGET = 49152
SKEWED_BOUNDARIES = [512, 1024, 2048]


def skewed_lengths(n: int = 10_000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    parts = [(0.60, 32, 512), (0.15, 513, 1024), (0.05, 1025, 2048), (0.20, 2049, 3072)]
    lengths = np.concatenate([rng.integers(lo, hi + 1, int(round(share * n))) for share, lo, hi in parts])
    return rng.permutation(lengths)


@pytest.fixture(scope="module")
def skewed():
    lengths = skewed_lengths()
    return lengths, bucket_layout(lengths, SKEWED_BOUNDARIES, BUDGET)


def test_skewed_mix_reproduces_the_old_imbalance(skewed):
    lengths, layout = skewed
    samples_b = layout.samples_per_bucket
    batches_b = layout.batches_per_bucket
    assert samples_b[3] / samples_b.sum() == pytest.approx(0.20)
    assert 0.50 <= batches_b[3] / batches_b.sum() <= 0.54  # the long bucket dominates the batch count
    assert layout.batch_sizes == (96, 48, 24, 16)


def test_interleaving_on_the_skewed_mix(skewed):
    _, layout = skewed
    for seed in range(5):
        order = plan_epoch(layout, seed, epoch=0).bucket_of_batch
        assert longest_run(order) <= 3
        # Every bucket's share of every prefix of >= 50 batches is within 3 points of its epoch share.
        assert prefix_share_deviation(order, min_prefix=50) <= 0.03


def test_the_interleaving_checks_catch_random_and_sequential_orders(skewed):
    # The same batches in a random or sorted order violate both bounds, so the test above can fail.
    _, layout = skewed
    order = plan_epoch(layout, 0, 0).bucket_of_batch
    shuffled = np.random.default_rng(0).permutation(order)
    assert longest_run(shuffled) > 3 and prefix_share_deviation(shuffled, 50) > 0.03
    sequential = np.sort(order)
    assert longest_run(sequential) > 3 and prefix_share_deviation(sequential, 50) > 0.03


def test_every_sample_once_within_budget_and_bucket(skewed):
    lengths, layout = skewed
    plan = plan_epoch(layout, seed=3, epoch=1)
    flat = np.concatenate(plan.batches)
    assert np.array_equal(np.sort(flat), np.arange(lengths.size))
    assert padded_tokens(lengths, plan.batches).max() <= BUDGET
    for batch, bucket in zip(plan.batches, plan.bucket_of_batch, strict=True):
        assert np.all(layout.bucket_of_sample[batch] == bucket)
    assert len(plan) == layout.steps_per_epoch


def test_same_seed_same_order_other_epoch_or_seed_other_order(skewed):
    _, layout = skewed

    def order(seed, epoch):
        return np.concatenate(plan_epoch(layout, seed, epoch).batches)

    assert np.array_equal(order(7, 2), order(7, 2))
    assert plan_epoch(layout, 7, 2).digest == plan_epoch(layout, 7, 2).digest
    assert not np.array_equal(order(7, 2), order(7, 3))
    assert not np.array_equal(order(7, 2), order(8, 2))
    assert plan_epoch(layout, 7, 2).digest != plan_epoch(layout, 7, 3).digest

    # Not only the batch order changes: samples are reshuffled into other batches.
    def groups(seed, epoch):
        return {frozenset(b.tolist()) for b in plan_epoch(layout, seed, epoch).batches}

    assert len(groups(7, 2) & groups(7, 3)) < 0.05 * layout.steps_per_epoch


def test_batch_count_does_not_depend_on_the_shuffle(skewed):
    _, layout = skewed
    counts = {len(plan_epoch(layout, seed, epoch)) for seed in range(3) for epoch in range(3)}
    assert counts == {layout.steps_per_epoch}


def test_boundaries_are_inclusive_upper_edges():
    assert assign_buckets(np.array([1, 512, 513, 1024, 1025, 99999]), [512, 1024]).tolist() == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="strictly increasing"):
        assign_buckets(np.array([1]), [512, 512])


def test_quantile_boundaries_balance_sample_counts():
    lengths = skewed_lengths()
    boundaries = quantile_boundaries(lengths, 4)
    counts = np.bincount(assign_buckets(lengths, boundaries), minlength=4)
    assert len(boundaries) == 3 and counts.min() >= 0.24 * lengths.size
    # Few distinct lengths: repeated quantiles merge, and no boundary sits at the longest length.
    assert quantile_boundaries(np.array([5] * 90 + [9] * 10), 8) == [5]
    assert quantile_boundaries(np.array([7] * 10), 4) == []


def test_sample_longer_than_budget_is_refused():
    with pytest.raises(ValueError, match=r"1 sample\(s\) are longer than data.token_budget=100 \(longest 101"):
        bucket_layout(np.array([10, 101, 50]), [], 100)


def test_max_batch_samples_caps_short_buckets():
    layout = bucket_layout(np.array([10] * 50), [], 1000, max_batch_samples=8)
    assert layout.batch_sizes == (8,) and layout.steps_per_epoch == 7


def test_empty_buckets_make_no_batches():
    layout = bucket_layout(np.array([10, 20, 3000]), [100, 200, 400], 4000)
    assert layout.batches_per_bucket.tolist() == [1, 0, 0, 1]
    plan = plan_epoch(layout, 0, 0)
    assert sorted(np.concatenate(plan.batches).tolist()) == [0, 1, 2]


def test_interleave_ties_are_deterministic():
    bucket, j = interleave_order([2, 2], [0.0, 0.0])
    assert list(zip(bucket.tolist(), j.tolist(), strict=True)) == [(0, 0), (1, 0), (0, 1), (1, 1)]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4096), min_size=1, max_size=400),
    num_buckets=st.integers(1, 8),
    extra_budget=st.integers(0, 20_000),
    cap=st.one_of(st.none(), st.integers(1, 64)),
    seed=st.integers(0, 2**32 - 1),
    epoch=st.integers(0, 50),
)
def test_any_length_mix(lengths, num_buckets, extra_budget, cap, seed, epoch):
    lengths = np.asarray(lengths)
    budget = int(lengths.max()) + extra_budget
    boundaries = quantile_boundaries(lengths, num_buckets)
    layout = bucket_layout(lengths, boundaries, budget, max_batch_samples=cap)
    plan = plan_epoch(layout, seed, epoch)
    flat = np.concatenate(plan.batches)
    assert np.array_equal(np.sort(flat), np.arange(lengths.size))  # nothing lost, nothing repeated
    assert padded_tokens(lengths, plan.batches).max() <= budget
    assert cap is None or max(len(b) for b in plan.batches) <= cap
    # Stride interleaving: after any prefix of m batches, bucket b has produced m * share_b batches
    # give or take the number of buckets (see train/buckets.py for the bound).
    order = plan.bucket_of_batch
    K = layout.num_buckets
    onehot = np.eye(K, dtype=np.int64)[order]
    counts_mb = np.cumsum(onehot, axis=0)
    share_b = counts_mb[-1] / order.size
    m = np.arange(1, order.size + 1)[:, None]
    assert np.abs(counts_mb - m * share_b).max() <= K
