"""DFlash2's selector loss (train/selector_loss.py) inside the chunked head pass (train/loss.py): the loss and
every gradient equal the plain formula over full logits; coverage, teacher-forced accuracy and the served
streak counted as specified on hand-made rows, the streak equal to an explicit self-conditioned walk; the
weight's warm-up and ramp."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.train.test_loss import D, K, V, random_blocks
from train.dflash2 import CandidateSelector
from train.drafter_config import DrafterConfig
from train.loss import block_loss
from train.selector_loss import selector_weight_at

TOP_K = 20


def selector(top_k: int = TOP_K, rank: int = 5, seed: int = 0) -> CandidateSelector:
    cfg = DrafterConfig(
        hidden_size=D,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=V,
        target_layer_ids=[0],
        num_target_layers=2,
        mask_token_id=V - 1,
        block_size=K,
        arch="dflash2",
        selector_rank=rank,
        selector_top_k=top_k,
    )
    torch.manual_seed(seed)
    module = CandidateSelector(cfg)
    with torch.no_grad():  # a trained selector: the successor codes are no longer zero
        module.successor_codebook.normal_(std=0.5)
        module.predecessor_codebook.normal_(std=0.5)
    return module


def reference(hidden_BQD, head_VD, blocks, module, weight):
    """The objective from full logits and plain autograd: DFlash CE + weight * covered selector CE, both over
    the DFlash term's weight total."""
    logits_QV = hidden_BQD.reshape(-1, D) @ head_VD.T
    w = blocks.weights_BQ.reshape(-1)
    labels = blocks.labels_BQ.reshape(-1)
    base = (w * F.cross_entropy(logits_QV, labels, reduction="none")).sum() / w.sum()
    rows = blocks.loss_rows_M
    unary, candidates = logits_QV[rows].topk(module.top_k, dim=-1)
    hidden_MD = hidden_BQD.reshape(-1, D)[rows]
    scores = module.scores(hidden_MD, unary, candidates, blocks.predecessors_BQ.reshape(-1)[rows])
    is_label = candidates == labels[rows, None]
    ce = F.cross_entropy(scores, is_label.float().argmax(-1), reduction="none")
    return base + weight * (w[rows] * is_label.any(-1) * ce).sum() / w.sum()


