"""A DFlash2 drafter's own proposals, offline (`train.dflash2`, docs/dflash.md "DFlash2"): for blocks of
drafter hidden states and the target head's logits there, the candidate selector's greedy walk (what
serving proposes) with the log-probability of each of its steps, and the selector's distributions for
every possible parent (the inputs of the conditional DDTree, `train.eval.ddtree.ConditionalTopK`).

At block position j the candidates C_j are the top-k of the head's logits U_j, and given the token a
before it (the anchor at j = 1) the selector scores S_j(a, b) = U_j(b) + <A[a] * P(h_j), B[b]> over
b in C_j; q_j(b | a) = softmax_b S_j(a, b). The parents of position j that a tree can hold are the
anchor (j = 1) and the k candidates of position j-1, so the distributions form a lattice of k rows
per position (row p: the parent in candidate slot p of position j-1; at j = 1 every row is the
anchor's), the layout vLLM and SGLang score in one pass (`_score_edges`).

Shape legend: M blocks, D draft positions, H hidden, V vocabulary, k candidates, P parent rows (= k), r rank.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from train.dflash2 import CandidateSelector
from train.eval.ddtree import ConditionalTopK

__all__ = ["SelectorDrafts", "lattice_of", "selector_drafts", "selector_logq"]


@dataclasses.dataclass
class SelectorDrafts:
    """The selector's proposals for M blocks."""

    walk_MD: Tensor  # int64: the greedy walk (the proposal served)
    walk_logprob_MD: Tensor  # float32: log q_j(walk_j | walk_{j-1}) of each step (the anchor before step 1)
    lattice: ConditionalTopK  # q_j(. | every parent), sorted per row, for the conditional DDTree

    def to(self, device) -> SelectorDrafts:
        lattice = self.lattice
        return SelectorDrafts(
            self.walk_MD.to(device),
            self.walk_logprob_MD.to(device),
            ConditionalTopK(
                lattice.logprobs_NDPK.to(device), lattice.slot_NDPK.to(device), lattice.token_NDk.to(device)
            ),
        )

    @staticmethod
    def concat(parts: list[SelectorDrafts]) -> SelectorDrafts:
        return SelectorDrafts(
            torch.cat([p.walk_MD for p in parts]),
            torch.cat([p.walk_logprob_MD for p in parts]),
            ConditionalTopK(*(torch.cat(t) for t in zip(*(_lattice_tensors(p.lattice) for p in parts), strict=True))),
        )


def _lattice_tensors(lattice: ConditionalTopK) -> tuple[Tensor, Tensor, Tensor]:
    return lattice.logprobs_NDPK, lattice.slot_NDPK, lattice.token_NDk


@torch.no_grad()
def selector_drafts(
    selector: CandidateSelector, hidden_MDH: Tensor, logits_MDV: Tensor, anchor_M: Tensor
) -> SelectorDrafts:
    """The walk (`CandidateSelector.walk`, exactly as `DFlash2Drafter.propose` proposes) and the lattice
    of q over the candidates for blocks with final hidden states `hidden_MDH` at positions 1..D, the
    head's logits there and the anchor tokens."""
    M, D, _ = hidden_MDH.shape
    unary_MDk, candidates_MDk = logits_MDV.float().topk(selector.top_k, dim=-1)
    walk_MD = selector.walk(hidden_MDH, unary_MDk, candidates_MDk, anchor_M)
    logq_MDPk = selector_logq(selector, hidden_MDH, unary_MDk, candidates_MDk, anchor_M)
    # Each walk step's log q: the row of the previous step's slot (row 0 at step 1), the column of its own.
    walk_slot_MD = (candidates_MDk == walk_MD[..., None]).float().argmax(dim=-1)
    row_MD = torch.cat((torch.zeros_like(walk_slot_MD[:, :1]), walk_slot_MD[:, :-1]), dim=1)
    row_logq_MDk = logq_MDPk.gather(2, row_MD[:, :, None, None].expand(M, D, 1, selector.top_k))[:, :, 0]
    walk_logprob_MD = row_logq_MDk.gather(2, walk_slot_MD[..., None])[..., 0]
    return SelectorDrafts(walk_MD, walk_logprob_MD, lattice_of(logq_MDPk, candidates_MDk))


def selector_logq(selector, hidden_MDH: Tensor, unary_MDk: Tensor, candidates_MDk: Tensor, anchor_M: Tensor) -> Tensor:
    """log q_j(c | parent) [M, D, P, k], float32, for every parent row: the anchor at j = 1 (every row),
    else the candidate in slot p of position j-1. `selector`: any module with the published selector
    parameters (the training model's `CandidateSelector`, an export's `DFlash2CandidateSelector`)."""
    M, _, k = candidates_MDk.shape
    parents_MDP = torch.cat((anchor_M[:, None, None].expand(M, 1, k), candidates_MDk[:, :-1]), dim=1)
    gate_MDr = selector.hidden_projection(hidden_MDH.to(selector.successor_codebook.dtype))
    gate_MDPr = selector.predecessor_codebook[parents_MDP] * gate_MDr[:, :, None]
    pair_MDPk = torch.einsum("mdpr,mdkr->mdpk", gate_MDPr, selector.successor_codebook[candidates_MDk])
    return (unary_MDk.float()[:, :, None] + pair_MDPk.float()).log_softmax(dim=-1)


def lattice_of(logq_MDPk: Tensor, candidates_MDk: Tensor) -> ConditionalTopK:
    """The conditional DDTree's input: every row's log q sorted descending (ties: the lower slot first)."""
    sorted_MDPk, slot_MDPk = logq_MDPk.sort(dim=-1, descending=True, stable=True)
    return ConditionalTopK(sorted_MDPk, slot_MDPk, candidates_MDk)
