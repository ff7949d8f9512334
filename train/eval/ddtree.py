"""DDTree (Ringel & Romano, arXiv 2604.12989) as pure algorithms over the drafter's per-depth top-k.

A DFlash drafter gives, for one block, marginals q_d over the vocabulary at depths d = 1..D
(D = B-1 = 15). DDTree verifies a token *tree* instead of the single argmax chain: the `budget`
prefixes (t_1..t_d) with the highest surrogate score  sum_d log q_d(t_d), found by a best-first
heap (docs/dflash.md "DDTree"). The target then walks its own continuation y_1..y_D down the tree; the
accepted depth plus the bonus token is the round's τ (docs/dflash.md "DDTree").

Order of nodes. Every tree here lists its nodes in the exact order the heap pops them, which is
ascending in the key

    (-score, depth, index of the parent node, rank of the token at its depth)

Ties in score are therefore broken by depth first (shallower first), then by the parent's own
position in this order, then by token rank. The key only grows along the heap's two pushes (next
sibling, first child), so the pop order is this total order on *all* prefixes of the top-k tokens,
whatever the budget. Consequences, all tested:
  - the tree is the first `budget` prefixes in that order: a set of `budget` highest-scoring
    prefixes, prefix-closed even when a log-probability is exactly 0 (a tie between parent and
    child) or several are equal;
  - the tree for a smaller budget b is the first b nodes of the tree for a larger budget, so one
    build at the largest budget serves every budget (`DDTreeBatch.prefix`);
  - a node of rank r has r siblings before it, so only the top-`budget` tokens per depth are ever
    used (`topk = min(budget, K)`).

Scores are float64 and each is computed as parent score + log q_d(token), the same additions in the
same order as a direct left-to-right sum, so equal prefixes give bit-equal scores in every
implementation here (the reference's incremental `score - lp[r] + lp[r+1]` for siblings does not).
Log-probabilities above 0 can only be round-off of log_softmax and are clamped to 0.

Two builders give identical trees (tested node for node): `build_ddtree` (one block, a Python
heap: the specification) and `build_ddtree_batch` (the same search run in lock step over many
blocks in torch, ~10-20x faster per block: the path eval uses, through `ddtree_taus`).

Conditional trees (a DFlash2 drafter's selector). There the distribution at depth d depends on the
token of the parent node: q_d(b | a) = softmax over the selector's k candidates b of depth d of its
scores S_d(a, b), the anchor being the parent of depth 1 (train.dflash2). The search is the same
best-first heap, with score sum_d log q_d(t_d | t_{d-1}), except that a node's children are ranked by
its own row of q: `ConditionalTopK` holds, per depth and parent row (the parent's candidate slot;
one row at depth 1), the children's log-probabilities sorted descending and the candidate slot each
comes from. `build_selector_ddtree` (the specification) and `build_selector_ddtree_batch` build it;
a unary tree is the conditional tree with one row per depth that every parent shares, and the
builders are written once for both (`_best_first`, `_best_first_batch`). Every property above
holds with "rank among the parent's children" for "rank at its depth"; with a row per parent,
`topk = min(budget, k)` still bounds the children a node ever uses.

Valid length. A block near the end of a response has only L <= D target tokens. The tree is built
from all D depths exactly as online decoding would build it (eval should pass the drafter's real
outputs at every depth), but the walk and the surrogate stop at depth L: such a block can accept at
most L tokens, as in `train.eval.acceptance`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "ConditionalTopK",
    "DDTree",
    "DDTreeBatch",
    "DDTreeTaus",
    "build_ddtree",
    "build_ddtree_batch",
    "build_selector_ddtree",
    "build_selector_ddtree_batch",
    "ddtree_taus",
    "draft_topk",
    "selector_ddtree_taus",
    "surrogate_tau",
    "surrogate_tau_batch",
    "walk_ddtree_batch",
    "walk_tree",
]


@dataclass(frozen=True)
class DDTree:
    """One block's tree; node i is the i-th prefix popped by the heap (M <= budget nodes).

    The root (the anchor / bonus token) is implicit: children of the root have parent -1.
    A parent always comes before its children.
    """

    parent_M: Tensor  # int64: index of the parent node, -1 for depth-1 nodes
    depth_M: Tensor  # int64: 1..D
    rank_M: Tensor  # int64: rank of the token in its depth's top-k (0 = the drafter's argmax)
    token_M: Tensor  # int64: token id
    score_M: Tensor  # float64: sum of log q_d along the path from the root, non-increasing in i

    @property
    def size(self) -> int:
        return int(self.parent_M.numel())


@dataclass(frozen=True)
class DDTreeBatch:
    """N trees padded to M = budget nodes; `node_valid_NM` is False on padding.

    Padding appears only when fewer than `budget` prefixes exist (K**1 + ... + K**D < budget), and
    always after the real nodes. Padded nodes have parent -1, depth 0, rank -1, token -1, score -inf.
    """

    parent_NM: Tensor  # int64 [N, M], each row as `DDTree.parent_M`
    depth_NM: Tensor  # int64 [N, M]
    rank_NM: Tensor  # int64 [N, M]
    token_NM: Tensor  # int64 [N, M]
    score_NM: Tensor  # float64 [N, M]
    node_valid_NM: Tensor  # bool [N, M]

    @property
    def n_blocks(self) -> int:
        return int(self.parent_NM.shape[0])

    def prefix(self, budget: int) -> DDTreeBatch:
        """The trees for a smaller budget: their first `budget` nodes (see the module docstring)."""
        if not 1 <= budget <= self.parent_NM.shape[1]:
            raise ValueError(f"budget must be in 1..{self.parent_NM.shape[1]}, got {budget}")
        return DDTreeBatch(*(t[:, :budget] for t in self.tensors()))

    def tree(self, i: int) -> DDTree:
        """Block i as a `DDTree`, padding dropped."""
        keep_M = self.node_valid_NM[i]
        return DDTree(*(t[i][keep_M] for t in self.tensors()[:5]))

    def tensors(self) -> tuple[Tensor, ...]:
        """All six fields in declaration order."""
        return (self.parent_NM, self.depth_NM, self.rank_NM, self.token_NM, self.score_NM, self.node_valid_NM)


@dataclass(frozen=True)
class ConditionalTopK:
    """The children of every possible parent, for N blocks of D depths with k candidate slots per depth.

    Row p of depth d+1 ranks the children of the depth-d node in candidate slot p; depth 1 uses row
    0 only (its parent is the anchor). Along the last axis the log-probabilities are sorted
    descending and `slot_NDPK` names each one's candidate slot at its own depth."""

    logprobs_NDPK: Tensor  # float: log q_d(child | parent row), sorted descending along K
    slot_NDPK: Tensor  # int64: the candidate slot (0..k-1) of the r-th best child
    token_NDk: Tensor  # int64: the token in each candidate slot of each depth

    @property
    def n_blocks(self) -> int:
        return int(self.logprobs_NDPK.shape[0])

    def block(self, i: int) -> ConditionalTopK:
        return ConditionalTopK(self.logprobs_NDPK[i : i + 1], self.slot_NDPK[i : i + 1], self.token_NDk[i : i + 1])

    def rows(self, rows: slice) -> ConditionalTopK:
        return ConditionalTopK(self.logprobs_NDPK[rows], self.slot_NDPK[rows], self.token_NDk[rows])


