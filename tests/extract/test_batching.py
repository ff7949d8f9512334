"""Micro-batch planning: every sample exactly once, the token budget holds, longest first, and the
plan is a pure function of the lengths (a resumed run re-forms the same batches)."""

from __future__ import annotations

import queue

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from extract.batching import BufferPool, HostBatch, attention_mask_for, collate_right_padded, plan_micro_batches


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), max_size=60), st.integers(64, 400))
def test_plan_covers_each_sample_once_within_budget(lengths, budget):
    batches = plan_micro_batches(lengths, budget)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) * max(lengths[i] for i in batch) <= budget
    firsts = [lengths[b[0]] for b in batches]
    assert firsts == sorted(firsts, reverse=True)  # longest batches first
    assert plan_micro_batches(list(lengths), budget) == batches


def test_plan_packs_greedily_and_refuses_oversized():
    assert plan_micro_batches([10, 30, 20, 30], 60) == [[1, 3], [2, 0]]
    with pytest.raises(ValueError, match="exceeds tokens_per_batch"):
        plan_micro_batches([5, 70], 64)


def test_collate_right_pads_and_masks():
    ids, lengths = collate_right_padded([torch.tensor([1, 2, 3]), torch.tensor([4])], pad_id=9)
    assert ids.tolist() == [[1, 2, 3], [4, 9, 9]] and lengths == [3, 1]
    assert attention_mask_for(lengths, 3).tolist() == [[1, 1, 1], [1, 0, 0]]
    assert attention_mask_for([3, 3], 3) is None


def test_buffer_pool_bounds_what_is_in_flight():
    pool = BufferPool(2, n_taps=2, hidden_size=4, token_budget=8, topk=3, pin=False)
    a, b = pool.acquire(), pool.acquire()
    with pytest.raises(queue.Empty):
        pool.acquire(timeout=0.01)
    pool.release(a)
    assert pool.acquire(timeout=0.01) is a
    assert a.hidden_view(2, 4).shape == (2, 1, 2, 4, 8) and isinstance(
        b, HostBatch
    )  # [planes, S, B, T, n_taps * H / S]
    per_tap = HostBatch(n_taps=2, hidden_size=4, token_budget=8, topk=3, pin=False, hidden_split=2)
    assert per_tap.hidden_view(2, 4).shape == (2, 2, 2, 4, 4)
