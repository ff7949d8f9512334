"""The target on a static cache (train.serve.static_target) against the dynamic-cache path, and the
peer baselines (train.serve.peers) against target-only greedy decoding, on the tiny Qwen3 target."""

from __future__ import annotations

import pytest
import torch

from tests.train.serve.test_specdecode import LAYER_IDS, check_round_bookkeeping, random_prompts, tiny_qwen3
from train.serve.cli import PEERS
from train.serve.decoding import DFlashProposer, greedy_generate, speculative_generate
from train.serve.peers import peer_generate
from train.serve.results import compare_generations
from train.serve.spec_target import SpecTarget, crop_cache
from train.serve.specdecode_run import run_benchmark
from train.serve.static_target import StaticKV, StaticSpecTarget, static_cache_length


@pytest.fixture(scope="module")
def targets():
    model = tiny_qwen3(seed=3, dtype=torch.float32)
    dynamic = SpecTarget.from_model(model, LAYER_IDS, stop_ids=[])
    static = StaticSpecTarget(dynamic.target, LAYER_IDS, [], max_len=256)
    return dynamic, static


def test_static_forwards_equal_the_dynamic_cache_through_a_cut_back(targets):
    dynamic, static = targets
    prompt = torch.tensor([random_prompts(1, lengths=(11,), seed=5)[0]])
    block = torch.tensor([random_prompts(1, lengths=(16,), seed=6)[0]])
    la, fa, ca = dynamic.forward(prompt, None, taps=True)
    lb, fb, cb = static.forward(prompt, None, taps=True)
    assert isinstance(cb, StaticKV) and cb.get_seq_length() == 11
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fb, fa, rtol=1e-5, atol=1e-5)
    la, fa, ca = dynamic.forward(block, ca, taps=True)
    lb, fb, cb = static.forward(block, cb, taps=True)
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    # A partial acceptance: keep 4 of the 16 block positions; the next forward overwrites the rest.
    crop_cache(ca, 15)
    crop_cache(cb, 15)
    assert cb.get_seq_length() == 15
    la, fa, _ = dynamic.forward(block[:, 3:9], ca, taps=True)
    lb, fb, _ = static.forward(block[:, 3:9], cb, taps=True)
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fb, fa, rtol=1e-5, atol=1e-5)


def test_static_greedy_and_speculative_decoding_equal_dynamic_greedy(targets, tmp_path):
    from tests.train.serve.test_specdecode import drafter_config, exported
    from train.model import DFlashDrafter

    dynamic, static = targets
    drafter = exported(tmp_path, DFlashDrafter(drafter_config()))
    proposer = DFlashProposer(drafter, static)
    for prompt in random_prompts(3, lengths=(3, 17, 8), seed=2):
        base = greedy_generate(dynamic, prompt, 40)
        assert greedy_generate(static, prompt, 40).tokens == base.tokens
        spec = speculative_generate(static, proposer, prompt, 40)
        assert spec.tokens == base.tokens
        check_round_bookkeeping(spec)
    assert static.cache_mode == "crop"


def test_static_cache_refuses_what_it_cannot_hold(targets):
    _, static = targets
    with pytest.raises(ValueError, match="exceeds the static cache"):
        static.forward(torch.zeros((1, 300), dtype=torch.long), None)
    with pytest.raises(ValueError, match="DDTree"):
        static.forward(torch.zeros((1, 2), dtype=torch.long), StaticKV(0), position_ids_1T=torch.zeros((1, 2)))
    assert static_cache_length([[1] * 100], 200, 16, 8192) == 512
    with pytest.raises(ValueError, match="more than the target's"):
        static_cache_length([[1] * 100], 200, 16, 300)
    assert static.graph_note.startswith("off")  # no CUDA here: the same forwards, eagerly


def test_peer_baselines_are_target_greedy_decoding(targets):
    dynamic, _ = targets
    for prompt in random_prompts(2, lengths=(6, 13), seed=4):
        base = greedy_generate(dynamic, prompt, 24)
        for name in PEERS:
            peer = peer_generate(name, dynamic, prompt, 24, lookup_tokens=4)
            assert compare_generations(peer, base)["identical"], name
            assert peer.stop == base.stop == "length" and peer.decode_s > 0


