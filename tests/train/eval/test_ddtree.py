"""DDTree construction, walk and surrogate against brute force on small random distributions.

Brute force here means: enumerate every prefix of the per-depth top-K tokens, score it by a direct
left-to-right sum, and order all of them by the documented key (score desc, then depth, then the
parent's position, then rank). Both builders must return exactly the first `budget` of that list.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from train.eval.acceptance import chain_blocks
from train.eval.ddtree import (
    ConditionalTopK,
    DDTree,
    DDTreeBatch,
    build_ddtree,
    build_ddtree_batch,
    build_selector_ddtree,
    build_selector_ddtree_batch,
    ddtree_taus,
    draft_topk,
    selector_ddtree_taus,
    surrogate_tau,
    surrogate_tau_batch,
    walk_ddtree_batch,
    walk_tree,
)

TIE_VALUES = torch.tensor([0.0, -0.5, -1.0, float("-inf")])


# ----------------------------------------------------------------------------- helpers


def random_topk(
    n_blocks: int, n_depths: int, k: int, vocab: int, temperature: float = 1.0, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    logits_NDV = torch.randn(n_blocks, n_depths, vocab, generator=generator) * temperature
    return draft_topk(logits_NDV, k)


def tied_topk(n_blocks: int, n_depths: int, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs drawn from 4 values (0, -0.5, -1, -inf): many exact ties, including parent==child."""
    pick_NDK = torch.randint(0, len(TIE_VALUES), (n_blocks, n_depths, k), generator=generator)
    lp_NDK = TIE_VALUES[pick_NDK].sort(dim=-1, descending=True).values
    ids_NDK = torch.stack([torch.randperm(3 * k, generator=generator)[:k] for _ in range(n_blocks * n_depths)]).view(
        n_blocks, n_depths, k
    )
    return lp_NDK, ids_NDK


def brute_force_order(lp_DK: torch.Tensor) -> list[tuple[float, tuple[int, ...]]]:
    """Every prefix of the top-K ranks as (score, rank tuple), in the documented key order."""
    lp = lp_DK.double().tolist()
    n_depths, n_ranks = len(lp), len(lp[0])
    levels = []  # per depth: [(score, ranks)] in that depth's key order
    previous = [(0.0, ())]
    for depth in range(n_depths):
        candidates = [
            (score + lp[depth][r], parent_pos, r, ranks + (r,))
            for parent_pos, (score, ranks) in enumerate(previous)
            for r in range(n_ranks)
        ]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        previous = [(c[0], c[3]) for c in candidates]
        levels.append(previous)
    everything = [
        (score, depth, pos, ranks) for depth, level in enumerate(levels) for pos, (score, ranks) in enumerate(level)
    ]
    everything.sort(key=lambda e: (-e[0], e[1], e[2]))
    return [(e[0], e[3]) for e in everything]


def rank_paths(tree: DDTree) -> list[tuple[int, ...]]:
    """Each node's path as a tuple of ranks, in node order."""
    paths: list[tuple[int, ...]] = []
    for parent, rank in zip(tree.parent_M.tolist(), tree.rank_M.tolist(), strict=True):
        assert parent < len(paths), "parent must precede child"
        paths.append((paths[parent] if parent >= 0 else ()) + (rank,))
    return paths


def token_paths(tree: DDTree) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for parent, token in zip(tree.parent_M.tolist(), tree.token_M.tolist(), strict=True):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return paths


def assert_same_tree(a: DDTree, b: DDTree) -> None:
    for x, y in zip(
        (a.parent_M, a.depth_M, a.rank_M, a.token_M, a.score_M),
        (b.parent_M, b.depth_M, b.rank_M, b.token_M, b.score_M),
        strict=True,
    ):
        assert torch.equal(x, y)


def both_builders(lp_NDK: torch.Tensor, ids_NDK: torch.Tensor, budget: int) -> list[list[DDTree]]:
    batch = build_ddtree_batch(lp_NDK, ids_NDK, budget)
    return [[build_ddtree(lp_NDK[i], ids_NDK[i], budget), batch.tree(i)] for i in range(lp_NDK.shape[0])]


# ----------------------------------------------------------------------------- construction


