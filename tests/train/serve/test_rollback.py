"""Hybrid targets decoded with per-token recurrent states (`target.recurrent_states`, the "rollback"
cache mode): on the matrix's tiny Qwen3.5 and Qwen3-Next in float32, speculative decoding equals
target-only greedy decoding token for token with a partial acceptance of every length, a full
rejection and full blocks, with no re-run (one target forward per round) and no cache copy; the
recorded states equal the states a one-token-at-a-time decoding reaches; an unknown recurrent layer
kind falls back to the cache copy and says so in one line.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from target.recurrent_states import PerTokenStates, recurrent_mixers
from tests.archs.families import by_name
from tests.train.serve.test_specdecode import LAYER_IDS, B, OracleProposer, V, check_round_bookkeeping
from train.serve.decoding import greedy_generate, speculative_generate
from train.serve.spec_target import FALLBACK, SpecTarget, decoding_path

HYBRIDS = ("Qwen3.5", "Qwen3-Next")
CYCLE = tuple(range(B))  # drafts accepted per round: 0 (a full rejection) .. B-1 (a full block)
NEW_TOKENS = sum(a + 1 for a in CYCLE) + 4  # one pass through the cycle, and into it again


def tiny_hybrid(name: str, seed: int = 0) -> torch.nn.Module:
    """The architecture matrix's tiny random target of family `name`, in float32."""
    torch.manual_seed(seed)
    config = by_name(name).config(V, dict(bos_token_id=1, eos_token_id=2, pad_token_id=0))
    return AutoModelForCausalLM.from_config(config).eval().float()


class CycleProposer(OracleProposer):
    """The target's own tokens with the draft after `CYCLE[r]` accepted ones wrong in round r: every
    acceptance length from 0 to B-1 in one decoding."""

    def reset(self) -> None:
        self.round = 0

    def propose(self, new_features_1SF, anchor_token: int, anchor_pos: int) -> list[int]:
        drafts = super().propose(new_features_1SF, anchor_token, anchor_pos)
        accept = CYCLE[self.round % len(CYCLE)]
        self.round += 1
        if accept < len(drafts):
            drafts[accept] = (drafts[accept] + 1) % V
        return drafts


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request):
    target = SpecTarget.from_model(tiny_hybrid(request.param), LAYER_IDS, stop_ids=[])
    return request.param, target


def test_every_acceptance_length_is_lossless_with_one_forward_per_round(hybrid):
    name, target = hybrid
    assert target.per_token is not None, target.rollback_note
    prompt = [5, 9, 3, 17, 11, 4, 8]
    base = greedy_generate(target, prompt, NEW_TOKENS)
    spec = speculative_generate(target, CycleProposer(prompt + base.tokens), prompt, NEW_TOKENS)
    assert spec.tokens == base.tokens, name
    check_round_bookkeeping(spec)
    assert target.cache_mode == "rollback" and decoding_path(target) == "eager, with rollback"
    assert [r.accepted for r in spec.rounds[: len(CYCLE)]] == list(CYCLE)
    assert spec.target_forwards == len(spec.rounds)  # no re-run of the accepted tokens