@pytest.mark.parametrize("chunk_rows", [3, 4096])
def test_selector_loss_and_gradients_equal_the_full_logit_formula(chunk_rows):
    blocks = random_blocks(seed=2)
    B, Q = blocks.block_ids_BQ.shape
    torch.manual_seed(1)
    head = torch.randn(V, D)
    hidden = torch.randn(B, Q, D).requires_grad_()
    module = selector()
    out = block_loss(hidden, head, blocks, chunk_rows=chunk_rows, selector=module, selector_weight=0.7)
    params = list(module.parameters())
    grads = torch.autograd.grad(out.loss * 2.0, [hidden, *params])
    ref_hidden = hidden.detach().clone().requires_grad_()
    ref = reference(ref_hidden, head, blocks, module, 0.7)
    ref_grads = torch.autograd.grad(ref * 2.0, [ref_hidden, *params])
    torch.testing.assert_close(out.loss.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert 0 < float(out.selector.coverage) < 1  # some rows covered, some not: both branches exercised
    assert float(grads[0].abs().sum()) > 0 and blocks.loss_rows_M.numel() > chunk_rows or chunk_rows == 4096


def test_coverage_accuracy_and_streak_on_hand_made_rows():
    """Head = identity, so a row's logits are its hidden state: candidates and unary values are set by hand.
    Block 0: k=1 label a candidate the selector picks, k=2 a candidate it misses, k=3 not a candidate.
    Block 1: k=1 the label a candidate it picks, k=2 without weight."""
    head = torch.zeros(V, D)
    head[:D] = torch.eye(D)  # ids 0..D-1 have logit = hidden[id]; the rest 0
    blocks = random_blocks(B=1, num_anchors=2, seed=3)
    assert blocks.anchors_BN.shape[1] == 2
    blocks.weights_BQ.zero_()
    w = [1.0, 0.5, 0.25]
    blocks.weights_BQ[0, [1, 2, 3, 5]] = torch.tensor(w + [1.0])
    blocks.loss_rows_M = torch.tensor([1, 2, 3, 5])
    blocks.labels_BQ[0] = torch.tensor([0, 3, 4, 40, 0, 5, 0, 0])
    hidden = torch.full((1, 2 * K, D), -5.0)
    for q, (first, second) in {1: (3, 7), 2: (8, 4), 3: (9, 10), 5: (5, 6)}.items():
        hidden[0, q, first], hidden[0, q, second] = 2.0, 1.0  # unary top-1 then top-2 (plain selector: no pairs)
    module = selector(top_k=2)
    with torch.no_grad():
        module.successor_codebook.zero_()  # scores = unary: the selector picks the unary top-1
    out = block_loss(hidden, head, blocks, selector=module, selector_weight=1.0)
    total = sum(w) + 1.0
    # covered: k=1 (label 3 in {3, 7}), k=2 (4 in {8, 4}), block 1 k=1 (5 in {5, 6}); not k=3 (40)
    assert float(out.selector.coverage) == pytest.approx((1.0 + 0.5 + 1.0) / total)
    assert out.accuracy(out.selector.correct_K) == [1.0, 0.0, 0.0]  # position 1: both blocks right
    assert float(out.selector.streak_sum) == 2.0  # block 0: 1 (misses k=2), block 1: 1 (k=2 has no weight)
    ce = [math.log1p(math.exp(-1.0)), math.log1p(math.exp(1.0)), math.log1p(math.exp(-1.0))]
    expected = (1.0 * ce[0] + 0.5 * ce[1] + 1.0 * ce[2]) / total
    assert float(out.selector.loss) == pytest.approx(expected, rel=1e-5)


def test_served_streak_equals_the_self_conditioned_walk():
    """The streak from teacher-forced hits is the walk's accepted length: inside a run of right choices the
    chosen predecessor is the label."""
    blocks = random_blocks(seed=5, B=3, num_anchors=6)
    B, Q = blocks.block_ids_BQ.shape
    N = blocks.anchors_BN.shape[1]
    torch.manual_seed(4)
    head = torch.randn(V, D)
    module = selector(top_k=12, rank=8, seed=3)
    labels = blocks.labels_BQ.clone()
    hidden = torch.randn(B, Q, D)
    # Make some labels the walk's own choices, so that streaks longer than 1 occur.
    logits = (hidden @ head.T).view(B, N, K, V)
    unary, candidates = logits[:, :, 1:].topk(12, dim=-1)
    anchors = blocks.block_ids_BQ.view(B, N, K)[:, :, 0]
    walked = module.walk(
        hidden.view(B, N, K, D)[:, :, 1:].reshape(B * N, K - 1, D),
        unary.view(B * N, K - 1, -1),
        candidates.view(B * N, K - 1, -1),
        anchors.reshape(-1),
    ).view(B, N, K - 1)
    labels.view(B, N, K)[:, :, 1:] = torch.where(torch.rand(B, N, K - 1) < 0.8, walked, labels.view(B, N, K)[:, :, 1:])
    blocks.labels_BQ = labels
    first = blocks.predecessors_BQ.view(B, N, K)[:, :, :2]
    blocks.predecessors_BQ = torch.cat((first, labels.view(B, N, K)[:, :, 1:-1]), dim=-1).reshape(B, Q)
    out = block_loss(hidden, head, blocks, selector=module, selector_weight=1.0)
    valid = (blocks.weights_BQ > 0).view(B, N, K)[:, :, 1:]
    hits = (walked == labels.view(B, N, K)[:, :, 1:]) & valid
    expected = (torch.cumprod(hits.int(), dim=-1).sum(-1) * blocks.keep_BN).sum()
    assert float(out.selector.streak_sum) == float(expected) and float(expected) > blocks.num_blocks


def test_selector_weight_warmup_then_linear_ramp():
    at = [selector_weight_at(s, 100, 2.0, 0.1, 0.2) for s in (1, 10, 11, 12, 30, 31, 100)]
    assert at == [0.0, 0.0, pytest.approx(0.1), pytest.approx(0.2), pytest.approx(2.0), 2.0, 2.0]
    assert [selector_weight_at(s, 100, 1.0, 0.0, 0.0) for s in (1, 50)] == [1.0, 1.0]
    assert [selector_weight_at(s, 100, 1.0, 0.05, 0.0) for s in (5, 6)] == [0.0, 1.0]


def test_without_a_selector_the_loss_is_the_dflash_loss():
    blocks = random_blocks(seed=6)
    B, Q = blocks.block_ids_BQ.shape
    head, hidden = torch.randn(V, D), torch.randn(B, Q, D)
    plain = block_loss(hidden, head, blocks)
    fresh = selector()
    with torch.no_grad():
        fresh.successor_codebook.zero_()
    zero_weight = block_loss(hidden, head, blocks, selector=fresh, selector_weight=0.0)
    assert plain.selector is None and torch.equal(plain.loss, zero_weight.loss)
    assert torch.equal(zero_weight.selector.unary_loss, plain.loss.detach())
    # A fresh selector (zero successor codes) proposes the unary top-1: its hits are the DFlash accuracy's.
    assert torch.equal(zero_weight.selector.correct_K, plain.correct_K)
