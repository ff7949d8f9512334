"""On CUDA: speculative decoding (`train.serve.specdecode`) is lossless: its output is token for token the
target-only greedy decoding, with the DFlash drafter and with stub proposers that accept everything,
up to a position, or nothing (so whole, partial and empty acceptances all occur).

As in the CPU suite, the API tests run the target in float64, so the 16-token verification and the
one-token greedy steps cannot flip an argmax by rounding: on a plain Qwen3 target (cache cropped)
and on a hybrid Qwen3.5 target (per-token states kept; float64 takes the torch Gated DeltaNet, as fla
has no float64 kernels; the graphed hybrid round: test_rollback_cuda.py). The command line runs in
float32 on CUDA, as a user runs it, and must report `lossless: True` (its own check against
target-only greedy decoding).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.gpu import GPU
from tests.train.serve.test_specdecode import (
    LAYER_IDS,
    BrokenAtProposer,
    OracleProposer,
    WrongProposer,
    check_round_bookkeeping,
    cli_inputs,
    drafter_config,
    random_prompts,
    tiny_qwen3,
    tiny_qwen35,
)
from train.export_format.layout import export_drafter, load_exported
from train.model import DFlashDrafter
from train.serve.decoding import DFlashProposer, greedy_generate, speculative_generate
from train.serve.spec_target import SpecTarget
from train.serve.specdecode import main

pytestmark = GPU


def cuda_drafter(tmp_path, **overrides):
    cfg = drafter_config(**overrides)
    torch.manual_seed(0)
    export_drafter(DFlashDrafter(cfg).state_dict(), cfg, tmp_path / "drafter", dtype="float32")
    return load_exported(tmp_path / "drafter", dtype=torch.float64, device="cuda")


@pytest.mark.parametrize("hybrid", [False, True], ids=["qwen3", "qwen3.5-hybrid"])
def test_speculative_decoding_on_cuda_equals_greedy(tmp_path, hybrid):
    model = (tiny_qwen35() if hybrid else tiny_qwen3()).cuda()
    target = SpecTarget.from_model(model, LAYER_IDS, stop_ids=[])
    assert target.device.type == "cuda"
    proposer = DFlashProposer(cuda_drafter(tmp_path, partial_rotary_factor=0.25 if hybrid else 1.0), target)
    accepted = 0
    for prompt in random_prompts(3, lengths=(9, 4, 23), seed=7):
        base = greedy_generate(target, prompt, 40)
        sequence = prompt + base.tokens
        for stub in (proposer, OracleProposer(sequence), BrokenAtProposer(sequence, 6), WrongProposer(sequence)):
            spec = speculative_generate(target, stub, prompt, 40)
            assert spec.tokens == base.tokens, (type(stub).__name__, prompt)
            check_round_bookkeeping(spec)
            accepted += sum(r.accepted for r in spec.rounds)
    assert accepted > 0
    assert target.cache_mode == ("rollback" if hybrid else "crop")


def test_the_specdecode_cli_is_lossless_on_cuda(tmp_path, capsys):
    prompts = cli_inputs(tmp_path, n_prompts=4)
    out = tmp_path / "result.json"
    code = main(
        [
            "--target",
            str(tmp_path / "target"),
            "--drafter",
            str(tmp_path / "drafter"),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "32",
            "--num-prompts",
            "4",
            "--out",
            str(out),
            "--device",
            "cuda",
        ]
    )
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "lossless: True" in printed.out
    result = json.loads(out.read_text())
    assert result["summary"]["lossless"] and result["summary"]["prompts"] == 4 and result["config"]["device"] == "cuda"
    # On CUDA the CLI runs the static-cache target (its layers compiled) and the graphed drafter by default.
    assert result["config"]["static_cache"].startswith("on") and result["config"]["static_drafter"].startswith("on")
    assert "layers compiled (default)" in result["config"]["static_cache"] and result["config"]["compile"] == "default"


@pytest.mark.parametrize("layout", [{}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}])
def test_the_graphed_drafter_replays_what_the_eager_one_drafts(tmp_path, layout):
    """The fixed-window round captured as a CUDA graph proposes, round by round, what the
    dynamic-cache proposer does (float64: no rounding can flip an argmax), beside the graphed target."""
    from tests.train.serve.test_static_drafter import Recording
    from train.serve.static_drafter import StaticDFlashProposer
    from train.serve.static_target import StaticSpecTarget

    model = tiny_qwen3().cuda()
    target = SpecTarget.from_model(model, LAYER_IDS, stop_ids=[])
    static_target = StaticSpecTarget(target.target, LAYER_IDS, [], max_len=256)
    drafter = cuda_drafter(tmp_path, **layout)
    graphed = StaticDFlashProposer(drafter, static_target, max_len=256)
    assert graphed.graph_note.startswith("on"), graphed.graph_note
    replays = 0
    for prompt in random_prompts(3, lengths=(5, 23, 60), seed=4):
        ours, theirs = Recording(graphed), Recording(DFlashProposer(drafter, target))
        spec = speculative_generate(static_target, ours, prompt, 64)
        reference = speculative_generate(target, theirs, prompt, 64)
        assert spec.tokens == reference.tokens == greedy_generate(target, prompt, 64).tokens
        check_round_bookkeeping(spec)
        for mine, expected in zip(ours.logits, theirs.logits, strict=True):
            torch.testing.assert_close(mine, expected, rtol=1e-9, atol=1e-9)
        replays += len(ours.logits) - 1
    assert replays > 3


def test_compiled_target_graphs_decode_what_the_eager_target_does(tmp_path):
    """`compile`: the target's decoder layers compiled by inductor inside its CUDA graphs
    (train.serve.fusion) verify, round by round, what the eager dynamic-cache target does (float64),
    beside the graphed drafter, and the layers get their own forwards back."""
    from tests.train.serve.test_static_drafter import Recording
    from train.serve.static_drafter import StaticDFlashProposer
    from train.serve.static_target import StaticSpecTarget

    model = tiny_qwen3().cuda()
    target = SpecTarget.from_model(model, LAYER_IDS, stop_ids=[])
    static_target = StaticSpecTarget(target.target, LAYER_IDS, [], max_len=256, compile_mode="default")
    assert static_target.graph_note.endswith("layers compiled (default)"), static_target.graph_note
    assert not any("forward" in layer.__dict__ for layer in target.target.layers)
    drafter = cuda_drafter(tmp_path)
    graphed = StaticDFlashProposer(drafter, static_target, max_len=256)
    for prompt in random_prompts(3, lengths=(5, 23, 60), seed=4):
        ours, theirs = Recording(graphed), Recording(DFlashProposer(drafter, target))
        spec = speculative_generate(static_target, ours, prompt, 64)
        reference = speculative_generate(target, theirs, prompt, 64)
        assert spec.tokens == reference.tokens == greedy_generate(target, prompt, 64).tokens
        assert greedy_generate(static_target, prompt, 64).tokens == reference.tokens
        check_round_bookkeeping(spec)
        for mine, expected in zip(ours.logits, theirs.logits, strict=True):
            torch.testing.assert_close(mine, expected, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("layout", [{}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}])
def test_the_graphed_dflash2_drafter_replays_the_selectors_walk(tmp_path, layout):
    """A DFlash2 drafter's fixed-window round (its forward, the target's head and the selector's walk over
    the block positions) captured as one CUDA graph proposes, round by round, what the dynamic-cache
    proposer does (float64), beside the graphed target, and is lossless."""
    from tests.train.serve.test_dflash2 import Proposals, dflash2_config, random_dflash2
    from train.serve.static_drafter import StaticDFlashProposer
    from train.serve.static_target import StaticSpecTarget

    model = tiny_qwen3().cuda()
    target = SpecTarget.from_model(model, LAYER_IDS, stop_ids=[])
    static_target = StaticSpecTarget(target.target, LAYER_IDS, [], max_len=256)
    cfg = dflash2_config(**layout)
    export_drafter(random_dflash2(cfg, seed=3).state_dict(), cfg, tmp_path / "d2", dtype="float32")
    drafter = load_exported(tmp_path / "d2", dtype=torch.float64, device="cuda")
    graphed = StaticDFlashProposer(drafter, static_target, max_len=256)
    assert graphed.graph_note.startswith("on"), graphed.graph_note
    for prompt in random_prompts(3, lengths=(5, 23, 60), seed=4):
        ours, theirs = Proposals(graphed), Proposals(DFlashProposer(drafter, target))
        spec = speculative_generate(static_target, ours, prompt, 64)
        reference = speculative_generate(target, theirs, prompt, 64)
        assert spec.tokens == reference.tokens == greedy_generate(target, prompt, 64).tokens
        assert ours.rounds == theirs.rounds
        check_round_bookkeeping(spec, block_size=cfg.block_size)
    assert graphed.replays > 3


def test_the_specdecode_cli_with_a_dflash2_export_on_cuda(tmp_path, capsys):
    """The command on CUDA with a DFlash2 export: the static target and the graphed DFlash2 drafter by
    default, lossless in float32."""
    from tests.train.serve.test_dflash2 import dflash2_config, random_dflash2

    prompts = cli_inputs(tmp_path, n_prompts=3)
    cfg = dflash2_config()
    export_drafter(random_dflash2(cfg, seed=5).state_dict(), cfg, tmp_path / "drafter", dtype="float32")
    out = tmp_path / "result.json"
    args = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts)]
    code = main(args + ["--max-new-tokens", "32", "--out", str(out), "--device", "cuda"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    result = json.loads(out.read_text())
    assert result["summary"]["lossless"] and result["config"]["drafter_architecture"] == "DFlash2DraftModel"
    assert result["config"]["static_drafter"].startswith("on"), result["config"]["static_drafter"]
