"""The chunked loss through the frozen head: equal to the full-logit loss and gradients, weighted
exactly as sum(w * CE) / sum(w), and per-position accuracy / streak counted as specified."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from train.blocks import BlockSpec, make_blocks, step_generator
from train.loss import block_loss

V, D, K = 50, 16, 4


def random_blocks(seed=0, B=3, S=30, num_anchors=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (B, S), generator=g)
    lm = torch.rand(B, S, generator=g) > 0.2
    lengths = torch.tensor([S, S - 7, S - 13][:B])
    topk = torch.randint(0, V - 1, (B, S, 5), generator=g)
    lp = torch.log_softmax(torch.randn(B, S, 5, generator=g), -1).sort(-1, descending=True).values
    return make_blocks(
        ids,
        lm,
        lengths,
        topk,
        BlockSpec(block_size=K, mask_token_id=V - 1, num_anchors=num_anchors, gamma=3.0, soft_targets=True),
        generator=step_generator(seed, 0),
        topk_logprobs_BSk=lp,
    )


def reference_loss(hidden_BQD, head_VD, blocks, kl_weight=0.0, temperature=1.0):
    """The plain formula over full logits: sum(w * (CE + kl_weight * KL)) / sum(w)."""
    logits = hidden_BQD.reshape(-1, D) @ head_VD.T
    w = blocks.weights_BQ.reshape(-1)
    ce = F.cross_entropy(logits, blocks.labels_BQ.reshape(-1), reduction="none")
    total = ce
    if kl_weight:
        k = blocks.soft_ids_BQk.shape[-1]
        teacher = torch.softmax(blocks.soft_logprobs_BQk.reshape(-1, k) / temperature, -1)
        student = torch.log_softmax(logits / temperature, -1).gather(1, blocks.soft_ids_BQk.reshape(-1, k))
        total = total + kl_weight * (teacher * (teacher.log() - student)).sum(-1) * temperature**2
    return (w * total).sum() / w.sum()


@pytest.mark.parametrize("chunk_rows", [1, 7, 4096])
@pytest.mark.parametrize("kl_weight", [0.0, 0.5])
def test_chunked_equals_full_logits_loss_and_gradients(chunk_rows, kl_weight):
    blocks = random_blocks()
    B, Q = blocks.block_ids_BQ.shape
    head = torch.randn(V, D)
    hidden = torch.randn(B, Q, D, dtype=torch.float64).float().requires_grad_()
    out = block_loss(hidden, head, blocks, chunk_rows=chunk_rows, kl_weight=kl_weight, kl_temperature=2.0)
    (grad,) = torch.autograd.grad(out.loss * 3.0, hidden)
    ref_hidden = hidden.detach().clone().requires_grad_()
    ref = reference_loss(ref_hidden, head, blocks, kl_weight, 2.0)
    (ref_grad,) = torch.autograd.grad(ref * 3.0, ref_hidden)
    torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)
    assert blocks.loss_rows_M.numel() > chunk_rows or chunk_rows == 4096


def test_chunked_bf16_head_is_close_to_fp32():
    blocks = random_blocks(seed=1)
    B, Q = blocks.block_ids_BQ.shape
    head = torch.randn(V, D)
    hidden = torch.randn(B, Q, D, requires_grad=True)
    out32 = block_loss(hidden, head, blocks, chunk_rows=5)
    out16 = block_loss(hidden, head.bfloat16(), blocks, chunk_rows=5)
    assert abs(out32.loss.item() - out16.loss.item()) < 0.05 * out32.loss.item()
    (g16,) = torch.autograd.grad(out16.loss, hidden)
    assert g16.dtype == torch.float32 and torch.isfinite(g16).all()


def test_weighting_is_sum_w_ce_over_sum_w():
    """Two loss rows with hand-set weights: the loss is their weighted mean, positions 0 excluded."""
    blocks = random_blocks(B=1, num_anchors=1)
    blocks.weights_BQ.zero_()
    blocks.weights_BQ[0, 1], blocks.weights_BQ[0, 2] = 1.0, math.exp(-1 / 3.0)
    blocks.loss_rows_M = torch.tensor([1, 2])
    blocks.labels_BQ[0, 1:3] = torch.tensor([3, 4])
    hidden = torch.zeros(1, K, D)
    hidden[0, 1, 0], hidden[0, 2, 1] = 2.0, -1.0
    head = torch.randn(V, D)
    ce = F.cross_entropy((hidden[0, 1:3] @ head.T), torch.tensor([3, 4]), reduction="none")
    expected = (ce[0] * 1.0 + ce[1] * math.exp(-1 / 3.0)) / (1.0 + math.exp(-1 / 3.0))
    got = block_loss(hidden, head, blocks).loss
    assert abs(got.item() - float(expected)) < 1e-6


def test_accuracy_and_streak_counts():
    """Head = identity, so the prediction of a row is the argmax of its hidden state."""
    head = torch.eye(V)
    blocks = random_blocks(B=1, num_anchors=2, seed=3)
    N = blocks.anchors_BN.shape[1]
    assert N == 2
    # set weights/labels by hand: block 0 fully valid, block 1 only k=1
    blocks.weights_BQ.zero_()
    blocks.weights_BQ[0, [1, 2, 3, 5]] = 1.0
    blocks.loss_rows_M = torch.tensor([1, 2, 3, 5])
    blocks.labels_BQ[0] = torch.tensor([0, 10, 11, 12, 0, 13, 0, 0])
    predictions = torch.tensor([0, 10, 20, 12, 0, 13, 0, 0])  # block 0: hit, miss, hit; block 1: hit
    hidden = F.one_hot(predictions, V).float()[None] * 5.0
    out = block_loss(hidden, head, blocks)
    assert out.accuracy() == [1.0, 0.0, 1.0]
    assert out.counted_K.tolist() == [0.0, 2.0, 1.0, 1.0]
    assert float(out.streak_sum) == 2.0  # block 0: 1 (stops at the miss), block 1: 1 (stops at the unweighted k=2)
    assert out.mean_streak() == 1.0 and out.num_blocks == 2


def test_no_position_has_weight_gives_none_accuracy():
    blocks = random_blocks(B=1, num_anchors=1)
    blocks.weights_BQ.zero_()
    blocks.weights_BQ[0, 1] = 1.0
    blocks.loss_rows_M = torch.tensor([1])
    out = block_loss(torch.randn(1, K, D), torch.randn(V, D), blocks)
    assert out.accuracy()[1:] == [None, None]


def test_kl_without_soft_targets_is_refused():
    blocks = random_blocks()
    blocks.soft_ids_BQk = None
    B, Q = blocks.block_ids_BQ.shape
    with pytest.raises(ValueError, match="kl_weight"):
        block_loss(torch.randn(B, Q, D), torch.randn(V, D), blocks, kl_weight=0.1)
