"""DFlash2's selector loss, its weight schedule, and what it measures (docs/dflash.md "DFlash2").

For each loss row m (a block position k >= 1 with weight w_m > 0) the head pass (`train.loss`)
gives the top-k logits U_m and their ids C_m. The selector (`train.dflash2.CandidateSelector`)
scores the candidates after the row's teacher-forced predecessor a_m (`Blocks.predecessors_BQ`:
the anchor token at k = 1, the label of k-1 after it):

    S_m(b) = U_m(b) + < A[a_m] * P(h_m), B[b] >        for b in C_m
    selector loss = sum_m w_m * covered_m * CE(S_m, index of label_m in C_m) / sum_m w_m

covered_m: the label is among the k candidates. A row whose label is not is no selector example (a
recall failure of the backbone's top-k, which only the DFlash term can fix) and adds nothing.
The denominator is the DFlash term's weight total over all its rows, covered or not (SpecForge's
rule; the loss part of a data-parallel step gets the global total), so the two terms share one
scale and the selector term shrinks as coverage falls instead of growing to fill it. U keeps its
gradient into the hidden states (through the head rows of the candidates) and so does P(h): by
default the selector loss also trains the backbone, as in SpecForge, NeMo and speculators.

    objective = DFlash term + selector_weight(step) * selector loss

`selector_weight_at` is SpecForge's schedule: 0 for the first int(N * warmup_ratio) of N steps,
then a linear ramp over int(N * ramp_ratio) steps to `loss.selector_weight` (at once when the ramp
is 0). During the warm-up the selector still runs with weight 0, so every parameter gets a
gradient on every step (data parallelism needs that).

What it measures, from the same rows (`SelectorStats`): coverage (the share of the loss rows'
weight whose label is a candidate, so that selector loss / coverage is the mean cross-entropy over
the covered rows), the teacher-forced accuracy per block position, and the served streak. The engines
serve the selector's greedy walk: position j takes the best candidate after the token chosen at
j-1. Inside a block's leading run of correct choices the chosen predecessor IS the label, so the
walk's accepted length equals the leading run of teacher-forced hits (a miss, or a position
without weight, ends both), computed exactly like the unary streak (`train.loss.block_accuracy`).

Shape legend: M loss rows, k candidates, D hidden, B rows, N blocks, K block size.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from train.blocks import Blocks

__all__ = ["SelectorStats", "selector_terms", "selector_weight_at"]


def selector_weight_at(step: int, total_steps: int, target: float, warmup_ratio: float, ramp_ratio: float) -> float:
    """The selector loss's weight at 1-based optimizer `step` of `total_steps` (module docstring)."""
    s = step - 1
    warmup = int(total_steps * warmup_ratio)
    if s < warmup:
        return 0.0
    ramp = int(total_steps * ramp_ratio)
    if ramp <= 0:
        return float(target)
    return float(target) * min(max((s - warmup + 1) / ramp, 0.0), 1.0)


@dataclasses.dataclass
class SelectorStats:
    """One part's selector term and counts (sums, so the parts of a step add up)."""

    loss: torch.Tensor  # detached: sum(w * covered * CE) / the DFlash term's weight total
    unary_loss: torch.Tensor  # detached: the DFlash term alone
    weight: float  # the selector weight this step
    coverage: torch.Tensor  # float: sum(w * covered) / the DFlash term's weight total
    correct_K: torch.Tensor  # float [K]: per block position, rows whose teacher-forced selector choice is the label
    streak_sum: torch.Tensor  # float: sum over kept blocks of the served walk's accepted length


def selector_terms(
    selector: torch.nn.Module,
    hidden_MD: torch.Tensor,
    unary_Mk: torch.Tensor,
    candidates_Mk: torch.Tensor,
    labels_M: torch.Tensor,
    w_M: torch.Tensor,
    blocks: Blocks,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(selector loss with its gradient, coverage, hits [M] bool) of the loss rows; `w_M` already divided by
    the DFlash term's weight total."""
    predecessors_M = blocks.predecessors_BQ.reshape(-1).index_select(0, blocks.loss_rows_M)
    scores_Mk = selector.scores(hidden_MD, unary_Mk, candidates_Mk, predecessors_M)
    is_label_Mk = candidates_Mk == labels_M[:, None]
    covered_M = is_label_Mk.any(dim=-1)
    index_M = is_label_Mk.to(torch.uint8).argmax(dim=-1)  # 0 where uncovered: those rows have weight 0 here
    ce_M = F.cross_entropy(scores_Mk, index_M, reduction="none")
    loss = (w_M * covered_M * ce_M).sum()
    hits_M = covered_M & (scores_Mk.detach().argmax(dim=-1) == index_M)
    return loss, (w_M.detach() * covered_M).sum(), hits_M