def test_kept_states_are_the_states_of_one_token_at_a_time(hybrid):
    """After a 6-token verify kept at 1..6 tokens, every Gated DeltaNet layer's recurrent state and
    convolution window equal those of a cache fed the same tokens one forward at a time (up to the
    rounding of a 6-row against a 1-row projection)."""
    _, target = hybrid
    prompt, block = torch.tensor([[3, 14, 15, 9, 2, 6]]), torch.tensor([[5, 35, 8, 9, 7, 9]])
    for kept in range(1, 7):
        _, _, stepped = target.forward(prompt, None, taps=False)
        for t in range(kept):
            _, _, stepped = target.forward(block[:, t : t + 1], stepped, taps=False)
        _, _, cache = target.forward(prompt, None, taps=False)
        target.forward(block, cache, taps=False)
        target.keep(cache, kept)
        assert cache.get_seq_length() == stepped.get_seq_length() == 6 + kept
        for layer in target.per_token.mixers:
            ours, theirs = cache.layers[layer], stepped.layers[layer]
            torch.testing.assert_close(ours.recurrent_states[0], theirs.recurrent_states[0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ours.conv_states[0], theirs.conv_states[0], rtol=1e-5, atol=1e-6)
        # and the next forward continues both caches alike
        ours = target.forward(block[:, :3], cache, taps=False)[0]
        theirs = target.forward(block[:, :3], stepped, taps=False)[0]
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_an_unknown_recurrent_layer_kind_falls_back_and_says_why():
    """A Gated DeltaNet module whose forward no longer calls the delta-rule functions it knows stands
    for a hybrid layer kind it has never seen: one line names the layer, decoding copies the cache."""
    model = tiny_hybrid("Qwen3.5", seed=1)
    mixer = model.model.layers[0].linear_attn

    class MysteryMixer(type(mixer)):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    mixer.__class__ = MysteryMixer
    target = SpecTarget.from_model(model, LAYER_IDS, stop_ids=[])
    assert target.per_token is None
    assert (
        target.rollback_note.startswith("layer 0 (linear_attention: MysteryMixer") and "\n" not in target.rollback_note
    )
    prompt = [7, 7, 1, 30]
    base = greedy_generate(target, prompt, 24)
    spec = speculative_generate(target, CycleProposer(prompt + base.tokens), prompt, 24)
    assert spec.tokens == base.tokens and target.cache_mode == "snapshot"
    assert decoding_path(target) == f"{FALLBACK}: {target.rollback_note}"
    assert spec.target_forwards > len(spec.rounds)  # the accepted tokens were run again


def test_a_release_whose_layers_leave_no_record_falls_back_at_the_probe(monkeypatch):
    """A transformers release that calls its Gated DeltaNet another way (here: no convolution window
    reaches the record) is caught before decoding by the probe forward, and named in one line."""
    model = tiny_hybrid("Qwen3.5", seed=2)
    monkeypatch.setattr(PerTokenStates, "watch", lambda self, cache: None)
    target = SpecTarget.from_model(model, LAYER_IDS, stop_ids=[])
    assert target.per_token is None and target.mode_for(None) == "snapshot"
    assert target.rollback_note.startswith("per-token states failed a probe (RuntimeError: per-token states: Gated")


def test_layer_kinds_it_knows_and_those_it_does_not():
    class Parts:
        def __init__(self, layer_types):
            self.text_config = type("C", (), {"layer_types": layer_types})()
            self.layers = []
            self.model = torch.nn.Module()

    assert recurrent_mixers(Parts(["full_attention", "sliding_attention"])) == ({}, None)
    mixers, reason = recurrent_mixers(Parts(["mamba", "full_attention", "conv"]))
    assert mixers == {} and reason == "layer kind 'conv', 'mamba' is not one it knows (linear_attention is)"
    assert PerTokenStates.for_target(Parts(["full_attention"])) == (None, None)


def test_the_static_cache_and_slot_drafter_decode_hybrids_losslessly(hybrid, tmp_path):
    """The static-cache target (graphs off here; the replay: tests/gpu) keeps the same states: its greedy
    and speculative decodings, with the slot-cache drafter too, equal the dynamic cache's greedy
    decoding, and a second sequence on the same cache starts from zeroed states."""
    from tests.train.serve.test_specdecode import drafter_config, exported
    from train.model import DFlashDrafter
    from train.serve.static_drafter import StaticDFlashProposer
    from train.serve.static_target import StaticSpecTarget

    name, dynamic = hybrid
    static = StaticSpecTarget(dynamic.target, LAYER_IDS, [], max_len=256)
    assert static.graph_note.startswith("off") and static.per_token is dynamic.per_token
    drafter = StaticDFlashProposer(
        exported(tmp_path, DFlashDrafter(drafter_config(partial_rotary_factor=0.25))), static, max_len=256
    )
    prompt = [4, 8, 15, 16, 23, 42]
    base = greedy_generate(dynamic, prompt, 40)
    assert greedy_generate(static, prompt, 40).tokens == base.tokens, name
    cases = ((prompt, CycleProposer(prompt + base.tokens)), ([9, 1], drafter))
    for prompt, proposer in cases:
        base = greedy_generate(dynamic, prompt, 40)
        spec = speculative_generate(static, proposer, prompt, 40)
        assert spec.tokens == base.tokens, (name, type(proposer).__name__)
        assert spec.target_forwards == len(spec.rounds)
    assert static.cache_mode == "rollback" and decoding_path(static) == "eager, with rollback"
    # What `compile_mode` compiles on a GPU: every part of every layer but the Gated DeltaNet modules,
    # of which only their gated norms.
    parts = {type(part).__name__ for part in static._fusable()}
    assert not any(n.endswith("GatedDeltaNet") for n in parts) and any(n.endswith("RMSNormGated") for n in parts)
    assert any(n.endswith("Attention") for n in parts) and any("MLP" in n or "Moe" in n for n in parts)


def test_kernel_lookups_see_through_the_per_token_wrapper(monkeypatch):
    """Packing asks `external_kernels` whether fla's chunked kernel is bound (target.packing): the
    per-token wrapper installed in its place must not hide it."""
    import types

    from target import kernel_routing
    from target.recurrent_states import CHUNK_NAME, _per_token_chunk

    def chunk_gated_delta_rule(*args, **kwargs):  # stands for the kernel transformers bound
        return "chunked"

    home = types.SimpleNamespace(__name__="transformers.models.fake")
    wrapper = _per_token_chunk(chunk_gated_delta_rule, home)
    assert wrapper(1, 2) == "chunked"  # outside a recorded forward: the bound function, unchanged
    monkeypatch.setattr(kernel_routing, "_module_functions", lambda model: [(home, CHUNK_NAME, wrapper)])
    monkeypatch.setattr(
        kernel_routing, "_external_kernel", lambda fn: (fn, fn) if fn is chunk_gated_delta_rule else None
    )
    found = kernel_routing.external_kernels(None)
    assert list(found) == [f"transformers.models.fake.{CHUNK_NAME}"] and found[list(found)[0]].endswith("rule")
