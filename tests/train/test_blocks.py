"""Anchors, block inputs, labels and weights (docs/dflash.md "Blocks and label alignment", "Anchors", "Attention mask",
"Loss") on hand-made sequences."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from common.config import load_config
from train.blocks import (
    BlockSpec,
    anchor_candidates,
    default_gamma,
    make_blocks,
    position_weights,
    sample_anchors,
    step_generator,
)
from train.config import TrainConfig

MASK = 99
K = 4
GAMMA = 7.0


def hand_batch():
    """Row 0: x[t] = 10 + t, 12 tokens, prompt 0..3, response 4..11.
    Row 1: 8 tokens (padded to 12), loss mask 0 0 1 1 0 1 1 1.
    topk_ids[b, t, 0] = 100 + t + 50*b is the target's top-1 for the token at t+1."""
    S = 12
    input_ids = torch.stack(
        [torch.arange(10, 10 + S), torch.cat([torch.arange(30, 38), torch.zeros(4, dtype=torch.long)])]
    )
    loss_mask = torch.zeros(2, S, dtype=torch.bool)
    loss_mask[0, 4:] = True
    loss_mask[1, :8] = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    lengths = torch.tensor([12, 8])
    topk = torch.full((2, S, 3), 7, dtype=torch.long)
    topk[0, :, 0] = 100 + torch.arange(S)
    topk[1, :, 0] = 150 + torch.arange(S)
    logprobs = (
        torch.log_softmax(torch.randn(2, S, 3, generator=torch.Generator().manual_seed(0)), -1)
        .sort(-1, descending=True)
        .values
    )
    return input_ids, loss_mask, lengths, topk, logprobs


def blocks_for(labels="target", num_anchors=64, seed=0, step=1):
    ids, lm, lengths, topk, lp = hand_batch()
    spec = BlockSpec(
        block_size=K, mask_token_id=MASK, num_anchors=num_anchors, gamma=GAMMA, labels=labels, soft_targets=True
    )
    return make_blocks(
        ids,
        lm,
        lengths,
        topk,
        spec,
        generator=step_generator(seed, step),
        topk_logprobs_BSk=lp,
    )


def row_blocks(blocks, b):
    """{anchor: (ids, positions, labels, weights)} for the kept blocks of row b."""
    N = blocks.anchors_BN.shape[1]
    S = blocks.position_ids_BP.shape[1] - N * K
    out = {}
    for n in range(N):
        if blocks.keep_BN[b, n]:
            q = slice(n * K, (n + 1) * K)
            out[int(blocks.anchors_BN[b, n])] = (
                blocks.block_ids_BQ[b, q].tolist(),
                blocks.position_ids_BP[b, S + n * K : S + (n + 1) * K].tolist(),
                blocks.labels_BQ[b, q].tolist(),
                [round(w, 6) for w in blocks.weights_BQ[b, q].tolist()],
            )
    return out


def w(k):
    return round(math.exp(-(k - 1) / GAMMA), 6)


def test_alignment_row0_hand_checked():
    blocks = row_blocks(blocks_for(), 0)
    assert sorted(blocks) == [4, 5, 6, 7, 8, 9, 10]  # loss_mask[a] and loss_mask[a+1]
    # anchor 4: block [x4, M, M, M] at positions 4..7; position k is trained toward the target's
    # prediction of x[4+k], stored at row 4+k-1: 100+4, 100+5, 100+6.
    assert blocks[4] == ([14, MASK, MASK, MASK], [4, 5, 6, 7], [0, 104, 105, 106], [0.0, w(1), w(2), w(3)])
    # anchor 10: only k=1 (token 11) exists; k=2,3 fall past the end and get weight 0
    assert blocks[10] == ([20, MASK, MASK, MASK], [10, 11, 12, 13], [0, 110, 0, 0], [0.0, 1.0, 0.0, 0.0])
    for a, (ids, pos, labels, weights) in blocks.items():
        assert ids == [10 + a, MASK, MASK, MASK]
        assert pos == [a, a + 1, a + 2, a + 3]
        for k in range(1, K):
            if a + k < 12:
                assert labels[k] == 100 + a + k - 1 and weights[k] == w(k)


def test_alignment_with_a_loss_mask_gap_and_padding_row():
    blocks = blocks_for()
    row1 = row_blocks(blocks, 1)
    assert sorted(row1) == [2, 5, 6]  # 3: next token not in the loss mask; 7: last token
    # anchor 2: k=1 -> token 3 (masked in), k=2 -> token 4 (prompt: weight 0), k=3 -> token 5
    assert row1[2] == ([32, MASK, MASK, MASK], [2, 3, 4, 5], [0, 152, 0, 154], [0.0, w(1), 0.0, w(3)])
    assert row1[6] == ([36, MASK, MASK, MASK], [6, 7, 8, 9], [0, 156, 0, 0], [0.0, 1.0, 0.0, 0.0])
    N = blocks.anchors_BN.shape[1]
    assert N == 7 and blocks.keep_BN[1].tolist() == [True] * 3 + [False] * 4
    pad = (~blocks.keep_BN[1]).repeat_interleave(K)
    assert (blocks.block_ids_BQ[1][pad] == MASK).all() and (blocks.weights_BQ[1][pad] == 0).all()
    assert blocks.num_blocks == 10
    assert blocks.loss_rows_M.tolist() == blocks.weights_BQ.view(-1).nonzero().view(-1).tolist()