@pytest.mark.parametrize("kind", ["continuous", "ties"])
def test_tree_is_first_budget_prefixes_of_brute_force(kind):
    gen = torch.Generator().manual_seed(1)
    n_depths, k = 4, 3  # 3 + 9 + 27 + 81 = 120 prefixes
    if kind == "continuous":
        lp_NDK, ids_NDK = random_topk(12, n_depths, k, vocab=7, temperature=2.0, generator=gen)
    else:
        lp_NDK, ids_NDK = tied_topk(12, n_depths, k, gen)
    for budget in (1, 2, 3, 5, 8, 13, 30, 119, 120, 150):
        for i, trees in enumerate(both_builders(lp_NDK, ids_NDK, budget)):
            expected = brute_force_order(lp_NDK[i])[:budget]
            for tree in trees:
                assert tree.size == min(budget, 120)
                assert rank_paths(tree) == [ranks for _, ranks in expected]
                assert tree.score_M.tolist() == [score for score, _ in expected]
                assert tree.depth_M.tolist() == [len(ranks) for _, ranks in expected]
                ids = ids_NDK[i]
                assert tree.token_M.tolist() == [int(ids[len(r) - 1, r[-1]]) for _, r in expected]


@pytest.mark.parametrize("kind", ["continuous", "ties"])
def test_tree_is_prefix_closed_and_holds_highest_scores(kind):
    """Tie-rule-free properties: parents inside, and no prefix outside outscores one inside."""
    gen = torch.Generator().manual_seed(2)
    n_depths, k = 3, 4
    if kind == "continuous":
        lp_NDK, ids_NDK = random_topk(20, n_depths, k, vocab=9, generator=gen)
    else:
        lp_NDK, ids_NDK = tied_topk(20, n_depths, k, gen)
    for budget in (1, 4, 7, 20, 50):
        for i, trees in enumerate(both_builders(lp_NDK, ids_NDK, budget)):
            all_scores = {ranks: score for score, ranks in brute_force_order(lp_NDK[i])}
            for tree in trees:
                inside = rank_paths(tree)
                assert len(set(inside)) == len(inside)
                assert all(p[:-1] in set(inside) for p in inside if len(p) > 1)
                outside = set(all_scores) - set(inside)
                if outside:
                    assert min(all_scores[p] for p in inside) >= max(all_scores[p] for p in outside)


def test_zero_log_prob_ties_keep_parent_before_child():
    """A probability-1 token makes a child tie its parent; the parent must still come first."""
    lp_DK = torch.tensor([[0.0, float("-inf")], [0.0, float("-inf")], [-1.0, -2.0]])
    ids_DK = torch.tensor([[5, 6], [7, 8], [9, 10]])
    for tree in both_builders(lp_DK[None], ids_DK[None], 4)[0]:
        assert tree.depth_M.tolist() == [1, 2, 3, 3]
        assert tree.parent_M.tolist() == [-1, 0, 1, 1]
        assert tree.token_M.tolist() == [5, 7, 9, 10]


def test_positive_round_off_log_probs_count_as_zero():
    """log_softmax can return a hair above 0 for a certain token; that must not let a child
    outscore its parent (the batch merge would then put the child first)."""
    lp_DK = torch.tensor([[1e-6, -3.0], [2e-6, -2.0], [-0.5, -1.0]])
    ids_DK = torch.tensor([[1, 2], [3, 4], [5, 6]])
    expected = build_ddtree(lp_DK.clamp(max=0.0), ids_DK, 5)
    for tree in both_builders(lp_DK[None], ids_DK[None], 5)[0]:
        assert_same_tree(tree, expected)
        assert (tree.score_M <= 0).all()


def test_batch_builder_equals_heap_at_eval_sizes():
    gen = torch.Generator().manual_seed(3)
    lp_NDK, ids_NDK = random_topk(6, 15, 64, vocab=200, temperature=3.0, generator=gen)
    for budget in (8, 16, 64):
        for heap_tree, batch_tree in both_builders(lp_NDK, ids_NDK, budget):
            assert heap_tree.size == budget
            assert_same_tree(heap_tree, batch_tree)


def test_smaller_budget_is_a_prefix_of_larger_budget():
    gen = torch.Generator().manual_seed(4)
    lp_NDK, ids_NDK = random_topk(5, 6, 32, vocab=50, temperature=2.0, generator=gen)
    full = build_ddtree_batch(lp_NDK, ids_NDK, 32)
    for budget in (1, 3, 8, 16, 31):
        small = build_ddtree_batch(lp_NDK[:, :, :budget], ids_NDK[:, :, :budget], budget)
        prefix = full.prefix(budget)
        for i in range(5):
            assert_same_tree(small.tree(i), prefix.tree(i))
            assert_same_tree(build_ddtree(lp_NDK[i], ids_NDK[i], budget), prefix.tree(i))