@dataclass(frozen=True)
class DDTreeTaus:
    """Per-block DDTree results for one budget."""

    tau_N: Tensor  # int64: 1 + accepted depth (bonus included), in 1..valid_len+1
    surrogate_tau_N: Tensor  # float64: 1 + sum of exp(score) over nodes of depth <= valid_len


# ----------------------------------------------------------------------------- inputs


def draft_topk(logits_NDV: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k (log-probabilities float32, ids int64), each [N, D, k], sorted descending.

    The log-probabilities are normalized over the full vocabulary (as DDTree requires), not
    over the k kept tokens.
    """
    if logits_NDV.ndim != 3:
        raise ValueError(f"logits must be [N, D, V], got shape {tuple(logits_NDV.shape)}")
    if not 1 <= k <= logits_NDV.shape[-1]:
        raise ValueError(f"k must be in 1..V={logits_NDV.shape[-1]}, got {k}")
    logprobs_NDV = torch.log_softmax(logits_NDV.float(), dim=-1)
    values_NDK, ids_NDK = torch.topk(logprobs_NDV, k, dim=-1, sorted=True)
    return values_NDK, ids_NDK.long()


def _check_topk(topk_logprobs: Tensor, topk_ids: Tensor, budget: int, ndim: int, name: str) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be a positive int, got {budget!r}")
    if topk_logprobs.ndim != ndim or topk_logprobs.shape != topk_ids.shape:
        raise ValueError(
            f"top-k log-probs and ids must both be {name}, got shapes "
            f"{tuple(topk_logprobs.shape)} and {tuple(topk_ids.shape)}"
        )
    if topk_logprobs.shape[-2] < 1 or topk_logprobs.shape[-1] < 1:
        raise ValueError(f"need at least one depth and one token per depth, got {name} = {tuple(topk_logprobs.shape)}")
    if not topk_logprobs.is_floating_point():
        raise ValueError("top-k log-probs must be floating point")
    if topk_ids.is_floating_point() or topk_ids.dtype == torch.bool:
        raise ValueError("top-k ids must be integers")
    if torch.isnan(topk_logprobs).any():
        raise ValueError("top-k log-probs contain NaN")
    if (topk_logprobs[..., 1:] > topk_logprobs[..., :-1]).any():
        raise ValueError("top-k log-probs must be sorted descending along the last dimension")
    # numpy's sort is ~30x faster than torch's on CPU for these small rows.
    sorted_ids = np.sort(topk_ids.detach().cpu().numpy(), axis=-1)
    if (sorted_ids[..., 1:] == sorted_ids[..., :-1]).any():
        raise ValueError("top-k ids must be distinct within each depth")


def _prepared(topk_logprobs: Tensor, topk_ids: Tensor, budget: int) -> tuple[Tensor, Tensor]:
    """Only the top-`budget` tokens per depth can enter the tree; float64, clamped to <= 0."""
    keep = min(budget, topk_logprobs.shape[-1])
    return (topk_logprobs[..., :keep].double().clamp(max=0.0), topk_ids[..., :keep].long())


def _check_conditional(topk: ConditionalTopK, budget: int) -> None:
    lp, slot, token = topk.logprobs_NDPK, topk.slot_NDPK, topk.token_NDk
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be a positive int, got {budget!r}")
    if lp.ndim != 4 or slot.shape != lp.shape or token.shape != lp.shape[:2] + lp.shape[-1:]:
        raise ValueError(
            f"conditional top-k must be [N, D, P, k] log-probs and slots and [N, D, k] tokens, got "
            f"{tuple(lp.shape)}, {tuple(slot.shape)}, {tuple(token.shape)}"
        )
    if lp.shape[2] not in (1, lp.shape[3]):
        raise ValueError(f"conditional top-k needs one row per depth or one per candidate slot, got {lp.shape[2]}")
    if torch.isnan(lp).any() or (lp[..., 1:] > lp[..., :-1]).any():
        raise ValueError("conditional log-probs must be sorted descending along the last dimension (and not NaN)")
    if not torch.equal(slot.sort(dim=-1).values, torch.arange(lp.shape[-1]).expand_as(slot)):
        raise ValueError("conditional slots must be a permutation of the candidate slots in every row")


def _prepared_conditional(topk: ConditionalTopK, budget: int) -> tuple[Tensor, Tensor]:
    """The top-`budget` children of every row (float64, clamped to <= 0) and their slots."""
    keep = min(budget, topk.logprobs_NDPK.shape[-1])
    return topk.logprobs_NDPK[..., :keep].double().clamp(max=0.0), topk.slot_NDPK[..., :keep].long()


# ----------------------------------------------------------------------------- one block


def build_ddtree(topk_logprobs_DK: Tensor, topk_ids_DK: Tensor, budget: int) -> DDTree:
    """The DDTree of one block: best-first heap over prefixes of the per-depth top-k.

    topk_logprobs_DK: log q_d of the k most likely tokens at depth d (row d-1), sorted descending,
        normalized over the full vocabulary. topk_ids_DK: their token ids (distinct per row).
    Returns min(budget, number of prefixes) nodes in pop order.
    """
    _check_topk(topk_logprobs_DK, topk_ids_DK, budget, 2, "[D, K]")
    lp_DK, ids_DK = _prepared(topk_logprobs_DK, topk_ids_DK, budget)
    return _best_first(lp_DK[:, None].tolist(), None, ids_DK.tolist(), budget)


def build_selector_ddtree(topk: ConditionalTopK, budget: int) -> DDTree:
    """The conditional DDTree of one block (`topk` with N = 1; module docstring, "Conditional trees"):
    the best-first heap over prefixes, each node's children ranked by its own row."""
    _check_conditional(topk, budget)
    lp_DPK, slot_DPK = _prepared_conditional(topk, budget)
    return _best_first(lp_DPK[0].tolist(), slot_DPK[0].tolist(), topk.token_NDk[0].tolist(), budget)


def _best_first(lp: list, slots: list | None, tokens: list, budget: int) -> DDTree:
    """The heap search over nested lists lp[d][row][rank] (rows: one shared, or one per parent slot),
    slots[d][row][rank] (None: the rank is the slot) and tokens[d][slot]."""
    n_depths, n_rows, n_ranks = len(lp), len(lp[0]), len(lp[0][0])
    parents: list[int] = []
    depths: list[int] = []
    ranks: list[int] = []
    scores: list[float] = []
    node_slots: list[int] = []

    def row(node: int) -> int:  # the row that ranks the node's children
        return node_slots[node] if node >= 0 and n_rows > 1 else 0

    # Entries are the order key itself: (-score, depth, parent index, rank).
    heap = [(-lp[0][0][0], 1, -1, 0)]
    while heap and len(scores) < budget:
        neg_score, depth, parent, rank = heapq.heappop(heap)
        node, score = len(scores), -neg_score
        parents.append(parent)
        depths.append(depth)
        ranks.append(rank)
        scores.append(score)
        node_slots.append(rank if slots is None else slots[depth - 1][row(parent)][rank])
        if rank + 1 < n_ranks:
            parent_score = 0.0 if parent < 0 else scores[parent]
            heapq.heappush(heap, (-(parent_score + lp[depth - 1][row(parent)][rank + 1]), depth, parent, rank + 1))
        if depth < n_depths:
            heapq.heappush(heap, (-(score + lp[depth][row(node)][0]), depth + 1, node, 0))

    return DDTree(
        parent_M=torch.tensor(parents, dtype=torch.long),
        depth_M=torch.tensor(depths, dtype=torch.long),
        rank_M=torch.tensor(ranks, dtype=torch.long),
        token_M=torch.tensor(
            [tokens[d - 1][slot] for d, slot in zip(depths, node_slots, strict=True)], dtype=torch.long
        ),
        score_M=torch.tensor(scores, dtype=torch.float64),
    )


def _check_valid_len(valid_len: int | None, n_depths: int) -> int:
    if valid_len is None:
        return n_depths
    if not 0 <= valid_len <= n_depths:
        raise ValueError(f"valid_len must be in 0..{n_depths}, got {valid_len}")
    return int(valid_len)


def walk_tree(tree: DDTree, target_ids_D: Tensor, valid_len: int | None = None) -> int:
    """Accepted depth: the largest d <= valid_len with (y_1..y_d) a path of the tree (τ = 1 + d).

    target_ids_D holds the target's continuation y_1..y_D; entries past valid_len are ignored.
    """
    if target_ids_D.ndim != 1:
        raise ValueError(f"target ids must be [D], got shape {tuple(target_ids_D.shape)}")
    limit = _check_valid_len(valid_len, target_ids_D.shape[0])
    child = {(p, t): i for i, (p, t) in enumerate(zip(tree.parent_M.tolist(), tree.token_M.tolist(), strict=True))}
    node, depth = -1, 0
    for y in target_ids_D[:limit].tolist():
        node = child.get((node, y))
        if node is None:
            break
        depth += 1
    return depth


def surrogate_tau(tree: DDTree, valid_len: int | None = None) -> float:
    """1 + Σ_{nodes v, depth(v) <= valid_len} exp(score(v)): E[τ] if y_d ~ q_d independently."""
    if valid_len is not None and valid_len < 0:
        raise ValueError(f"valid_len must be >= 0, got {valid_len}")
    score_M = tree.score_M if valid_len is None else tree.score_M[tree.depth_M <= valid_len]
    return 1.0 + float(score_M.exp().sum())


# ----------------------------------------------------------------------------- many blocks


def _pack_key(depth: Tensor, parent: Tensor, rank: Tensor, budget: int, n_ranks: int) -> Tensor:
    """The tie key (depth, parent, rank) as one int64 that orders like the tuple (exact)."""
    return (depth * (budget + 2) + parent + 1) * n_ranks + rank


def _unpack_key(key: Tensor, budget: int, n_ranks: int) -> tuple[Tensor, Tensor, Tensor]:
    """(depth, parent, rank) from `_pack_key`."""
    return key // (n_ranks * (budget + 2)), (key // n_ranks) % (budget + 2) - 1, key % n_ranks


def build_ddtree_batch(topk_logprobs_NDK: Tensor, topk_ids_NDK: Tensor, budget: int) -> DDTreeBatch:
    """`build_ddtree` for N blocks at once; node for node identical to it (same order, same ties).

    The same best-first search, run in lock step over the blocks: each of the `budget` steps pops
    every block's best frontier entry by the same key (max score, then the smallest
    (depth, parent, rank)), pushes its next sibling into the freed slot and its first child into a
    fresh one, so the frontier never needs more than budget + 1 slots. Cost ~ N * budget**2.
    """
    _check_topk(topk_logprobs_NDK, topk_ids_NDK, budget, 3, "[N, D, K]")
    lp_NDK, ids_NDK = _prepared(topk_logprobs_NDK, topk_ids_NDK, budget)
    return _best_first_batch(lp_NDK[:, :, None], None, ids_NDK, budget)


def build_selector_ddtree_batch(topk: ConditionalTopK, budget: int) -> DDTreeBatch:
    """`build_selector_ddtree` for N blocks at once (the search of `build_ddtree_batch`), node for node."""
    _check_conditional(topk, budget)
    lp_NDPK, slot_NDPK = _prepared_conditional(topk, budget)
    return _best_first_batch(lp_NDPK, slot_NDPK, topk.token_NDk.long(), budget)


def _best_first_batch(lp_NDPK: Tensor, slot_NDPK: Tensor | None, token_NDk: Tensor, budget: int) -> DDTreeBatch:
    """The lock-step search over rows lp[n, d, row, rank] (one row shared, or one per parent slot), with
    slot_NDPK the candidate slot of each rank (None: the rank is the slot) and token_NDk each slot's token."""
    n_blocks, n_depths, n_rows, n_ranks = lp_NDPK.shape
    lp_NF = lp_NDPK.reshape(n_blocks, -1)  # flat index ((depth - 1) * n_rows + row) * n_ranks + rank
    slot_NF = None if slot_NDPK is None else slot_NDPK.reshape(n_blocks, -1)
    neg_inf = float("-inf")

    def key(depth, parent, rank):
        return _pack_key(torch.as_tensor(depth), torch.as_tensor(parent), torch.as_tensor(rank), budget, n_ranks)

    def flat(depth_N1: Tensor, row_N1: Tensor, rank_N1: Tensor) -> Tensor:
        return (((depth_N1 - 1).clamp(0, n_depths - 1) * n_rows + row_N1) * n_ranks + rank_N1).clamp(min=0)

    # An empty slot holds a key above every real key and score -inf, so it loses every
    # comparison, even to a live entry of score -inf.
    no_entry = int(key(n_depths + 1, -1, 0))
    slot_score_NS = torch.full((n_blocks, budget + 1), neg_inf, dtype=torch.float64)
    slot_key_NS = torch.full((n_blocks, budget + 1), no_entry, dtype=torch.long)
    slot_score_NS[:, 0] = lp_NF[:, 0]
    slot_key_NS[:, 0] = key(1, -1, 0)

    key_NM = torch.full((n_blocks, budget), no_entry, dtype=torch.long)
    score_NM = torch.full((n_blocks, budget), neg_inf, dtype=torch.float64)
    row_NM = torch.zeros((n_blocks, budget), dtype=torch.long)  # the row ranking each node's children
    cand_NM = torch.zeros((n_blocks, budget), dtype=torch.long)  # each node's candidate slot
    for step in range(budget):
        # Pop: best score, ties to the smallest key. Slots past step are still empty.
        used_score_NS, used_key_NS = slot_score_NS[:, : step + 1], slot_key_NS[:, : step + 1]
        best_N1 = used_score_NS.amax(dim=1, keepdim=True)
        tied_key_NS = torch.where(used_score_NS == best_N1, used_key_NS, no_entry)
        slot_N1 = tied_key_NS.argmin(dim=1, keepdim=True)
        key_N1 = tied_key_NS.gather(1, slot_N1)
        popped_N1 = key_N1 < no_entry
        if not bool(popped_N1.any()):
            break  # every block ran out of prefixes
        score_N1 = slot_score_NS.gather(1, slot_N1)
        key_NM[:, step : step + 1] = key_N1
        score_NM[:, step : step + 1] = score_N1
        depth_N1, parent_N1, rank_N1 = _unpack_key(key_N1, budget, n_ranks)
        parent_row_N1 = torch.where(parent_N1 >= 0, row_NM.gather(1, parent_N1.clamp(min=0)), 0)
        where_N1 = flat(depth_N1, parent_row_N1, rank_N1)
        cand_N1 = rank_N1.clamp(min=0) if slot_NF is None else slot_NF.gather(1, where_N1)
        cand_NM[:, step : step + 1] = cand_N1
        row_NM[:, step : step + 1] = cand_N1 if n_rows > 1 else 0

        # Next sibling into the freed slot, scored as parent score + its own log-prob.
        parent_score_N1 = torch.where(parent_N1 >= 0, score_NM.gather(1, parent_N1.clamp(min=0)), 0.0)
        sibling_rank_N1 = (rank_N1 + 1).clamp(max=n_ranks - 1)
        sibling_ok_N1 = popped_N1 & (rank_N1 + 1 < n_ranks)
        sibling_score_N1 = parent_score_N1 + lp_NF.gather(1, flat(depth_N1, parent_row_N1, sibling_rank_N1))
        slot_score_NS.scatter_(1, slot_N1, torch.where(sibling_ok_N1, sibling_score_N1, neg_inf))
        slot_key_NS.scatter_(
            1,
            slot_N1,
            torch.where(sibling_ok_N1, _pack_key(depth_N1, parent_N1, sibling_rank_N1, budget, n_ranks), no_entry),
        )

        # First child into a fresh slot: step + 1 slots have been used so far.
        child_ok_N1 = popped_N1 & (depth_N1 < n_depths)
        child_where_N1 = flat(depth_N1 + 1, row_NM[:, step : step + 1], torch.zeros_like(rank_N1))
        child_score_N1 = score_N1 + lp_NF.gather(1, child_where_N1)
        slot_score_NS[:, step + 1 : step + 2] = torch.where(child_ok_N1, child_score_N1, neg_inf)
        slot_key_NS[:, step + 1 : step + 2] = torch.where(
            child_ok_N1, _pack_key(depth_N1 + 1, torch.tensor(step), 0, budget, n_ranks), no_entry
        )

    node_valid_NM = key_NM < no_entry
    depth_NM, parent_NM, rank_NM = _unpack_key(key_NM, budget, n_ranks)
    depth_NM = torch.where(node_valid_NM, depth_NM, 0)
    parent_NM = torch.where(node_valid_NM, parent_NM, -1)
    rank_NM = torch.where(node_valid_NM, rank_NM, -1)
    n_slots = token_NDk.shape[-1]
    token_flat_NM = (depth_NM - 1).clamp(min=0) * n_slots + cand_NM
    token_NM = torch.where(node_valid_NM, token_NDk.reshape(n_blocks, -1).gather(1, token_flat_NM), -1)
    return DDTreeBatch(
        parent_NM=parent_NM,
        depth_NM=depth_NM,
        rank_NM=rank_NM,
        token_NM=token_NM,
        score_NM=score_NM,
        node_valid_NM=node_valid_NM,
    )


def _check_batch_targets(tree: DDTreeBatch, target_ids_ND: Tensor, valid_len_N: Tensor) -> None:
    if target_ids_ND.ndim != 2 or target_ids_ND.shape[0] != tree.n_blocks:
        raise ValueError(f"target ids must be [N={tree.n_blocks}, D], got {tuple(target_ids_ND.shape)}")
    if valid_len_N.shape != (tree.n_blocks,):
        raise ValueError(f"valid lengths must be [N={tree.n_blocks}], got {tuple(valid_len_N.shape)}")
    if ((valid_len_N < 0) | (valid_len_N > target_ids_ND.shape[1])).any():
        raise ValueError(f"valid lengths must be in 0..D={target_ids_ND.shape[1]}")
    if bool((tree.depth_NM > target_ids_ND.shape[1]).any()):
        raise ValueError("the tree is deeper than the target continuation")


def walk_ddtree_batch(tree: DDTreeBatch, target_ids_ND: Tensor, valid_len_N: Tensor) -> Tensor:
    """Accepted depth per block, int64 [N] (τ = 1 + it); `walk_tree` for every block at once."""
    _check_batch_targets(tree, target_ids_ND, valid_len_N)
    depth_NM = tree.depth_NM
    target_at_node_NM = target_ids_ND.long().gather(1, (depth_NM - 1).clamp(min=0))
    hit_NM = tree.node_valid_NM & (tree.token_NM == target_at_node_NM) & (depth_NM <= valid_len_N[:, None])
    # A node is on the target's path iff it and all its ancestors hit; parents come first, so
    # propagating once per depth level settles every node.
    on_path_NM = torch.zeros_like(hit_NM)
    is_root_child_NM = tree.parent_NM < 0
    parent_NM = tree.parent_NM.clamp(min=0)
    for _ in range(int(depth_NM.max()) if depth_NM.numel() else 0):
        parent_on_path_NM = is_root_child_NM | on_path_NM.gather(1, parent_NM)
        on_path_NM = hit_NM & parent_on_path_NM
    # Trees have at least one node (budget >= 1), so the max is over a non-empty row.
    return (depth_NM * on_path_NM).amax(dim=1)


def surrogate_tau_batch(tree: DDTreeBatch, valid_len_N: Tensor) -> Tensor:
    """`surrogate_tau` per block, float64 [N]."""
    if valid_len_N.shape != (tree.n_blocks,):
        raise ValueError(f"valid lengths must be [N={tree.n_blocks}], got {tuple(valid_len_N.shape)}")
    if (valid_len_N < 0).any():
        raise ValueError("valid lengths must be >= 0")
    keep_NM = tree.node_valid_NM & (tree.depth_NM <= valid_len_N[:, None])
    return 1.0 + torch.where(keep_NM, tree.score_NM.exp(), 0.0).sum(dim=1)


def ddtree_taus(
    topk_logprobs_NDK: Tensor,
    topk_ids_NDK: Tensor,
    target_ids_ND: Tensor,
    valid_len_N: Tensor,
    budgets: Iterable[int],
    chunk_blocks: int = 4096,
) -> dict[int, DDTreeTaus]:
    """Realized and surrogate DDTree τ per block for each budget, from one build at the largest.

    topk_*_NDK: the drafter's top-k per depth (k >= max budget for the exact DDTree; fewer gives
    the tree over those k tokens only). target_ids_ND: y_1..y_D. valid_len_N: number of target
    tokens present, 0..D. Processed `chunk_blocks` blocks at a time to bound memory.
    """
    if topk_logprobs_NDK.shape[:1] != (topk_ids_NDK.shape[0],):
        raise ValueError("top-k log-probs and ids must have the same N")

    def build(rows: slice, budget: int) -> DDTreeBatch:
        return build_ddtree_batch(topk_logprobs_NDK[rows], topk_ids_NDK[rows], budget)

    return _taus(build, topk_logprobs_NDK.shape[0], target_ids_ND, valid_len_N, budgets, chunk_blocks)


def selector_ddtree_taus(
    topk: ConditionalTopK,
    target_ids_ND: Tensor,
    valid_len_N: Tensor,
    budgets: Iterable[int],
    chunk_blocks: int = 4096,
) -> dict[int, DDTreeTaus]:
    """`ddtree_taus` of the conditional trees (a DFlash2 drafter's selector: `build_selector_ddtree_batch`);
    the surrogate is E[τ] if each y_d follows q_d(. | y_{d-1}) over the candidates."""
    return _taus(
        lambda rows, budget: build_selector_ddtree_batch(topk.rows(rows), budget),
        topk.n_blocks,
        target_ids_ND,
        valid_len_N,
        budgets,
        chunk_blocks,
    )


def _taus(build, n_blocks: int, target_ids_ND: Tensor, valid_len_N: Tensor, budgets, chunk_blocks: int):
    budgets = sorted(set(budgets))
    if not budgets:
        raise ValueError("need at least one budget")
    if chunk_blocks < 1:
        raise ValueError(f"chunk_blocks must be >= 1, got {chunk_blocks}")
    if target_ids_ND.shape[:1] != (n_blocks,) or valid_len_N.shape != (n_blocks,):
        raise ValueError("top-k inputs, target ids and valid lengths must have the same N")
    parts: dict[int, list[DDTreeTaus]] = {b: [] for b in budgets}
    for start in range(0, n_blocks, chunk_blocks):
        rows = slice(start, start + chunk_blocks)
        full = build(rows, budgets[-1])
        for b in budgets:
            tree = full.prefix(b)
            parts[b].append(
                DDTreeTaus(
                    tau_N=1 + walk_ddtree_batch(tree, target_ids_ND[rows], valid_len_N[rows]),
                    surrogate_tau_N=surrogate_tau_batch(tree, valid_len_N[rows]),
                )
            )
    if n_blocks == 0:
        return {
            b: DDTreeTaus(tau_N=torch.zeros(0, dtype=torch.long), surrogate_tau_N=torch.zeros(0, dtype=torch.float64))
            for b in budgets
        }
    return {
        b: DDTreeTaus(
            tau_N=torch.cat([p.tau_N for p in ps]), surrogate_tau_N=torch.cat([p.surrogate_tau_N for p in ps])
        )
        for b, ps in parts.items()
    }
