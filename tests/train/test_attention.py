"""The DFlash mask (dflash.md §3.5): a hand-checked case, and flex == dense."""

from __future__ import annotations

import warnings

import pytest
import torch

from train.attention import attend, build_block_mask, build_dense_mask, mask_mod_for

# S = 5 context positions, K = 3, two blocks per row.
# Row 0: anchors 1 and 3.  Row 1: anchor 2, then a padding block.
ANCHORS = torch.tensor([[1, 3], [2, 0]])
KEEP = torch.tensor([[True, True], [True, False]])
S, K = 5, 3

#            context 0..4    block 0   block 1
EXPECTED = torch.tensor([
    # row 0, block 0 (anchor 1): context 0 only, its own block
    [[1, 0, 0, 0, 0,   1, 1, 1,   0, 0, 0]] * 3
    # row 0, block 1 (anchor 3): context 0, 1, 2, its own block
    + [[1, 1, 1, 0, 0,   0, 0, 0,   1, 1, 1]] * 3,
    # row 1, block 0 (anchor 2): context 0, 1, its own block
    [[1, 1, 0, 0, 0,   1, 1, 1,   0, 0, 0]] * 3
    # row 1, block 1: padding sees nothing
    + [[0, 0, 0, 0, 0,   0, 0, 0,   0, 0, 0]] * 3,
], dtype=torch.bool)


def test_dense_mask_hand_checked():
    mask = build_dense_mask(ANCHORS, KEEP, S, K)
    assert mask.shape == (2, 1, 6, 11)
    assert torch.equal(mask[:, 0], EXPECTED)


def test_mask_mod_hand_checked():
    mod = mask_mod_for(ANCHORS, KEEP, S, K)
    for b in range(2):
        for q in range(6):
            for kv in range(11):
                got = bool(mod(torch.tensor(b), torch.tensor(0), torch.tensor(q), torch.tensor(kv)))
                assert got == bool(EXPECTED[b, q, kv]), (b, q, kv)


def test_flex_block_mask_attends_exactly_per_the_hand_checked_matrix():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "unfused flex on CPU" warning
        got = attend(q, k, v, build_block_mask(ANCHORS, KEEP, S, K))
    scores = (q @ k.transpose(-1, -2)) / 8**0.5
    weights = torch.softmax(scores.masked_fill(~EXPECTED[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
    torch.testing.assert_close(got, weights @ v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_flex_equals_dense_sdpa(seed):
    torch.manual_seed(seed)
    B, N, K_, S_ = 3, 5, 4, 37
    H, G, E = 4, 2, 16
    anchors = torch.sort(torch.randint(0, S_, (B, N)), dim=1).values
    keep = torch.rand(B, N) > 0.25
    keep[:, 0] = True
    anchors = torch.where(keep, anchors, torch.zeros_like(anchors))
    q = torch.randn(B, H, N * K_, E)
    k, v = torch.randn(B, G, S_ + N * K_, E), torch.randn(B, G, S_ + N * K_, E)
    dense_out = attend(q, k, v, build_dense_mask(anchors, keep, S_, K_))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "unfused flex on CPU" warning
        flex_out = attend(q, k, v, build_block_mask(anchors, keep, S_, K_))
    torch.testing.assert_close(flex_out, dense_out, rtol=1e-5, atol=1e-5)
    pad_rows = (~keep).repeat_interleave(K_, dim=1)
    assert bool(pad_rows.any())
    assert torch.equal(dense_out.transpose(1, 2)[pad_rows], torch.zeros_like(dense_out.transpose(1, 2)[pad_rows]))


def test_dense_padding_rows_give_zero_output_and_finite_gradients():
    q = torch.randn(2, 4, 6, 8, requires_grad=True)
    k = torch.randn(2, 2, 11, 8, requires_grad=True)
    v = torch.randn(2, 2, 11, 8, requires_grad=True)
    out = attend(q, k, v, build_dense_mask(ANCHORS, KEEP, S, K))
    assert torch.equal(out[1, :, 3:], torch.zeros_like(out[1, :, 3:]))
    out.square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[1, :, 3:], torch.zeros_like(q.grad[1, :, 3:]))


def test_no_mask_means_everything_visible():
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    full = torch.ones(1, 1, 3, 7, dtype=torch.bool)
    torch.testing.assert_close(attend(q, k, v, None), attend(q, k, v, full))