def test_fewer_prefixes_than_budget_pads_batch():
    lp_NDK, ids_NDK = draft_topk(torch.randn(3, 2, 5), 2)  # 2 + 4 = 6 prefixes
    batch = build_ddtree_batch(lp_NDK, ids_NDK, 10)
    assert batch.node_valid_NM.sum(dim=1).tolist() == [6, 6, 6]
    assert not batch.node_valid_NM[:, 6:].any()
    for i in range(3):
        assert_same_tree(build_ddtree(lp_NDK[i], ids_NDK[i], 10), batch.tree(i))


@pytest.mark.parametrize("bad", ["unsorted", "nan", "duplicate_ids", "budget", "shape"])
def test_bad_inputs_raise(bad):
    lp_DK, ids_DK = draft_topk(torch.randn(1, 3, 6), 4)
    lp_DK, ids_DK, budget = lp_DK[0], ids_DK[0], 4
    if bad == "unsorted":
        lp_DK = lp_DK.flip(-1)
    elif bad == "nan":
        lp_DK[1, 2] = float("nan")
    elif bad == "duplicate_ids":
        ids_DK[2, 1] = ids_DK[2, 0]
    elif bad == "budget":
        budget = 0
    else:
        ids_DK = ids_DK[:, :3]
    with pytest.raises(ValueError):
        build_ddtree(lp_DK, ids_DK, budget)
    with pytest.raises(ValueError):
        build_ddtree_batch(lp_DK[None], ids_DK[None], budget)


def test_draft_topk_is_normalized_over_full_vocabulary():
    logits_NDV = torch.randn(2, 3, 11)
    lp_NDK, ids_NDK = draft_topk(logits_NDV, 4)
    full_NDV = torch.log_softmax(logits_NDV, dim=-1)
    assert torch.allclose(lp_NDK, full_NDV.gather(-1, ids_NDK))
    assert torch.equal(ids_NDK[..., 0], logits_NDV.argmax(-1))
    assert (lp_NDK.exp().sum(-1) < 1).all()


# ----------------------------------------------------------------------------- walk


def brute_force_walk(tree: DDTree, y: list[int], valid_len: int) -> int:
    paths = set(token_paths(tree))
    return max([d for d in range(1, valid_len + 1) if tuple(y[:d]) in paths], default=0)


def test_walk_matches_brute_force_and_batch():
    gen = torch.Generator().manual_seed(5)
    n_blocks, n_depths, k = 40, 5, 3
    lp_NDK, ids_NDK = random_topk(n_blocks, n_depths, k, vocab=4, temperature=2.0, generator=gen)
    # Targets drawn from the small vocabulary so they often run down the tree.
    target_ND = torch.randint(0, 4, (n_blocks, n_depths), generator=gen)
    valid_len_N = torch.randint(0, n_depths + 1, (n_blocks,), generator=gen)
    for budget in (1, 5, 12, 40):
        batch = build_ddtree_batch(lp_NDK, ids_NDK, budget)
        walked_N = walk_ddtree_batch(batch, target_ND, valid_len_N)
        depths = []
        for i in range(n_blocks):
            tree = build_ddtree(lp_NDK[i], ids_NDK[i], budget)
            depth = walk_tree(tree, target_ND[i], int(valid_len_N[i]))
            assert depth == brute_force_walk(tree, target_ND[i].tolist(), int(valid_len_N[i]))
            depths.append(depth)
        assert walked_N.tolist() == depths
    assert max(depths) >= 3  # the cases above must reach depth, or they prove little


def test_walk_stops_at_valid_length():
    lp_DK, ids_DK = draft_topk(torch.randn(1, 4, 10), 1)
    tree = build_ddtree(lp_DK[0], ids_DK[0], 4)  # the argmax chain
    y_D = ids_DK[0, :, 0]
    assert [walk_tree(tree, y_D, L) for L in range(5)] == [0, 1, 2, 3, 4]
    batch = build_ddtree_batch(lp_DK.expand(5, 4, 1), ids_DK.expand(5, 4, 1), 4)
    assert walk_ddtree_batch(batch, y_D.expand(5, 4), torch.arange(5)).tolist() == [0, 1, 2, 3, 4]


# ----------------------------------------------------------------------------- chain vs tree


