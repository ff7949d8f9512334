"""Chain acceptance metrics of a drafter, offline: pure torch over batched blocks, no model.

One block = one anchor. The drafter proposes draft_k for block positions k = 1..D (D = B-1); the
target's greedy continuation is y_1..y_D (docs/dflash.md "Acceptance length (τ)"). Online, the
target accepts the leading drafts that equal its own tokens and adds one bonus token, so a block's
chain τ is 1 + streak, streak = number of leading k with draft_k == y_k.

Cut blocks. A block anchored near the end of a response has only L < D target tokens (its valid
length); positions k > L have no target token. Online, such a round ends the response, so it can
accept at most L drafts. Here:
  - streak = leading agreements among positions 1..L only (so streak <= L, τ <= L + 1);
  - positions k > L are not counted in any per-position rate (they are neither agreements nor
    disagreements);
  - "all accepted" means streak == D: a cut block is never all accepted (it is counted in the
    denominator, as the online round it mirrors did not accept B-1 drafts);
  - the chain surrogate sums over k <= L only.
A block must have L >= 1: an anchor with no token after it has nothing to verify (online there is
no such round), so it is a caller error.

Per-position rates (k = 1..D, lists indexed k-1):
  - `position_acceptance[k]`  = P(draft_k == y_k), over blocks with k <= L (unconditional: a draft
    can agree after an earlier miss);
  - `conditional_acceptance[k]` = P(streak >= k | streak >= k-1), over blocks with k <= L and
    streak >= k-1 (the chance the chain survives position k once it reached it). Without cut
    blocks, 1 + Σ_k Π_{i<=k} conditional_acceptance[i] equals the mean chain τ exactly.
Each comes with its denominator (`position_count`, `conditional_count`); a rate with denominator 0
is None.

Surrogate chain τ (draft-only, target-free): 1 + Σ_{k<=L} Π_{i<=k} q_i(draft_i), with q_i the
drafter's probability of its own argmax. It equals E[chain τ] if each draft_i is right
independently with probability q_i (speculators' EAL + 1; docs/dflash.md "Acceptance length (τ)", "DDTree").

From shards (docs/ARCHITECTURE.md, block alignment): for an anchor at position a, y_k =
topk_ids[a + k - 1, 0], and L = the number of k in 1..D whose position a + k still lies in the
response (so an anchor at the last response position has L = 0 and makes no block). The exact
rule is eval's; these functions only need L.

Averages are over blocks (anchors), not the per-response mean of per-round τ that online benchmarks
report (an anchor-level mean is not a per-round mean).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ChainBlocks",
    "accepted_streak",
    "chain_blocks",
    "summarize_blocks",
    "summarize_by_group",
    "valid_mask",
]


@dataclass(frozen=True)
class ChainBlocks:
    """Per-block chain results for N blocks of D draft positions (column k-1 = block position k)."""

    agree_ND: Tensor  # bool: draft_k == y_k at a valid position (False past the valid length)
    valid_ND: Tensor  # bool: position k has a target token (k <= valid length)
    streak_N: Tensor  # int64: leading accepted drafts, 0..valid length
    surrogate_tau_N: Tensor | None = None  # float64, when draft log-probs were given

    @property
    def n_blocks(self) -> int:
        return int(self.agree_ND.shape[0])

    @property
    def n_positions(self) -> int:
        return int(self.agree_ND.shape[1])

    @property
    def tau_N(self) -> Tensor:
        """Chain τ per block: accepted drafts + the bonus token."""
        return 1 + self.streak_N

    @property
    def valid_len_N(self) -> Tensor:
        return self.valid_ND.sum(dim=1)


def valid_mask(valid_len_N: Tensor, n_positions: int) -> Tensor:
    """bool [N, D]: position k (column k-1) valid iff k <= valid length; lengths must be 1..D."""
    if valid_len_N.ndim != 1 or valid_len_N.is_floating_point():
        raise ValueError(
            f"valid lengths must be an integer tensor [N], got {valid_len_N.dtype} {tuple(valid_len_N.shape)}"
        )
    if ((valid_len_N < 1) | (valid_len_N > n_positions)).any():
        raise ValueError(
            f"valid lengths must be in 1..D={n_positions} (a block needs a target "
            f"token to verify), got min {int(valid_len_N.min())}, max {int(valid_len_N.max())}"
        )
    return torch.arange(1, n_positions + 1) <= valid_len_N[:, None]


def accepted_streak(agree_ND: Tensor) -> Tensor:
    """int64 [N]: number of leading True entries per row."""
    return agree_ND.long().cumprod(dim=1).sum(dim=1)


def chain_blocks(
    draft_ids_ND: Tensor, target_ids_ND: Tensor, valid_len_N: Tensor, draft_top1_logprobs_ND: Tensor | None = None
) -> ChainBlocks:
    """Chain acceptance per block.

    draft_ids_ND: the drafter's argmax at block positions 1..D. target_ids_ND: y_1..y_D (any value
    past the valid length; it is ignored). valid_len_N: number of target tokens present, 1..D.
    draft_top1_logprobs_ND (optional): log q_k(draft_k), for the surrogate chain τ.
    """
    if draft_ids_ND.ndim != 2 or draft_ids_ND.shape != target_ids_ND.shape:
        raise ValueError(
            f"draft and target ids must both be [N, D], got {tuple(draft_ids_ND.shape)} "
            f"and {tuple(target_ids_ND.shape)}"
        )
    n_blocks, n_positions = draft_ids_ND.shape
    if valid_len_N.shape != (n_blocks,):
        raise ValueError(f"valid lengths must be [N={n_blocks}], got {tuple(valid_len_N.shape)}")
    valid_ND = valid_mask(valid_len_N, n_positions)
    agree_ND = (draft_ids_ND.long() == target_ids_ND.long()) & valid_ND

    surrogate_tau_N = None
    if draft_top1_logprobs_ND is not None:
        if draft_top1_logprobs_ND.shape != draft_ids_ND.shape:
            raise ValueError(
                f"draft log-probs must be [N, D] = {tuple(draft_ids_ND.shape)}, got "
                f"{tuple(draft_top1_logprobs_ND.shape)}"
            )
        if torch.isnan(draft_top1_logprobs_ND).any():
            raise ValueError("draft log-probs contain NaN")
        # float64 cumulative sum: products of 15 probabilities lose little, but sums over many
        # blocks are compared against exact references.
        prefix_prob_ND = draft_top1_logprobs_ND.double().clamp(max=0.0).cumsum(dim=1).exp()
        surrogate_tau_N = 1.0 + torch.where(valid_ND, prefix_prob_ND, 0.0).sum(dim=1)

    return ChainBlocks(
        agree_ND=agree_ND, valid_ND=valid_ND, streak_N=accepted_streak(agree_ND), surrogate_tau_N=surrogate_tau_N
    )


def _rate(numerator: Tensor, denominator: Tensor) -> list[float | None]:
    return [
        None if int(d) == 0 else float(n) / float(d)
        for n, d in zip(numerator.tolist(), denominator.tolist(), strict=True)
    ]


def _mean(x_N: Tensor) -> float | None:
    return None if x_N.numel() == 0 else float(x_N.double().mean())


def summarize_blocks(
    blocks: ChainBlocks, extra_N: Mapping[str, Tensor] | None = None, select_N: Tensor | None = None
) -> dict[str, Any]:
    """Aggregate metrics over the selected blocks (all if `select_N` is None), JSON-ready.

    Keys: n_blocks, n_cut (blocks with valid length < D), tau (mean chain τ), streak, all_accepted
    (fraction with streak == D), tau_histogram (counts of τ = 1..D+1), position_acceptance,
    position_count, conditional_acceptance, conditional_count, surrogate_tau (only if `blocks`
    has it), and for each name in `extra_N` (per-block values, e.g. DDTree τ) its mean. With no
    block selected every rate and mean is None and every count 0.
    """
    n_positions = blocks.n_positions
    if select_N is None:
        select_N = torch.ones(blocks.n_blocks, dtype=torch.bool)
    if select_N.shape != (blocks.n_blocks,) or select_N.dtype != torch.bool:
        raise ValueError(f"select must be a bool tensor [N={blocks.n_blocks}]")
    extra_N = dict(extra_N or {})
    for name, values_N in extra_N.items():
        if values_N.shape != (blocks.n_blocks,):
            raise ValueError(f"extra metric {name!r} must be [N={blocks.n_blocks}], got {tuple(values_N.shape)}")

    agree_ND, valid_ND = blocks.agree_ND[select_N], blocks.valid_ND[select_N]
    streak_N = blocks.streak_N[select_N]
    reached_ND = streak_N[:, None] >= torch.arange(0, n_positions)  # streak >= k-1 at column k-1
    survived_ND = streak_N[:, None] >= torch.arange(1, n_positions + 1)  # streak >= k

    position_count = valid_ND.sum(dim=0)
    conditional_count = (reached_ND & valid_ND).sum(dim=0)
    summary: dict[str, Any] = {
        "n_blocks": int(streak_N.numel()),
        "n_cut": int((~valid_ND[:, -1]).sum()),
        "tau": _mean(1 + streak_N),
        "streak": _mean(streak_N),
        "all_accepted": _mean(streak_N == n_positions),
        "tau_histogram": torch.bincount(streak_N, minlength=n_positions + 1).tolist(),
        "position_acceptance": _rate(agree_ND.sum(dim=0), position_count),
        "position_count": position_count.tolist(),
        "conditional_acceptance": _rate(survived_ND.sum(dim=0), conditional_count),
        "conditional_count": conditional_count.tolist(),
    }
    if blocks.surrogate_tau_N is not None:
        summary["surrogate_tau"] = _mean(blocks.surrogate_tau_N[select_N])
    for name, values_N in extra_N.items():
        if name in summary:
            raise ValueError(f"extra metric name {name!r} collides with a built-in key")
        summary[name] = _mean(values_N[select_N])
    return summary


def summarize_by_group(
    blocks: ChainBlocks, group_N: Tensor, groups: Sequence[int], extra_N: Mapping[str, Tensor] | None = None
) -> dict[int, dict[str, Any]]:
    """`summarize_blocks` per group id, for every id in `groups`, in that order.

    A group with no block is reported with n_blocks 0 and None metrics, never skipped. Every block's
    group must be listed (otherwise blocks would silently drop out of the table).
    """
    groups = [int(g) for g in groups]
    if len(set(groups)) != len(groups):
        raise ValueError(f"group ids must be distinct, got {groups}")
    if group_N.shape != (blocks.n_blocks,) or group_N.is_floating_point():
        raise ValueError(f"group ids must be an integer tensor [N={blocks.n_blocks}]")
    unlisted = sorted(set(group_N.unique().tolist()) - set(groups))
    if unlisted:
        raise ValueError(f"blocks have group ids {unlisted} not in groups {groups}")
    return {g: summarize_blocks(blocks, extra_N, select_N=group_N == g) for g in groups}
