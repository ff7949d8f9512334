"""On CUDA: a hybrid target's round as CUDA graphs with per-token recurrent states ("graphed, with
rollback": `train.serve.static_target` on `target.recurrent_states`), on the matrix's tiny Qwen3.5 and
Qwen3-Next.

- float64 (transformers' torch delta rule, as fla has no float64 kernels; no rounding can flip an
  argmax): the graphed verify, its captured rollback copies and the graphed slot-cache drafter decode
  token for token what the dynamic cache's target-only greedy decoding does, at every acceptance
  length, with one target forward per round; so do Qwen3.5's layers compiled part by part around
  their Gated DeltaNet modules (as `train.serve.specdecode` compiles them by default).
- float32 with fla (skipped where fla is not importable): the verify's states, recorded through fla's
  fused recurrent kernel one token at a time, equal the states one-token steps reach, and the graphed
  decoding equals target-only greedy decoding wherever the target's top-1 is not a near-tie; so does
  the specdecode command, which names the path it took ("graphed, with rollback").
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from target.kernel_routing import external_kernels
from tests.gpu import GPU
from tests.train.serve.test_rollback import NEW_TOKENS, CycleProposer, tiny_hybrid
from tests.train.serve.test_specdecode import LAYER_IDS, check_round_bookkeeping
from train.serve.decoding import greedy_generate, speculative_generate
from train.serve.results import compare_generations
from train.serve.spec_target import SpecTarget, decoding_path
from train.serve.static_target import StaticSpecTarget

pytestmark = GPU
HYBRIDS = ("Qwen3.5", "Qwen3-Next")


def on_cuda(name: str, dtype) -> SpecTarget:
    return SpecTarget.from_model(tiny_hybrid(name).to(device="cuda", dtype=dtype), LAYER_IDS, stop_ids=[])


def graphed(dynamic: SpecTarget, **kwargs) -> StaticSpecTarget:
    return StaticSpecTarget(dynamic.target, LAYER_IDS, [], max_len=512, **kwargs)


@pytest.mark.parametrize(
    "name, compile_mode",
    [("Qwen3.5", None), ("Qwen3-Next", None), ("Qwen3.5", "default")],
    ids=["qwen3.5", "qwen3-next", "qwen3.5-compiled-parts"],
)
def test_graphed_rollback_decodes_what_target_only_greedy_does(name, compile_mode, tmp_path):
    from tests.gpu.test_specdecode_cuda import cuda_drafter
    from train.serve.static_drafter import StaticDFlashProposer

    dynamic = on_cuda(name, torch.float64)
    static = graphed(dynamic, compile_mode=compile_mode)
    assert static.graph_note.startswith("on for [1, 16] new tokens, per-token states of 2 Gated DeltaNet layers")
    if compile_mode:
        assert static.graph_note.endswith("layers but their Gated DeltaNet modules compiled (default)")
    assert sorted(static.graphs[16].keeps) == list(range(1, 16))
    drafter = StaticDFlashProposer(cuda_drafter(tmp_path, partial_rotary_factor=0.25), static, max_len=512)
    assert drafter.graph_note.startswith("on"), drafter.graph_note
    for prompt in ([5, 9, 3, 17, 11, 4, 8], [2, 60, 31]):
        base = greedy_generate(dynamic, prompt, NEW_TOKENS)
        assert greedy_generate(static, prompt, NEW_TOKENS).tokens == base.tokens
        for proposer in (CycleProposer(prompt + base.tokens), drafter):
            spec = speculative_generate(static, proposer, prompt, NEW_TOKENS)
            assert spec.tokens == base.tokens, (name, type(proposer).__name__)
            check_round_bookkeeping(spec)
            assert spec.target_forwards == len(spec.rounds)
    assert static.cache_mode == "rollback" and decoding_path(static) == "graphed, with rollback"


fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla (fla-core): the device image's")


@fla
@pytest.mark.parametrize("name", HYBRIDS)
def test_fla_per_token_states_equal_one_token_steps(name):
    dynamic = on_cuda(name, torch.float32)
    kernels = " ".join(external_kernels(dynamic.model).values())
    assert "fla" in kernels, kernels  # the one-token delta rule is fla's fused recurrent kernel
    prompt, block = torch.tensor([[3, 14, 15, 9, 2, 6]]), torch.tensor([[5, 35, 8, 9, 7, 9]])
    _, _, cache = dynamic.forward(prompt, None, taps=False)
    dynamic.forward(block, cache, taps=False)
    _, _, record = dynamic.recorded
    _, _, stepped = dynamic.forward(prompt, None, taps=False)
    for t in range(6):
        _, _, stepped = dynamic.forward(block[:, t : t + 1], stepped, taps=False)
        for layer in dynamic.per_token.mixers:
            torch.testing.assert_close(
                record[layer]["states"][t], stepped.layers[layer].recurrent_states[0], rtol=1e-4, atol=1e-5
            )


@fla
@pytest.mark.parametrize("name", HYBRIDS)
def test_fla_graphed_rollback_is_lossless_but_for_near_ties(name):
    static = graphed(on_cuda(name, torch.float32))
    assert static.graph_note.startswith("on"), static.graph_note
    for prompt in ([5, 9, 3, 17, 11, 4, 8], [2, 60, 31]):
        base = greedy_generate(static, prompt, NEW_TOKENS)
        spec = speculative_generate(static, CycleProposer(prompt + base.tokens), prompt, NEW_TOKENS)
        found = compare_generations(spec, base)
        # a mismatch only where the target's top-1 and top-2 are within float32 rounding of each other
        assert found["identical"] or min(found["margin"], found["other_margin"]) < 1e-4, found


@fla
def test_the_specdecode_cli_runs_a_hybrid_target_graphed_with_rollback(tmp_path, capsys):
    from tests.train.serve.test_specdecode import cli_inputs
    from train.serve.specdecode import main

    prompts = cli_inputs(tmp_path, n_prompts=3, model=tiny_hybrid("Qwen3.5", seed=4))
    out = tmp_path / "result.json"
    args = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts)]
    code = main([*args, "--max-new-tokens", "40", "--out", str(out), "--device", "cuda"])
    printed = capsys.readouterr()
    result = json.loads(out.read_text())
    assert result["decoding_path"] == "graphed, with rollback", result["decoding_path"]
    assert "decoding path: graphed, with rollback" in printed.out
    assert "per-token states of" in result["config"]["static_cache"] and result["config"]["static_drafter"].startswith(
        "on"
    )
    summary = result["summary"]
    assert summary["spec"]["target_forwards"] == summary["rounds"]  # no re-run
    near_ties = all(min(m.get("margin", 1), m.get("other_margin", 1)) < 1e-4 for m in summary["mismatches"])
    assert (code == 0 and summary["lossless"]) or near_ties, summary["mismatches"]