def test_top1_tree_with_budget_d_is_the_chain():
    """Exact: from top-1 inputs, any budget >= D gives the argmax chain, so DDTree τ == chain τ
    for every target and valid length, and the surrogates agree."""
    gen = torch.Generator().manual_seed(6)
    n_blocks, n_depths = 64, 15
    lp_NDK, ids_NDK = random_topk(n_blocks, n_depths, 1, vocab=8, generator=gen)
    draft_ND = ids_NDK[..., 0]
    # Targets agree with the draft for a random number of leading positions, then at random.
    agree_len_N = torch.randint(0, n_depths + 1, (n_blocks,), generator=gen)
    target_ND = torch.where(
        torch.arange(n_depths) < agree_len_N[:, None],
        draft_ND,
        torch.randint(0, 8, (n_blocks, n_depths), generator=gen),
    )
    valid_len_N = torch.randint(1, n_depths + 1, (n_blocks,), generator=gen)
    chain = chain_blocks(draft_ND, target_ND, valid_len_N, lp_NDK[..., 0])
    for budget in (n_depths, 64):
        taus = ddtree_taus(lp_NDK, ids_NDK, target_ND, valid_len_N, [budget])[budget]
        assert torch.equal(taus.tau_N, chain.tau_N)
        assert torch.allclose(taus.surrogate_tau_N, chain.surrogate_tau_N, rtol=0, atol=1e-12)
        tree = build_ddtree(lp_NDK[0], ids_NDK[0], budget)
        assert tree.depth_M.tolist() == list(range(1, n_depths + 1))
        assert tree.token_M.tolist() == draft_ND[0].tolist()
    assert len(set(chain.streak_N.tolist())) > 5


def test_budget_d_tree_is_the_chain_iff_chain_outscores_every_deviation():
    """With full top-K inputs and budget D, the tree is the argmax chain exactly when the whole
    chain's score beats the best one-step deviation (chain prefix + rank-1 token at some depth);
    then DDTree τ == chain τ for every target. Otherwise the tree spends a node off the chain."""
    gen = torch.Generator().manual_seed(7)
    n_blocks, n_depths, k = 200, 6, 4
    temperature_N11 = torch.linspace(0.5, 8.0, n_blocks)[:, None, None]
    lp_NDK, ids_NDK = draft_topk(torch.randn(n_blocks, n_depths, 30, generator=gen) * temperature_N11, k)
    lp64_NDK = lp_NDK.double()
    chain_prefix_ND = lp64_NDK[..., 0].cumsum(dim=1)
    before_ND = torch.cat([torch.zeros(n_blocks, 1, dtype=torch.float64), chain_prefix_ND[:, :-1]], 1)
    best_deviation_N = (before_ND + lp64_NDK[..., 1]).amax(dim=1)
    predicted_chain_N = chain_prefix_ND[:, -1] > best_deviation_N

    draft_ND = ids_NDK[..., 0]
    target_ND = torch.where(torch.rand(n_blocks, n_depths, generator=gen) < 0.8, draft_ND, ids_NDK[..., 1])
    valid_len_N = torch.full((n_blocks,), n_depths)
    chain = chain_blocks(draft_ND, target_ND, valid_len_N)
    batch = build_ddtree_batch(lp_NDK, ids_NDK, n_depths)
    tree_tau_N = 1 + walk_ddtree_batch(batch, target_ND, valid_len_N)
    is_chain_N = (batch.rank_NM == 0).all(dim=1)
    assert torch.equal(is_chain_N, predicted_chain_N)
    assert torch.equal(tree_tau_N[is_chain_N], chain.tau_N[is_chain_N])
    assert 20 < int(is_chain_N.sum()) < n_blocks - 20  # both cases occur


# ----------------------------------------------------------------------------- surrogate