def test_selector_predecessors_are_the_anchor_then_the_label_before():
    """DFlash2's teacher forcing: position 1 follows the anchor token, position k the label of k-1, also where
    k-1 carries no weight (row 1, anchor 2: token 4 is a prompt token, its label still precedes k = 3)."""
    blocks = blocks_for()
    for b, anchor, expected in ((0, 4, [14, 14, 104, 105]), (0, 10, [20, 20, 110, 111]), (1, 2, [32, 32, 152, 153])):
        n = blocks.anchors_BN[b].tolist().index(anchor)
        assert blocks.predecessors_BQ[b, n * K + 1 : (n + 1) * K].tolist() == expected[1:], (b, anchor)
    data = blocks_for(labels="data")
    n = data.anchors_BN[0].tolist().index(4)
    assert data.predecessors_BQ[0, n * K + 1 : (n + 1) * K].tolist() == [14, 15, 16]  # x[a], x[a+1], x[a+2]


def test_data_token_labels_ablation():
    row0 = row_blocks(blocks_for(labels="data"), 0)
    assert row0[4][2] == [0, 15, 16, 17]  # x[a+k]
    assert row0[10][2] == [0, 21, 0, 0]


def test_a_block_spec_reads_the_drafter_and_the_loss_table():
    cfg = load_config(
        TrainConfig, None, ["loss.num_anchors=3", "loss.max_blocks=7", "loss.labels=data", "loss.kl_weight=0.5"]
    )
    drafter = SimpleNamespace(block_size=cfg.model.block_size, mask_token_id=5)
    assert BlockSpec.of(drafter, cfg.loss) == BlockSpec(16, 5, 3, default_gamma(16), "data", True, 7)
    with pytest.raises(ValueError, match="labels must be 'target' or 'data'"):
        BlockSpec(16, 5, 3, 7.0, labels="noise")


def test_soft_targets_come_from_row_a_plus_k_minus_1():
    ids, lm, lengths, topk, lp = hand_batch()
    blocks = blocks_for()
    n = blocks.anchors_BN[0].tolist().index(4)
    q = n * K + 2  # k = 2: row 4 + 2 - 1 = 5
    assert torch.equal(blocks.soft_ids_BQk[0, q], topk[0, 5])
    assert torch.equal(blocks.soft_logprobs_BQk[0, q], lp[0, 5])


def test_labels_do_not_depend_on_the_random_draw():
    """No noise: the label and weight of a given (anchor, k) are the same whatever the seed."""
    seen = {}
    for seed in range(5):
        for a, (_, _, labels, weights) in row_blocks(blocks_for(num_anchors=3, seed=seed), 0).items():
            assert seen.setdefault(a, (labels, weights)) == (labels, weights)
    assert len(seen) > 3


def test_weights_and_gamma():
    weights = position_weights(16, 7.0)
    assert weights[0] == 0.0 and weights[1] == 1.0
    torch.testing.assert_close(weights[1:], torch.exp(-torch.arange(15, dtype=torch.float32) / 7.0))
    assert abs(float(weights[8]) - math.exp(-1.0)) < 1e-7  # k = 8 carries 1/e
    assert default_gamma(16) == 7.0 and default_gamma(10) == 5.0 and default_gamma(8) == 4.0
    with pytest.raises(ValueError, match="set loss.gamma"):
        default_gamma(12)


def test_sampling_without_replacement_capped_sorted_and_seeded():
    cands = torch.zeros(3, 50, dtype=torch.bool)
    cands[0, 5:45] = True
    cands[1, [3, 9, 20]] = True
    anchors, keep = sample_anchors(cands, 8, step_generator(0, 1))
    assert anchors.shape == (3, 8)
    assert keep.sum(1).tolist() == [8, 3, 0]
    assert anchors[0].unique().numel() == 8 and cands[0, anchors[0]].all()
    assert torch.equal(anchors[0], anchors[0].sort().values)
    assert anchors[1, :3].tolist() == [3, 9, 20]
    again, _ = sample_anchors(cands, 8, step_generator(0, 1))
    other, _ = sample_anchors(cands, 8, step_generator(0, 2))
    assert torch.equal(anchors, again) and not torch.equal(anchors, other)


def test_sampling_is_uniform_over_candidates():
    cands = torch.zeros(1, 20, dtype=torch.bool)
    cands[0, 2:12] = True
    counts = torch.zeros(20)
    for step in range(2000):
        anchors, keep = sample_anchors(cands, 3, step_generator(7, step))
        counts[anchors[keep]] += 1
    expected = 2000 * 3 / 10
    assert counts[~cands[0]].sum() == 0
    assert ((counts[2:12] - expected).abs() < 0.1 * expected).all(), counts


def test_candidates_need_room_for_one_label():
    lm = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    assert anchor_candidates(lm, torch.tensor([7])).nonzero()[:, 1].tolist() == [1, 2, 5]
    assert anchor_candidates(lm, torch.tensor([6])).nonzero()[:, 1].tolist() == [
        1,
        2,
    ]  # 5: its next token is past the end


def test_batch_block_cap_scales_rows_down_proportionally():
    from train.blocks import anchors_per_row

    counts = torch.tensor([600, 100, 40, 0])
    assert anchors_per_row(counts, 512, None).tolist() == [512, 100, 40, 0]
    capped = anchors_per_row(counts, 512, 326)
    assert capped.tolist() == [256, 50, 20, 0] and int(capped.sum()) <= 326
    assert anchors_per_row(torch.tensor([3, 1]), 512, 1).tolist() == [1, 1]  # every row keeps at least one
    cands = torch.zeros(2, 40, dtype=torch.bool)
    cands[:, 2:38] = True
    _, keep = sample_anchors(cands, 30, step_generator(0, 0), max_blocks=20)
    assert keep.sum(1).tolist() == [10, 10]
