"""The DFlash mask (docs/dflash.md "Attention mask"): a hand-checked case, and flex == dense."""

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
EXPECTED = torch.tensor(
    [
        # row 0, block 0 (anchor 1): context 0 only, its own block
        [[1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0]] * 3
        # row 0, block 1 (anchor 3): context 0, 1, 2, its own block
        + [[1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]] * 3,
        # row 1, block 0 (anchor 2): context 0, 1, its own block
        [[1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0]] * 3
        # row 1, block 1: padding sees nothing
        + [[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]] * 3,
    ],
    dtype=torch.bool,
)


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


# ----------------------------------------------------------------------------------------------
# Layer types: sliding windows and in-block causality

from train.attention import MaskRule, build_layer_masks, position_mask, visible_pairs  # noqa: E402

RULES = [
    MaskRule(),
    MaskRule(window=6, causal=True),
    MaskRule(window=6, causal=False),
    MaskRule(causal=True),
    MaskRule(window=2, causal=False),
]


def reference_allowed(anchors, keep, S, K, rule: MaskRule) -> torch.Tensor:
    """The rule spelled out with absolute positions, one (query, key) pair at a time."""
    B, N = anchors.shape
    out = torch.zeros(B, N * K, S + N * K, dtype=torch.bool)
    for b in range(B):
        for q in range(N * K):
            n, q_off = divmod(q, K)
            if not keep[b, n]:
                continue
            q_pos = int(anchors[b, n]) + q_off
            for kv in range(S + N * K):
                if kv < S:
                    ok = kv < anchors[b, n] and (rule.window is None or q_pos - kv < rule.window)
                else:
                    m, kv_off = divmod(kv - S, K)
                    kv_pos = int(anchors[b, n]) + kv_off
                    ok = m == n and (not rule.causal or kv_pos <= q_pos)
                    if rule.window is not None:
                        ok = ok and q_pos - kv_pos < rule.window and (rule.causal or kv_pos - q_pos < rule.window)
                out[b, q, kv] = ok
    return out


def test_sliding_causal_mask_hand_checked():
    """Window 3, causal: block offset o sees block offsets max(0, o-2)..o and context > anchor+o-3."""
    rule = MaskRule(window=3, causal=True)
    anchors, keep = torch.tensor([[4]]), torch.tensor([[True]])
    expected = torch.tensor(
        [
            # context 0..5           block offsets 0, 1, 2
            [0, 0, 1, 1, 0, 0, 1, 0, 0],  # q at 4: context 2, 3 (4 - 2 = 2 back at most)
            [0, 0, 0, 1, 0, 0, 1, 1, 0],  # q at 5: context 3
            [0, 0, 0, 0, 0, 0, 1, 1, 1],  # q at 6: no context (4 and 5 are the block's own 4, 5)
        ],
        dtype=torch.bool,
    )
    assert torch.equal(build_dense_mask(anchors, keep, 6, 3, rule)[0, 0], expected)
    assert torch.equal(reference_allowed(anchors, keep, 6, 3, rule)[0], expected)


@pytest.mark.parametrize("rule", RULES, ids=str)
def test_dense_and_flex_mask_mod_follow_the_rule(rule):
    anchors = torch.tensor([[1, 3], [2, 0]])
    dense = build_dense_mask(anchors, KEEP, 9, 4, rule)[:, 0]
    assert torch.equal(dense, reference_allowed(anchors, KEEP, 9, 4, rule))
    mod = mask_mod_for(anchors, KEEP, 9, 4, rule)
    b, q, kv = torch.arange(2)[:, None, None], torch.arange(8)[None, :, None], torch.arange(9 + 8)[None, None, :]
    assert torch.equal(mod(b, torch.tensor(0), q, kv), dense)
    assert visible_pairs(anchors, KEEP, 4, rule) == int(dense.sum())


@pytest.mark.parametrize("rule", RULES[1:3] + [MaskRule()], ids=str)
def test_flex_equals_dense_for_contexts_beyond_the_window(rule):
    """Anchors up to 70 positions into the context with a window of 6: most context is out of reach."""
    torch.manual_seed(3)
    B, N, K_, S_ = 2, 6, 4, 70
    H, G, E = 4, 2, 16
    anchors = torch.sort(torch.randint(0, S_, (B, N)), dim=1).values
    anchors[:, -1] = S_ - 1
    keep = torch.rand(B, N) > 0.2
    keep[:, -1] = True
    q = torch.randn(B, H, N * K_, E)
    k, v = torch.randn(B, G, S_ + N * K_, E), torch.randn(B, G, S_ + N * K_, E)
    dense_mask = build_dense_mask(anchors, keep, S_, K_, rule)
    if rule.window is not None:  # the window really cuts context here
        assert not torch.equal(dense_mask, build_dense_mask(anchors, keep, S_, K_))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex_out = attend(q, k, v, build_block_mask(anchors, keep, S_, K_, rule))
    torch.testing.assert_close(flex_out, attend(q, k, v, dense_mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rule", RULES, ids=str)
def test_inference_positions_give_the_training_mask_of_one_block(rule):
    """One block right after its context: the position rule of inference = the training mask."""
    S_, K_ = 11, 4
    training = build_dense_mask(torch.tensor([[S_]]), torch.tensor([[True]]), S_, K_, rule)
    positions = torch.arange(S_ + K_)[None]
    inference = position_mask(positions[:, S_:], positions, rule)
    if inference is None:
        assert bool(training.all())
    else:
        assert torch.equal(inference, training)


def test_layer_masks_one_per_rule_shared_by_types():
    rules = {
        "full_attention": MaskRule(),
        "sliding_attention": MaskRule(window=3, causal=True),
        "also_full": MaskRule(),
    }
    masks = build_layer_masks("sdpa", ANCHORS, KEEP, S, K, rules)
    assert set(masks) == set(rules) and masks["full_attention"] is masks["also_full"]
    assert torch.equal(masks["full_attention"], build_dense_mask(ANCHORS, KEEP, S, K))
    assert torch.equal(masks["sliding_attention"], build_dense_mask(ANCHORS, KEEP, S, K, rules["sliding_attention"]))
