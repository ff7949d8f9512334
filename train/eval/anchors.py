"""The evaluated blocks of one sample: every response position with a response token after it (or a
seeded subsample), each with its valid length (`block_anchors`).
"""

from __future__ import annotations

import torch
import xxhash
from torch import Tensor

from train.alignment import draft_label_rows

_ANCHOR_SALT = b"dflash-eval-anchors:"


def response_run_lengths(loss_mask_T: Tensor) -> Tensor:
    """int64 [T]: how many consecutive response positions start at t (0 where t is not one)."""
    mask_T = loss_mask_T.bool()
    T = mask_T.numel()
    position_T = torch.arange(T)
    breaks_T = torch.where(mask_T, T, position_T)
    first_break_at_or_after_T = breaks_T.flip(0).cummin(0).values.flip(0)
    return first_break_at_or_after_T - position_T


def _anchor_generator_seed(seed: int, sample_id: str) -> int:
    return xxhash.xxh3_64_intdigest(_ANCHOR_SALT + f"{seed}:{sample_id}".encode()) & (2**63 - 1)


def block_anchors(
    loss_mask_T: Tensor,
    n_draft: int,
    *,
    min_valid_len: int = 1,
    max_anchors: int | None = None,
    seed: int = 0,
    sample_id: str = "",
) -> tuple[Tensor, Tensor]:
    """(anchors_A sorted, valid_len_A): response positions a with >= min_valid_len response tokens
    right after them (valid length L = that count, at most n_draft); at most `max_anchors` of them,
    drawn uniformly without replacement from a generator fixed by (seed, sample id)."""
    run_T = response_run_lengths(loss_mask_T)
    next_run_T = torch.zeros_like(run_T)
    next_run_T[:-1] = run_T[1:]
    valid_len_T = next_run_T.clamp(max=n_draft)
    eligible_T = loss_mask_T.bool() & (valid_len_T >= max(1, min_valid_len))
    anchors_A = eligible_T.nonzero().view(-1)
    if max_anchors is not None and anchors_A.numel() > max_anchors:
        generator = torch.Generator().manual_seed(_anchor_generator_seed(seed, sample_id))
        pick = torch.randperm(anchors_A.numel(), generator=generator)[:max_anchors]
        anchors_A = anchors_A[pick].sort().values
    return anchors_A, valid_len_T[anchors_A]


def block_targets(top1_T: Tensor, anchors_A: Tensor, n_draft: int) -> Tensor:
    """int64 [A, D]: y_k = the target's greedy token for position a+k = top1[a+k-1] (0 past the end)."""
    T = top1_T.numel()
    row_AD = draft_label_rows(anchors_A, n_draft + 1)  # row a+k-1 for k = 1..D
    inside_AD = row_AD < T
    return torch.where(inside_AD, top1_T.long()[row_AD.clamp(max=T - 1)], 0)
