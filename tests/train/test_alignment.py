"""The one block / label alignment rule (`train.alignment`, docs/dflash.md "Blocks and label
alignment"), and the three places that use it agreeing: the trainer's blocks, offline evaluation's
blocks and targets, and the offline replay of speculative decoding."""

from __future__ import annotations

import torch

from train.alignment import block_input_ids, block_positions, draft_label_rows, label_rows
from train.blocks import BlockSpec, make_blocks
from train.eval.anchors import block_anchors, block_targets
from train.eval.drafting import Piece, forward_inputs
from train.serve.agreement import _chain

MASK, K = 99, 4


def test_a_block_is_its_anchor_token_then_masks_at_consecutive_positions():
    anchors = torch.tensor([[2, 5]])
    assert block_positions(anchors, K).tolist() == [[[2, 3, 4, 5], [5, 6, 7, 8]]]
    assert block_input_ids(torch.tensor([[12, 15]]), K, MASK).tolist() == [
        [[12, MASK, MASK, MASK], [15, MASK, MASK, MASK]]
    ]
    # The label of the token at position p is the target's top-1 stored at row p - 1.
    assert label_rows(torch.tensor([3, 4])).tolist() == [2, 3]
    assert draft_label_rows(torch.tensor([2, 5]), K).tolist() == [[2, 3, 4], [5, 6, 7]]


def test_labels_are_the_data_tokens_when_the_target_predicts_the_data():
    """Row t stores the prediction of the token at t + 1: where that prediction is the data token,
    the label of every draft position is exactly the token at its own position (no shift)."""
    ids_T = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(0))
    top1_T = torch.cat([ids_T[1:], torch.tensor([0])])  # a target that always predicts the data
    anchors = torch.tensor([0, 7, 20, 35])
    rows = draft_label_rows(anchors, K).clamp(max=len(ids_T) - 1)
    positions = block_positions(anchors, K)[:, 1:]
    inside = positions < len(ids_T)
    assert torch.equal(top1_T[rows][inside], ids_T[positions.clamp(max=len(ids_T) - 1)][inside])


def sequence():
    """One sequence: 30 tokens, prompt 0..5, response 6..29; the target's top-1 differs from the data."""
    T = 30
    ids_T = 10 + torch.arange(T)
    loss_mask_T = torch.zeros(T, dtype=torch.bool)
    loss_mask_T[6:] = True
    top1_T = 500 + torch.arange(T)  # row t: the target's top-1 for the token at t + 1
    return ids_T, loss_mask_T, top1_T


def test_training_evaluation_and_speculative_replay_build_the_same_blocks_and_labels():
    ids_T, loss_mask_T, top1_T = sequence()
    T, D = len(ids_T), K - 1
    blocks = make_blocks(
        ids_T[None],
        loss_mask_T[None],
        torch.tensor([T]),
        top1_T[None, :, None],
        BlockSpec(block_size=K, mask_token_id=MASK, num_anchors=T, gamma=7.0),
        generator=torch.Generator().manual_seed(0),
    )
    anchors = blocks.anchors_BN[0][blocks.keep_BN[0]]
    eval_anchors, valid_len = block_anchors(loss_mask_T, D)
    assert torch.equal(anchors, eval_anchors)  # every response position with a response token after it

    # Block inputs and positions: training and evaluation.
    piece = Piece(0, ids_T, torch.zeros(T, 2), anchors, valid_len, block_targets(top1_T, anchors, D))
    inputs = forward_inputs([piece], K, MASK)
    n = len(anchors)
    assert torch.equal(inputs.block_ids_RQ[0, : n * K], blocks.block_ids_BQ[0, : n * K])
    assert torch.equal(inputs.position_ids_RP[0, -n * K :], blocks.position_ids_BP[0, -n * K :])

    # Labels: training's weighted labels, evaluation's targets and the speculative replay's targets.
    labels_AK = blocks.labels_BQ[0].view(-1, K)[:n]
    weighted_AK = blocks.weights_BQ[0].view(-1, K)[:n] > 0
    eval_AD = block_targets(top1_T, anchors, D)
    for a in range(n):
        for k in range(1, K):
            if weighted_AK[a, k]:
                assert labels_AK[a, k] == eval_AD[a, k - 1] == top1_T[anchors[a] + k - 1]
    assert weighted_AK[:, 1:].any(dim=1).all()

    # The replay scores drafts against the same labels: evaluation's targets are accepted in full
    # (up to the tokens left), the data tokens (the labels shifted by one) nowhere.
    replay = _chain(eval_AD, top1_T, anchors.tolist(), T)
    assert torch.equal(replay.streak_N, replay.valid_ND.sum(dim=1)) and bool(replay.valid_ND.any())
    shifted = _chain(ids_T[block_positions(anchors, K)[:, 1:].clamp(max=T - 1)], top1_T, anchors.tolist(), T)
    assert int(shifted.streak_N.sum()) == 0