def product_distribution(n_depths: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A full distribution per depth as sorted top-V (log-probs, ids), float64 so that each depth
    sums to 1 to ~1e-16 (the surrogate identity assumes it)."""
    gen = torch.Generator().manual_seed(seed)
    logits_DV = torch.randn(n_depths, vocab, generator=gen, dtype=torch.float64) * 1.5
    lp_DK, ids_DK = torch.log_softmax(logits_DV, dim=-1).sort(dim=-1, descending=True)
    return lp_DK, ids_DK


@pytest.mark.parametrize("valid_len", [4, 2])
def test_surrogate_equals_exact_expectation_under_product_distribution(valid_len):
    n_depths, vocab = 4, 5
    lp_DK, ids_DK = product_distribution(n_depths, vocab, seed=8)
    prob_DV = torch.zeros(n_depths, vocab, dtype=torch.float64)
    prob_DV.scatter_(1, ids_DK, lp_DK.double().exp())
    for budget in (1, 4, 8, 30):
        tree = build_ddtree(lp_DK, ids_DK, budget)
        expectation = 0.0
        for y in itertools.product(range(vocab), repeat=n_depths):
            p = math.prod(prob_DV[d, y[d]].item() for d in range(n_depths))
            expectation += p * (1 + walk_tree(tree, torch.tensor(y), valid_len))
        assert surrogate_tau(tree, valid_len) == pytest.approx(expectation, rel=1e-9)


def test_surrogate_matches_monte_carlo():
    n_depths, vocab, n_samples = 6, 6, 20000
    lp_DK, ids_DK = product_distribution(n_depths, vocab, seed=9)
    gen = torch.Generator().manual_seed(10)
    rank_SD = torch.multinomial(lp_DK.double().exp(), n_samples, replacement=True, generator=gen).T  # [n_samples, D]
    target_SD = ids_DK.gather(1, rank_SD.T).T
    for budget in (8, 32):
        batch = build_ddtree_batch(lp_DK[None], ids_DK[None], budget)
        repeated = DDTreeBatch(*(t.expand(n_samples, -1) for t in batch.tensors()))
        tau_S = 1 + walk_ddtree_batch(repeated, target_SD, torch.full((n_samples,), n_depths))
        surrogate = float(surrogate_tau_batch(batch, torch.tensor([n_depths]))[0])
        standard_error = float(tau_S.double().std()) / math.sqrt(n_samples)
        assert abs(float(tau_S.double().mean()) - surrogate) < 4 * standard_error
        assert surrogate > 1.3  # a surrogate near 1 would make the check vacuous


# ----------------------------------------------------------------------------- batched helper


def test_ddtree_taus_equals_per_block_single_builds_and_ignores_chunking():
    gen = torch.Generator().manual_seed(11)
    n_blocks, n_depths = 17, 15
    lp_NDK, ids_NDK = random_topk(n_blocks, n_depths, 64, vocab=100, temperature=4.0, generator=gen)
    target_ND = torch.where(torch.rand(n_blocks, n_depths, generator=gen) < 0.85, ids_NDK[..., 0], ids_NDK[..., 1])
    valid_len_N = torch.randint(1, n_depths + 1, (n_blocks,), generator=gen)
    budgets = [8, 16, 32, 64]
    whole = ddtree_taus(lp_NDK, ids_NDK, target_ND, valid_len_N, budgets)
    chunked = ddtree_taus(lp_NDK, ids_NDK, target_ND, valid_len_N, budgets, chunk_blocks=5)
    for budget in budgets:
        assert torch.equal(whole[budget].tau_N, chunked[budget].tau_N)
        assert torch.equal(whole[budget].surrogate_tau_N, chunked[budget].surrogate_tau_N)
        for i in range(n_blocks):
            tree = build_ddtree(lp_NDK[i], ids_NDK[i], budget)
            L = int(valid_len_N[i])
            assert int(whole[budget].tau_N[i]) == 1 + walk_tree(tree, target_ND[i], L)
            assert float(whole[budget].surrogate_tau_N[i]) == pytest.approx(surrogate_tau(tree, L), abs=1e-12)
    # A bigger tree never walks less far (it contains the smaller one).
    for small, big in itertools.pairwise(budgets):
        assert (whole[big].tau_N >= whole[small].tau_N).all()
    assert (whole[64].tau_N > whole[8].tau_N).any()


# ----------------------------------------------------------------------------- conditional trees (DFlash2)


def random_lattice(
    n_blocks: int, n_depths: int, k: int, generator: torch.Generator, ties: bool = False
) -> ConditionalTopK:
    """q_d(. | parent row) over k candidate slots: a distribution per parent row (one row at depth 1 is used)."""
    if ties:
        logq_NDPk = TIE_VALUES[torch.randint(0, 3, (n_blocks, n_depths, k, k), generator=generator)]
    else:
        logq_NDPk = torch.randn(n_blocks, n_depths, k, k, generator=generator).mul(2.0).log_softmax(dim=-1)
    lp, slot = logq_NDPk.sort(dim=-1, descending=True, stable=True)
    tokens = torch.stack([torch.randperm(4 * k, generator=generator)[:k] for _ in range(n_blocks * n_depths)])
    return ConditionalTopK(lp, slot, tokens.view(n_blocks, n_depths, k))


def brute_force_conditional(topk: ConditionalTopK) -> list[tuple[float, tuple[int, ...]]]:
    """Every prefix of candidate slots as (score, token path), in the documented key order: the score a
    direct left-to-right sum of log q_d(slot | previous slot), the rank the child's rank in its parent's row."""
    lp, slot, token = (t[0].tolist() for t in (topk.logprobs_NDPK.double(), topk.slot_NDPK, topk.token_NDk))
    n_depths, n_ranks = len(lp), len(lp[0][0])
    levels, previous = [], [(0.0, (), 0)]  # (score, token path, the row ranking its children)
    for depth in range(n_depths):
        children = [
            (score + lp[depth][row][r], position, r, path + (token[depth][slot[depth][row][r]],), slot[depth][row][r])
            for position, (score, path, row) in enumerate(previous)
            for r in range(n_ranks)
        ]
        children.sort(key=lambda c: (-c[0], c[1], c[2]))
        previous = [(c[0], c[3], c[4]) for c in children]
        levels.append(previous)
    every = [(score, depth, pos, path) for depth, lv in enumerate(levels) for pos, (score, path, _) in enumerate(lv)]
    every.sort(key=lambda e: (-e[0], e[1], e[2]))
    return [(e[0], e[3]) for e in every]


@pytest.mark.parametrize("ties", [False, True], ids=["continuous", "ties"])
def test_conditional_tree_is_first_budget_prefixes_of_brute_force(ties):
    gen = torch.Generator().manual_seed(21)
    lattice = random_lattice(6, 3, 3, gen, ties=ties)
    for budget in (1, 4, 9, 30, 39):
        batch = build_selector_ddtree_batch(lattice, budget)
        for i in range(lattice.n_blocks):
            expected = brute_force_conditional(lattice.block(i))[:budget]
            heap = build_selector_ddtree(lattice.block(i), budget)
            assert_same_tree(heap, batch.tree(i))
            assert token_paths(heap) == [path for _, path in expected]
            assert heap.score_M.tolist() == [score for score, _ in expected]


def test_conditional_tree_with_one_row_for_every_parent_is_the_unary_tree():
    gen = torch.Generator().manual_seed(22)
    lattice = random_lattice(5, 6, 8, gen)
    shared = ConditionalTopK(
        lattice.logprobs_NDPK[:, :, :1].expand_as(lattice.logprobs_NDPK),
        lattice.slot_NDPK[:, :, :1].expand_as(lattice.slot_NDPK),
        lattice.token_NDk,
    )
    ids_NDk = lattice.token_NDk.gather(2, lattice.slot_NDPK[:, :, 0])  # tokens in rank order
    for budget in (5, 20):
        batch = build_selector_ddtree_batch(shared, budget)
        for i in range(5):
            assert_same_tree(batch.tree(i), build_ddtree(lattice.logprobs_NDPK[i, :, 0], ids_NDk[i], budget))


def test_selector_ddtree_taus_equals_single_builds_and_grows_with_the_budget():
    gen = torch.Generator().manual_seed(23)
    n_blocks, n_depths = 9, 7
    lattice = random_lattice(n_blocks, n_depths, 6, gen)
    best = lattice.token_NDk.gather(2, lattice.slot_NDPK[:, :, 0, :1])[..., 0]
    target_ND = torch.where(torch.rand(n_blocks, n_depths, generator=gen) < 0.7, best, lattice.token_NDk[..., -1])
    valid_len_N = torch.randint(1, n_depths + 1, (n_blocks,), generator=gen)
    whole = selector_ddtree_taus(lattice, target_ND, valid_len_N, [4, 16, 32])
    chunked = selector_ddtree_taus(lattice, target_ND, valid_len_N, [4, 16, 32], chunk_blocks=4)
    for budget in (4, 16, 32):
        assert torch.equal(whole[budget].tau_N, chunked[budget].tau_N)
        for i in range(n_blocks):
            tree, L = build_selector_ddtree(lattice.block(i), budget), int(valid_len_N[i])
            assert int(whole[budget].tau_N[i]) == 1 + walk_tree(tree, target_ND[i], L)
            assert float(whole[budget].surrogate_tau_N[i]) == pytest.approx(surrogate_tau(tree, L), abs=1e-12)
    assert (whole[32].tau_N >= whole[4].tau_N).all() and (whole[32].tau_N > whole[4].tau_N).any()
    with pytest.raises(ValueError, match="permutation"):
        build_selector_ddtree_batch(ConditionalTopK(lattice.logprobs_NDPK, lattice.slot_NDPK * 0, lattice.token_NDk), 4)
