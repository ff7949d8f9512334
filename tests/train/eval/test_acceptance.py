"""Chain acceptance metrics: hand-made blocks, brute-force loops, exact identities, groups."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from train.eval.acceptance import accepted_streak, chain_blocks, summarize_blocks, summarize_by_group

D = 15


def blocks_agreeing_for(patterns: list[list[bool]], valid_lens: list[int] | None = None, **kwargs):
    """Blocks whose draft equals the target exactly where the pattern says True."""
    agree_ND = torch.tensor(patterns)
    target_ND = torch.arange(agree_ND.numel()).view(agree_ND.shape) + 100
    draft_ND = torch.where(agree_ND, target_ND, 7)
    valid_len_N = torch.tensor(valid_lens or [agree_ND.shape[1]] * agree_ND.shape[0])
    return chain_blocks(draft_ND, target_ND, valid_len_N, **kwargs)


def test_always_agree():
    summary = summarize_blocks(blocks_agreeing_for([[True] * D] * 3))
    assert summary["n_blocks"] == 3 and summary["n_cut"] == 0
    assert summary["tau"] == 16.0 and summary["streak"] == 15.0
    assert summary["all_accepted"] == 1.0
    assert summary["position_acceptance"] == [1.0] * D
    assert summary["conditional_acceptance"] == [1.0] * D
    assert summary["position_count"] == [3] * D and summary["conditional_count"] == [3] * D
    assert summary["tau_histogram"] == [0] * D + [3]


def test_never_agree():
    summary = summarize_blocks(blocks_agreeing_for([[False] * D] * 2))
    assert summary["tau"] == 1.0 and summary["streak"] == 0.0 and summary["all_accepted"] == 0.0
    assert summary["position_acceptance"] == [0.0] * D
    # Nobody reaches position 2, so its conditional rate has no denominator.
    assert summary["conditional_acceptance"] == [0.0] + [None] * (D - 1)
    assert summary["conditional_count"] == [2] + [0] * (D - 1)
    assert summary["tau_histogram"] == [2] + [0] * D


@pytest.mark.parametrize("k", range(D + 1))
def test_agree_for_exactly_k_then_again_after_a_miss(k):
    """Agreement after the first miss counts for the unconditional rate, never for the streak."""
    pattern = [i != k for i in range(D)]  # the only miss is at block position k+1
    blocks = blocks_agreeing_for([pattern])
    summary = summarize_blocks(blocks)
    assert blocks.streak_N.tolist() == [k]
    assert summary["tau"] == 1.0 + k
    assert summary["all_accepted"] == (1.0 if k == D else 0.0)
    assert summary["position_acceptance"] == [1.0 if a else 0.0 for a in pattern]
    expected_conditional = [1.0] * k + ([0.0] + [None] * (D - k - 1) if k < D else [])
    assert summary["conditional_acceptance"] == expected_conditional


def test_cut_block_accepts_at_most_its_valid_length():
    # Block 0: all drafts right, only 5 target tokens. Block 1: drafts wrong past its end (ignored).
    # Block 2: 3 valid tokens, miss at position 2, right at 3.
    blocks = blocks_agreeing_for(
        [[True] * D, [True] * 4 + [False] * (D - 4), [True, False] + [True] * (D - 2)], valid_lens=[5, 4, 3]
    )
    assert blocks.streak_N.tolist() == [5, 4, 1]
    assert blocks.tau_N.tolist() == [6, 5, 2]
    assert blocks.agree_ND.sum(dim=1).tolist() == [5, 4, 2]
    summary = summarize_blocks(blocks)
    assert summary["n_cut"] == 3
    assert summary["all_accepted"] == 0.0  # a cut block is never "all accepted"
    assert summary["position_count"] == [3, 3, 3, 2, 1] + [0] * (D - 5)
    assert summary["position_acceptance"][:5] == [1.0, 2 / 3, 1.0, 1.0, 1.0]
    assert summary["position_acceptance"][5:] == [None] * (D - 5)
    assert summary["conditional_count"] == [3, 3, 2, 2, 1] + [0] * (D - 5)
    assert summary["conditional_acceptance"][:5] == [1.0, 2 / 3, 1.0, 1.0, 1.0]


def test_full_block_at_the_end_is_all_accepted():
    blocks = blocks_agreeing_for([[True] * D, [True] * D], valid_lens=[D, D - 1])
    summary = summarize_blocks(blocks)
    assert summary["all_accepted"] == 0.5 and summary["n_cut"] == 1


def test_against_brute_force_loops():
    gen = torch.Generator().manual_seed(0)
    n_blocks, n_positions = 300, 6
    draft_ND = torch.randint(0, 2, (n_blocks, n_positions), generator=gen)
    target_ND = torch.where(torch.rand(n_blocks, n_positions, generator=gen) < 0.7, draft_ND, 1 - draft_ND)
    valid_len_N = torch.randint(1, n_positions + 1, (n_blocks,), generator=gen)
    blocks = chain_blocks(draft_ND, target_ND, valid_len_N)
    summary = summarize_blocks(blocks)

    streaks, hits, counts, survived, reached = (
        [],
        [0] * n_positions,
        [0] * n_positions,
        [0] * n_positions,
        [0] * n_positions,
    )
    for draft, target, L in zip(draft_ND.tolist(), target_ND.tolist(), valid_len_N.tolist(), strict=True):
        streak = 0
        while streak < L and draft[streak] == target[streak]:
            streak += 1
        streaks.append(streak)
        for k in range(L):
            counts[k] += 1
            hits[k] += draft[k] == target[k]
            reached[k] += streak >= k
            survived[k] += streak >= k + 1
    assert blocks.streak_N.tolist() == streaks
    assert summary["tau"] == pytest.approx(1 + sum(streaks) / n_blocks)
    assert summary["position_acceptance"] == pytest.approx([h / c for h, c in zip(hits, counts, strict=True)])
    assert summary["conditional_acceptance"] == pytest.approx([s / r for s, r in zip(survived, reached, strict=True)])
    assert summary["tau_histogram"] == [streaks.count(s) for s in range(n_positions + 1)]


def test_conditional_rates_multiply_to_tau_without_cut_blocks():
    gen = torch.Generator().manual_seed(1)
    n_blocks = 500
    draft_ND = torch.randint(0, 3, (n_blocks, D), generator=gen)
    rate_D = torch.linspace(0.95, 0.6, D)
    target_ND = torch.where(torch.rand(n_blocks, D, generator=gen) < rate_D, draft_ND, 3)
    summary = summarize_blocks(chain_blocks(draft_ND, target_ND, torch.full((n_blocks,), D)))
    product, expected = 1.0, 1.0
    for rate in summary["conditional_acceptance"]:
        product *= rate or 0.0
        expected += product
    assert summary["tau"] == pytest.approx(expected, rel=1e-12)
    assert summary["tau"] > 3


def test_accepted_streak_counts_leading_trues():
    agree_ND = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert accepted_streak(agree_ND).tolist() == [2, 0, 4]


# ----------------------------------------------------------------------------- surrogate


def test_chain_surrogate_by_hand_and_cut():
    lp_ND = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.1, 1.0]]))
    blocks = blocks_agreeing_for([[True] * 3] * 2, valid_lens=[3, 2], draft_top1_logprobs_ND=lp_ND)
    assert blocks.surrogate_tau_N.tolist() == pytest.approx([1 + 0.5 + 0.25 + 0.125, 1 + 0.9 + 0.09])


def test_chain_surrogate_is_expected_tau_when_drafts_hit_with_their_probability():
    """Exact over all 2^D agreement patterns, with position k right independently with prob q_k."""
    n_positions = 5
    q = [0.9, 0.7, 0.8, 0.4, 0.95]
    blocks = blocks_agreeing_for([[True] * n_positions], draft_top1_logprobs_ND=torch.log(torch.tensor([q])))
    expectation = 0.0
    for pattern in itertools.product([True, False], repeat=n_positions):
        p = math.prod(qk if hit else 1 - qk for qk, hit in zip(q, pattern, strict=True))
        expectation += p * float(blocks_agreeing_for([list(pattern)]).tau_N[0])
    assert float(blocks.surrogate_tau_N[0]) == pytest.approx(expectation, rel=1e-6)
    assert summarize_blocks(blocks)["surrogate_tau"] == pytest.approx(expectation, rel=1e-6)


# ----------------------------------------------------------------------------- groups


def test_groups_report_every_group_including_empty_ones():
    blocks = blocks_agreeing_for(
        [[True] * D, [False] * D, [True] * 3 + [False] * (D - 3)], draft_top1_logprobs_ND=torch.full((3, D), -0.1)
    )
    group_N = torch.tensor([0, 2, 0])
    extra_N = {"ddtree_tau_8": torch.tensor([9.0, 2.0, 5.0])}
    by_group = summarize_by_group(blocks, group_N, [0, 1, 2], extra_N=extra_N)
    assert list(by_group) == [0, 1, 2]

    empty = by_group[1]
    assert empty["n_blocks"] == 0 and empty["n_cut"] == 0
    for key in ("tau", "streak", "all_accepted", "surrogate_tau", "ddtree_tau_8"):
        assert empty[key] is None
    assert empty["position_acceptance"] == [None] * D and empty["conditional_acceptance"] == [None] * D
    assert empty["position_count"] == [0] * D and empty["tau_histogram"] == [0] * (D + 1)
    assert set(empty) == set(by_group[0])

    assert by_group[0]["n_blocks"] == 2 and by_group[0]["tau"] == (16 + 4) / 2
    assert by_group[0]["ddtree_tau_8"] == 7.0 and by_group[2]["ddtree_tau_8"] == 2.0
    subset = blocks_agreeing_for(
        [[True] * D, [True] * 3 + [False] * (D - 3)], draft_top1_logprobs_ND=torch.full((2, D), -0.1)
    )
    assert summarize_blocks(subset) == {k: v for k, v in by_group[0].items() if k != "ddtree_tau_8"}


def test_unlisted_or_duplicate_groups_raise():
    blocks = blocks_agreeing_for([[True] * D] * 2)
    with pytest.raises(ValueError):
        summarize_by_group(blocks, torch.tensor([0, 3]), [0, 1])
    with pytest.raises(ValueError):
        summarize_by_group(blocks, torch.tensor([0, 0]), [0, 0])


@pytest.mark.parametrize("valid_len", [0, D + 1])
def test_valid_length_out_of_range_raises(valid_len):
    with pytest.raises(ValueError):
        blocks_agreeing_for([[True] * D], valid_lens=[valid_len])
