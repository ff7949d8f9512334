"""The DFlash block and label alignment (docs/dflash.md, "Blocks and label alignment"), in one place.

A block anchored at position `a` is the token at `a` followed by `block_size - 1` mask tokens, at
positions `a, a+1, ..., a+block_size-1`. Block position `k` predicts the token at `a + k`. Shards
store at row `t` the target's top-k for the token at `t + 1`, so the label of block position `k` is
the stored top-1 at row `a + k - 1`. Training (`train/blocks.py`), offline evaluation
(`train/eval/`) and speculative decoding with its offline replay (`train/serve/`) build
blocks and labels only through these functions; tests/train/test_alignment.py holds them to it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def block_positions(anchors: Tensor, block_size: int) -> Tensor:
    """int64 [..., block_size]: the position `a + k` of every block position k of each anchor."""
    return anchors.long()[..., None] + torch.arange(block_size, device=anchors.device)


def block_input_ids(anchor_ids: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """int64 [..., block_size]: each block's input, its anchor token then `block_size - 1` mask tokens."""
    shape = (*anchor_ids.shape, block_size)
    ids = torch.full(shape, int(mask_token_id), dtype=torch.long, device=anchor_ids.device)
    ids[..., 0] = anchor_ids
    return ids


def label_rows(positions: Tensor) -> Tensor:
    """The stored row whose top-1 is the target's label for the token at each position: position - 1."""
    return positions - 1


def draft_label_rows(anchors: Tensor, block_size: int) -> Tensor:
    """int64 [..., block_size - 1]: the label rows `a + k - 1` of the draft positions k = 1..block_size-1."""
    return label_rows(block_positions(anchors, block_size)[..., 1:])