def test_a_divergence_reports_the_targets_margin_there(targets):
    dynamic, _ = targets
    prompt = random_prompts(1, lengths=(9,), seed=8)[0]
    base = greedy_generate(dynamic, prompt, 12)
    assert len(base.margins) == len(base.tokens) and min(base.margins) >= 0
    other = greedy_generate(dynamic, prompt, 12)
    other.tokens = base.tokens[:5] + [(base.tokens[5] + 1) % 64] + base.tokens[6:]
    found = compare_generations(other, base)
    assert found["first_mismatch"] == 5 and found["margin"] == base.margins[5]


def test_benchmark_summarizes_peers_on_their_own_prompts(targets, tmp_path):
    from tests.train.serve.test_specdecode import drafter_config, exported
    from train.model import DFlashDrafter

    dynamic, _ = targets
    proposer = DFlashProposer(exported(tmp_path, DFlashDrafter(drafter_config())), dynamic)
    result = run_benchmark(
        dynamic, proposer, random_prompts(3, seed=9), 10, peers=("generate", "prompt_lookup"), peer_prompts=2
    )
    assert result["summary"]["lossless"] and set(result["peers"]) == {"generate", "prompt_lookup"}
    for peer in result["peers"].values():
        assert peer["prompts"] == 2 and peer["lossless"] and peer["mismatches"] == []
        assert peer["speedup_wall"] == pytest.approx(peer["baseline"]["wall_s"] / peer["spec"]["wall_s"])


def test_the_peers_key_picks_baselines_and_refuses_unknown_ones():
    from common.config import ConfigError
    from train.serve.cli import parse_specdecode_args

    base = ["--target", "t", "--drafter", "d"]
    assert parse_specdecode_args(base).peer_names == list(PEERS)
    assert parse_specdecode_args([*base, "--peers", "prompt_lookup, generate"]).peer_names == [
        "generate",
        "prompt_lookup",
    ]
    for bad in ("generate,beam", ","):
        with pytest.raises(ConfigError, match="config key 'peers'"):
            parse_specdecode_args([*base, "--peers", bad])


def test_compiled_layers_compute_what_the_eager_layers_do_and_are_restored(targets):
    """`train.serve.fusion.compiled_layers` (here through dynamo and AOT autograd, which any backend
    shares; inductor's kernels are checked on CUDA) gives the static target's 1-token and block
    forwards the eager results, and hands every layer its own forward back afterwards."""
    from train.serve.fusion import compiled_layers

    _, static = targets
    layers = static.target.layers
    prompt = torch.tensor([random_prompts(1, lengths=(9,), seed=7)[0]])
    block = torch.tensor([random_prompts(1, lengths=(16,), seed=8)[0]])
    expected = []
    _, _, cache = static.forward(prompt, None, taps=True)
    for ids in (block[:, :1], block):
        logits, features, cache = static.forward(ids, cache, taps=True)
        expected.append((logits, features))
        crop_cache(cache, 9)
    with compiled_layers(layers, "aot_eager"):
        assert all("forward" in layer.__dict__ for layer in layers)
        _, _, cache = static.forward(prompt, None, taps=True)
        for ids, (logits_e, features_e) in zip((block[:, :1], block), expected, strict=True):
            logits, features, cache = static.forward(ids, cache, taps=True)
            torch.testing.assert_close(logits, logits_e, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(features, features_e, rtol=1e-5, atol=1e-5)
            crop_cache(cache, 9)
    assert not any("forward" in layer.__dict__ for layer in layers)
    with pytest.raises(ValueError, match="compile mode 'cudagraphs'"), compiled_layers(layers, "cudagraphs"):
        pass


def test_the_compile_knob_names_the_mode_the_static_target_compiles_with():
    from common.config import ConfigError
    from train.serve.cli import parse_specdecode_args

    base = ["--target", "t", "--drafter", "d"]
    assert parse_specdecode_args(base).compile_mode == "default"  # auto
    assert parse_specdecode_args(base + ["--compile", "off"]).compile_mode is None
    assert parse_specdecode_args(base + ["--compile", "max-autotune"]).compile_mode == "max-autotune"
    with pytest.raises(ConfigError, match="compile"):
        parse_specdecode_args(base + ["--compile", "reduce-overhead"])
