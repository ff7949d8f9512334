"""The drafter on a slot cache with a fixed-window round (train.serve.static_drafter) against the
dynamic-cache proposer it stands in for, on the tiny Qwen3 target: the same drafts round by round,
for prompts shorter and longer than a block, with full and sliding-window drafter layers."""

from __future__ import annotations

import pytest
import torch

from tests.train.serve.test_specdecode import (
    LAYER_IDS,
    check_round_bookkeeping,
    drafter_config,
    exported,
    random_prompts,
    tiny_qwen3,
)
from train.model import DFlashDrafter
from train.serve.decoding import DFlashProposer, greedy_generate, speculative_generate
from train.serve.spec_target import SpecTarget
from train.serve.static_drafter import StaticDFlashProposer
from train.serve.static_target import StaticSpecTarget


class Recording:
    """A proposer that hands out `inner`'s drafts and keeps the draft logits of every round."""

    def __init__(self, inner):
        self.inner, self.block_size, self.logits = inner, inner.block_size, []

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, new_features_1SF, anchor_token, anchor_pos):
        logits = self.inner.draft_logits(new_features_1SF, anchor_token, anchor_pos)
        self.logits.append(logits)
        return logits.argmax(-1).tolist()


@pytest.fixture(scope="module")
def target():
    return SpecTarget.from_model(tiny_qwen3(seed=3, dtype=torch.float32), LAYER_IDS, stop_ids=[])


@pytest.mark.parametrize(
    "layout",
    [{}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}],
    ids=["full", "sliding-then-full"],
)
def test_fixed_window_rounds_propose_what_the_dynamic_cache_proposes(target, tmp_path, layout):
    torch.manual_seed(11)
    drafter = exported(tmp_path, DFlashDrafter(drafter_config(**layout)))
    static = StaticDFlashProposer(drafter, target, max_len=160)
    assert static.graph_note.startswith("off")  # no CUDA here: the fixed-window forward runs eagerly
    for prompt in random_prompts(3, lengths=(3, 17, 40), seed=2):
        dynamic_rec, static_rec = Recording(DFlashProposer(drafter, target)), Recording(static)
        base = greedy_generate(target, prompt, 48)
        ours = speculative_generate(target, static_rec, prompt, 48)
        theirs = speculative_generate(target, dynamic_rec, prompt, 48)
        assert ours.tokens == theirs.tokens == base.tokens
        assert [r.accepted for r in ours.rounds] == [r.accepted for r in theirs.rounds]
        assert len(static_rec.logits) == len(dynamic_rec.logits) > 2
        for mine, reference in zip(static_rec.logits, dynamic_rec.logits, strict=True):
            torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-4)
        check_round_bookkeeping(ours)


def test_a_drafted_block_sees_no_stale_slot(target, tmp_path):
    """Slots past the block hold another sequence's entries: a fresh proposer and one whose cache
    was filled by a longer sequence first must draft the same logits."""
    drafter = exported(tmp_path, DFlashDrafter(drafter_config()))
    long_prompt, prompt = random_prompts(2, lengths=(90, 21), seed=5)
    used = StaticDFlashProposer(drafter, target, max_len=160)
    speculative_generate(target, used, long_prompt, 40)
    fresh = Recording(StaticDFlashProposer(drafter, target, max_len=160))
    again = Recording(used)
    a = speculative_generate(target, fresh, prompt, 40)
    b = speculative_generate(target, again, prompt, 40)
    assert a.tokens == b.tokens
    for x, y in zip(fresh.logits, again.logits, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_with_the_static_target_and_refusals(target, tmp_path):
    drafter = exported(tmp_path, DFlashDrafter(drafter_config()))
    static_target = StaticSpecTarget(target.target, LAYER_IDS, [], max_len=128)
    proposer = StaticDFlashProposer(drafter, static_target, max_len=128)
    prompt = random_prompts(1, lengths=(12,), seed=9)[0]
    assert (
        speculative_generate(static_target, proposer, prompt, 30).tokens == greedy_generate(target, prompt, 30).tokens
    )
    proposer.reset()
    with pytest.raises(ValueError, match="past the drafter's cache"):
        proposer.propose(torch.zeros((1, 120, 2 * 32)), 1, 120)
    with pytest.raises(ValueError, match="target_layer_ids"):
        StaticDFlashProposer(
            exported(tmp_path, DFlashDrafter(drafter_config(target_layer_ids=[0, 1])), "b"), target, max_len=64
        )
