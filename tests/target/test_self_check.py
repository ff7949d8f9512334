"""The target's self-check (target.self_check) and the logits from the model's own output path
(target.head.OwnHead), on tiny random targets of the families where they matter: Falcon-H1's
`lm_head_multiplier` (extraction's own copy of the head missed it), Jamba's cache (a block through it
differs from the full recompute), RecurrentGemma (no cache at all), and the plain Qwen3 that passes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from extract.capture import capture
from target.head import FALLBACK, OWN, known_scalings
from target.load import load_target, reach_text_parts
from target.self_check import FLOOR, SelfCheck, SelfCheckFailed, self_check
from tests.archs.families import by_name

V = 96
FALCON_H1 = "Falcon-H1 (Mamba-2 + attention, lm_head_multiplier)"  # lm_head_multiplier 0.5
JAMBA = "Jamba (cache differs from the full forward)"
RECURRENT_GEMMA = "RecurrentGemma (no cache to verify through)"


def built(family: str) -> torch.nn.Module:
    """The architecture matrix's tiny random target of `family` (tests/archs/families.py), unsaved."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(by_name(family).config(V, {})).eval().requires_grad_(False)


def test_stored_logits_are_falcon_h1s_own_with_its_lm_head_multiplier():
    """Extraction applied its own copy of the head and missed lm_head_multiplier (0.23 off here)."""
    model = built(FALCON_H1)
    target = reach_text_parts(model)
    ids = torch.randint(0, V, (1, 24))
    got = capture(target, ids, [24], [1], topk=5)
    with torch.no_grad():
        own = model(ids, use_cache=False).logits[0].float().log_softmax(-1)
    assert target.logits_fn.path == OWN
    assert torch.equal(got.topk_ids[:, 0].long(), own.argmax(-1))
    assert torch.allclose(got.topk_logprobs, own.gather(-1, got.topk_ids.long()), atol=1e-6)
    without = (target.lm_head(got.last_hidden[0]).float()).log_softmax(-1)  # the head without the multiplier
    assert (without - own).abs().max() > 0.01  # so the test can tell the two paths apart


def test_a_fallback_head_that_misses_a_scaling_is_refused_by_the_self_check(monkeypatch):
    model = built(FALCON_H1)
    target = reach_text_parts(model)
    monkeypatch.setattr(target.logits_fn, "path", FALLBACK)
    monkeypatch.setattr(target.logits_fn, "fallback", known_scalings(object()))  # no scaling known
    checked = self_check(target)
    logits = next(c for c in checked.checks if c.name == "logits")
    assert not logits.ok and logits.value > 100 * logits.tolerance and not logits.acceptable
    refusal = checked.refusal(accept_cache=True)
    assert isinstance(refusal, SelfCheckFailed) and "\n" not in str(refusal)
    assert "log-probabilities" in str(refusal) and f"{logits.value:.2e}" in str(refusal)


def test_a_forward_that_cannot_be_driven_falls_back_to_the_head_and_known_scalings(monkeypatch):
    model = built(FALCON_H1)
    target = reach_text_parts(model)
    hidden = torch.randn(5, 32)
    own = target.logits_fn(hidden)

    def refuse(*args, **kwargs):
        raise TypeError("no such argument")

    monkeypatch.setattr(model, "forward", refuse)
    fallback = target.logits_fn(hidden)
    assert target.logits_fn.path == FALLBACK and "no such argument" in target.logits_fn.problem
    assert torch.allclose(fallback, own, atol=1e-6)  # the multiplier is among the known scalings


def test_a_plain_target_passes_every_check_in_a_fraction_of_a_second(saved_target):
    target = load_target(saved_target, dtype="float32", device="cpu")
    checked = self_check(target)
    assert [c.name for c in checked.checks] == ["parts", "weights", "layers", "logits", "cache"]
    assert not checked.failed and checked.refusal() is None and checked.dtype == "float32"
    cache = next(c for c in checked.checks if c.name == "cache")
    assert cache.value <= cache.tolerance and cache.tolerance >= FLOOR[torch.float32]
    again = SelfCheck.from_record(checked.record())  # what drafter.json keeps reads back the same
    assert again.checks == checked.checks and again.refusal() is None


def test_a_cache_that_differs_from_the_full_recompute_is_refused_unless_accepted():
    """Jamba in transformers: a 16-token block through the cache is off by ~3e-3 in float32 (others: < 1e-6)."""
    checked = self_check(reach_text_parts(built(JAMBA)))  # initializer_range 0.05: a trained model's scale
    cache = next(c for c in checked.checks if c.name == "cache")
    assert not cache.ok and cache.acceptable and cache.value > 100 * cache.tolerance
    refusal = checked.refusal()
    assert "allow_cache_mismatch=true" in str(refusal) and f"{cache.value:.2e}" in str(refusal)
    assert "cache differs from the full recompute" in refusal.reason and "e-0" not in refusal.reason
    assert checked.refusal(accept_cache=True) is None
    assert checked.record(accept_cache=True)["accepted"] == ["cache"]


def test_a_target_without_a_cache_to_verify_through_is_refused_outright():
    checked = self_check(reach_text_parts(built(RECURRENT_GEMMA)))
    cache = next(c for c in checked.checks if c.name == "cache")
    assert not cache.ok and not cache.acceptable and "carries no cache" in cache.line
    assert checked.refusal(accept_cache=True) is not None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_tolerance_follows_the_compute_dtype(saved_target, dtype):
    checked = self_check(load_target(saved_target, dtype=dtype, device="cpu"))
    logits = next(c for c in checked.checks if c.name == "logits")
    assert logits.ok and logits.tolerance >= FLOOR[getattr(torch, dtype)]
    assert checked.dtype == dtype
