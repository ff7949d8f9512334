"""The most-frequent-label baseline: a draft-free "drafter" whose distribution at every depth of every
block is the frequency of the labels at the valid positions of these very blocks. Its chain drafts
the most frequent label everywhere, its DDTree holds the most frequent labels at every depth. A
drafter is only worth its margin over this.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from train.eval.acceptance import valid_mask
from train.eval.render import BASELINE_NAME
from train.eval.scoring import BlockTable, DraftScores, score_drafts, summarize_model

# Blocks per scoring call of the baseline (its per-depth top-k is the same for every block).
_BASELINE_CHUNK = 4096


def label_frequency_topk(table: BlockTable, k: int) -> tuple[Tensor, Tensor]:
    """(log-frequency float32, id int64), each [min(k, distinct labels)], of the labels at the valid
    positions of the blocks, most frequent first (ties: the smaller id first)."""
    n_draft = table.target_ids_ND.shape[1]
    if table.n_blocks == 0:
        return torch.zeros(0), torch.zeros(0, dtype=torch.long)
    labels = table.target_ids_ND[valid_mask(table.valid_len_N, n_draft)]
    counts = torch.bincount(labels)
    ids = counts.nonzero().view(-1)  # ascending, so the stable sort breaks ties by id
    ids = ids[torch.sort(counts[ids], descending=True, stable=True).indices[:k]]
    return (counts[ids].double() / labels.numel()).log().float(), ids


def label_baseline(table: BlockTable, budgets: Sequence[int], topk: int) -> DraftScores:
    """Scores of the draft-free baseline on the blocks of `table`: at every depth of every block,
    the label frequency of these blocks (see the module docstring)."""
    n_draft = table.target_ids_ND.shape[1]
    budgets = sorted(set(budgets))
    lp_k, ids_k = label_frequency_topk(table, topk)
    parts = []
    for start in range(0, table.n_blocks, _BASELINE_CHUNK):
        rows = slice(start, start + _BASELINE_CHUNK)
        n = table.target_ids_ND[rows].shape[0]
        # The same top-k at every depth of every block: a broadcast view, not n x D copies.
        parts.append(
            score_drafts(
                lp_k.expand(n, n_draft, -1),
                ids_k.expand(n, n_draft, -1),
                table.target_ids_ND[rows],
                table.valid_len_N[rows],
                budgets,
                BASELINE_NAME,
            )
        )
    return DraftScores.concat(parts, n_draft, budgets)


def baseline_report(table: BlockTable, budgets: Sequence[int], topk: int, buckets: Sequence[dict]) -> dict:
    """The JSON `baseline` entry: what it is, its token, and its summaries like a checkpoint's."""
    lp_k, ids_k = label_frequency_topk(table, topk)
    return {
        "name": BASELINE_NAME,
        "token": int(ids_k[0]) if ids_k.numel() else None,
        "token_share": float(lp_k[0].exp()) if lp_k.numel() else None,
        "description": "chain: always the most frequent label of these blocks; DDTree: the label frequencies at "
        "every depth",
        **summarize_model(table, label_baseline(table, budgets, topk), buckets),
    }
