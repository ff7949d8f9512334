"""A DFlash2 drafter exported and decoded with: the published DFlash2 layout (config.json, bare codebook
names), the export's `dflash.py` computing what the training model (`train.dflash2`) computes, the fields
vLLM's DFlash2 loader reads, and, against z-lab's reference code (pip `dflash==0.1.0`, `make setup`
installs it): a strict load, the same hidden states and proposals in float32 (single calls and cached
rounds, at most 1e-5 apart), and its generation loop (`dflash_generate`) driving the export losslessly,
round for round as our own loops. Then our speculative decoding with it: the selector's walk proposed
by the slot-cache drafter as by the dynamic one, DDTree over the selector's conditional tree, and the
command (`train.serve.specdecode`) lossless, with its agreement check replaying the selector offline."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tests.train.serve.test_export import random_drafter
from tests.train.serve.test_specdecode import (
    LAYER_IDS,
    drafter_config,
    greedy_generate,
    random_prompts,
    tiny_qwen3,
    train_drafter,
)
from train.attention import build_layer_masks
from train.dflash2 import DFlash2Drafter, build_drafter
from train.export_format.layout import drafter_config_from_export, export_config, export_drafter, load_exported
from train.serve.decoding import DFlashProposer, speculative_generate
from train.serve.spec_target import SpecTarget

BLOCK = 8
REFERENCE = "z-lab's reference model code (pip dflash==0.1.0; `make setup` installs it)"


def dflash2_config(**overrides):
    values = dict(arch="dflash2", block_size=BLOCK, selector_rank=8, selector_top_k=6, conv_group_size=8)
    return drafter_config(**{**values, **overrides})


def random_dflash2(cfg, seed: int = 0) -> DFlash2Drafter:
    return random_drafter(cfg, seed)


def reference():
    return pytest.importorskip("dflash.model", reason=f"{REFERENCE} is not installed")


LAYOUTS = {
    "full": {},
    "sliding_then_full": dict(num_hidden_layers=3, layer_types="sliding_then_full", sliding_window=6),
    "sliding_bidirectional": dict(layer_types="sliding", sliding_window=6, sliding_in_block="bidirectional"),
}


# ----------------------------------------------------------------------------------------------
# The layout


def test_config_and_weights_are_the_published_dflash2_layout(tmp_path):
    cfg = dflash2_config()
    config = export_config(cfg)
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert config["auto_map"] == {"AutoModel": "dflash.DFlash2DraftModel"}  # for trust_remote_code (layout.py)
    assert config["is_causal"] is False  # top level, as published (all layers bidirectional in the block)
    nested = config["dflash_config"]
    assert {k: nested[k] for k in ("block_size", "conv_kernel_size", "conv_group_size")} == {
        "block_size": 8,
        "conv_kernel_size": 2,
        "conv_group_size": 8,
    }
    assert (nested["selector_rank"], nested["selector_top_k"], nested["mask_token_id"]) == (8, 6, cfg.mask_token_id)
    assert nested["target_layer_ids"] == LAYER_IDS and "input_embedding_scale" not in nested
    assert drafter_config_from_export(config) == cfg
    model = random_dflash2(cfg)
    out = export_drafter(model.state_dict(), cfg, tmp_path / "e")
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert names == set(model.state_dict())
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"} <= names  # bare
    assert "candidate_selector.hidden_projection.weight" in names and "layers.1.mlp_conv.base_kernel" in names
    per_layer = {n.split(".", 2)[2] for n in names if n.startswith("layers.0.")}
    assert len(per_layer) == 15 and len(names) == 15 * cfg.num_hidden_layers + 3 + 3  # S4: 81 for 5 layers
    from transformers import AutoConfig

    assert drafter_config_from_export(AutoConfig.from_pretrained(out).to_dict()) == cfg
    assert type(load_exported(out, trust_remote_code=True)).__name__ == "DFlash2DraftModel"


def test_the_config_gives_every_field_vllms_dflash2_loader_reads(tmp_path):
    """vllm/model_executor/models/qwen3_dflash2.py (commit 030da624, docs/serving.md) reads the config
    through transformers' Qwen3Config: `dflash_config[...]` (required) and `.get(..., default)`."""
    from transformers import AutoConfig

    cfg = dflash2_config()
    export_drafter(random_dflash2(cfg).state_dict(), cfg, tmp_path / "e", embed_scale=2.5)
    config = AutoConfig.from_pretrained(tmp_path / "e")
    assert type(config).__name__ == "Qwen3Config" and "DFlash2DraftModel" in config.architectures  # registry key
    draft = config.dflash_config
    required = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    assert [int(draft[k]) for k in required] == [2, 8, 8, 6]  # indexed: must be in dflash_config
    assert config.hidden_size % int(draft["conv_group_size"]) == 0
    assert float(draft.get("input_embedding_scale", 1.0)) == 2.5
    assert float(draft.get("output_multiplier", 1.0)) == 1.0 and not draft.get("final_logit_softcapping")
    assert (config.hidden_size, config.vocab_size, draft["target_layer_ids"]) == (32, 64, LAYER_IDS)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda c: c["dflash_config"].pop("selector_rank"), "selector_rank"),
        (lambda c: c["dflash_config"].update(output_multiplier=0.5), "output_multiplier"),
        (lambda c: c.update(architectures=["EagleDraftModel"]), "names neither"),
    ],
)
def test_unreadable_dflash2_configs_are_refused(edit, needle):
    config = export_config(dflash2_config())
    edit(config)
    with pytest.raises(ValueError, match=needle):
        drafter_config_from_export(config)


# ----------------------------------------------------------------------------------------------
# Our dflash.py against the training model


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_exported_model_computes_the_training_models_blocks(tmp_path, layout):
    """One block after its context, a block cut short by the token budget, and many blocks under the
    training mask (offline evaluation's forward: each block convolved on its own)."""
    cfg = dflash2_config(**LAYOUTS[layout])
    model = random_dflash2(cfg, seed=1)
    export_drafter(model.state_dict(), cfg, tmp_path / "e", dtype="float32")
    exported = load_exported(tmp_path / "e", trust_remote_code=True)
    S = 13
    hidden, noise = torch.randn(1, S, cfg.feature_width), torch.randn(1, 3 * BLOCK, cfg.hidden_size)
    with torch.no_grad():
        for Q in (BLOCK, 5):
            positions = torch.arange(S + Q)[None]
            torch.testing.assert_close(
                exported(position_ids=positions, noise_embedding=noise[:, :Q], target_hidden=hidden),
                model(noise[:, :Q], hidden, positions),
                rtol=1e-6,
                atol=1e-6,
            )
        anchors, keep = torch.tensor([[2, 7, 12]]), torch.ones(1, 3, dtype=torch.bool)
        positions = torch.cat([torch.arange(S)[None], (anchors[:, :, None] + torch.arange(BLOCK)).view(1, -1)], 1)
        masks = build_layer_masks("sdpa", anchors, keep, S, BLOCK, cfg.mask_rules)
        many = exported(position_ids=positions, noise_embedding=noise, target_hidden=hidden, attention_mask=masks)
        torch.testing.assert_close(many, model(noise, hidden, positions, masks), rtol=1e-6, atol=1e-6)
        lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        hidden_NLD, anchor_ids = many.view(3, BLOCK, -1)[:, 1:], torch.tensor([3, 9, 40])
        tokens, candidates, q = exported.propose(hidden_NLD, anchor_ids, lm_head)
        assert candidates.shape == (3, BLOCK - 1, 6) and q is None
        assert torch.equal(tokens, model.propose(hidden_NLD, lm_head.weight, anchor_ids))


# ----------------------------------------------------------------------------------------------
# Against z-lab's reference (dflash 0.1.0)


def _reference_model(ref, path):
    model, info = ref.DFlash2DraftModel.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info  # strict
    return model.eval()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_reference_loads_the_export_strictly_and_computes_the_same(tmp_path, layout):
    ref = reference()
    cfg = dflash2_config(**LAYOUTS[layout])
    model = random_dflash2(cfg, seed=2)
    export_drafter(model.state_dict(), cfg, tmp_path / "e", dtype="float32")
    theirs, ours = _reference_model(ref, tmp_path / "e"), load_exported(tmp_path / "e")
    for name, tensor in model.state_dict().items():  # the weights the reference holds are the trained ones
        key = name + (".weight" if name.endswith("_codebook") else "")
        assert torch.equal(theirs.state_dict()[key], tensor), name
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    features, worst = torch.randn(1, 30, cfg.feature_width), 0.0
    # Cached rounds as the reference loop runs them: its cache (sliding layers keep W - 1 keys), cropped
    # back to the anchor after each round; the first round is a single call over the whole context.
    caches = [ref._make_cache(theirs.config), ref._make_cache(theirs.config)]
    cached = 0
    with torch.no_grad():
        for anchor, Q in ((9, BLOCK), (14, BLOCK), (21, BLOCK), (27, 3)):
            noise = torch.randn(1, Q, cfg.hidden_size)
            kwargs = dict(
                position_ids=torch.arange(cached, anchor + Q)[None],
                noise_embedding=noise,
                target_hidden=features[:, cached:anchor],
                use_cache=True,
            )
            got = [m(**kwargs, past_key_values=c)[:, 1:] for m, c in zip((ours, theirs), caches, strict=True)]
            for c in caches:
                ref._crop_to(c, anchor)
            cached = anchor
            worst = max(worst, float((got[0] - got[1]).abs().max()))
            anchor_ids = torch.tensor([int(anchor) % 60])
            assert torch.equal(
                ours.propose(got[0], anchor_ids, head)[0], theirs.propose(got[1], anchor_ids, head, 0.0)[0]
            )
    assert worst <= 1e-5, worst


@pytest.fixture(scope="module")
def trained_dflash2(tmp_path_factory):
    """A float32 tiny target and a DFlash2 drafter trained on its greedy continuations (the selector too)."""
    torch.set_num_threads(1)
    target = SpecTarget.from_model(tiny_qwen3(seed=0, dtype=torch.float32), LAYER_IDS, stop_ids=[])
    prompts = random_prompts(4, lengths=(5, 9, 14, 20), seed=11)
    model = train_drafter(target, prompts, new_tokens=48, steps=80, config=dflash2_config())
    out = tmp_path_factory.mktemp("dflash2") / "drafter"
    export_drafter(model.state_dict(), model.config, out, dtype="float32")
    return target, model, out, prompts[:3] + random_prompts(1, lengths=(7,), seed=99)


def test_the_reference_loop_drives_the_export_losslessly_round_for_round(trained_dflash2, monkeypatch):
    ref = reference()
    monkeypatch.setattr(ref, "_cuda_time", __import__("time").perf_counter)  # its timer syncs CUDA
    target, _, out, prompts = trained_dflash2
    theirs, ours = _reference_model(ref, out), load_exported(out)
    seen = []  # (the selector's drafts, the unary argmax) of each reference round
    propose = theirs.propose

    def recording(hidden, anchor_ids, head, temperature):
        result = propose(hidden, anchor_ids, head, temperature)
        seen.append((result[0], theirs.compute_logits(hidden, head).argmax(-1)))
        return result

    monkeypatch.setattr(theirs, "propose", recording)
    proposer, rounds = DFlashProposer(ours, target), []
    for prompt in prompts:
        base = greedy_generate(target, prompt, 40)
        stats = ref.dflash_generate(theirs, target.model, torch.tensor([prompt]), 40, None, return_stats=True)
        assert stats.output_ids[0, len(prompt) :].tolist() == base.tokens  # lossless
        mine = speculative_generate(target, proposer, prompt, 40)
        own = ours.spec_generate(target=target.model, input_ids=torch.tensor([prompt]), max_new_tokens=40)
        assert mine.tokens == own[0, len(prompt) :].tolist() == base.tokens
        # Round for round while every loop drafts and verifies whole blocks (near the budget they cut differently).
        whole, total = 0, 0
        while whole < len(stats.acceptance_lengths) and total + BLOCK < 40:
            total, whole = total + stats.acceptance_lengths[whole], whole + 1
        committed = [r.committed for r in mine.rounds]
        assert (
            whole >= 2 and stats.acceptance_lengths[:whole] == committed[:whole] == ours.last_acceptance_lengths[:whole]
        )
        rounds += stats.acceptance_lengths
    assert max(rounds) > 3, rounds  # long acceptances were exercised
    assert any(not torch.equal(walk, argmax) for walk, argmax in seen)  # the selector, not the argmax, drafted


def test_sampling_with_top_k_one_is_greedy_through_the_selectors_q(trained_dflash2):
    """Above temperature 0 the drafts come from the selector's q over its candidates and are accepted by
    rejection sampling; a target restricted to its top-1 (top_k=1) makes the output its greedy tokens."""
    target, _, out, prompts = trained_dflash2
    drafter = load_exported(out)
    torch.manual_seed(5)
    for prompt in prompts[:2]:
        got = drafter.spec_generate(
            target=target.model, input_ids=torch.tensor([prompt]), max_new_tokens=30, temperature=0.8, top_k=1
        )
        assert got[0, len(prompt) :].tolist() == greedy_generate(target, prompt, 30).tokens


def test_a_fresh_dflash2_exports_and_decodes_as_its_dflash_backbone(tmp_path):
    """Identity convolutions and a zero successor codebook: the DFlash2 export proposes what the DFlash
    export of the same backbone proposes (the selector adds nothing), through our loop."""
    target = SpecTarget.from_model(tiny_qwen3(seed=1, dtype=torch.float32), LAYER_IDS, stop_ids=[])
    cfg = dflash2_config(selector_top_k=64)
    torch.manual_seed(4)
    fresh = build_drafter(cfg)
    backbone = {k: v for k, v in fresh.state_dict().items() if "conv" not in k and "selector" not in k}
    dflash_cfg = drafter_config(block_size=BLOCK)
    export_drafter(fresh.state_dict(), cfg, tmp_path / "two", dtype="float32")
    export_drafter(backbone, dflash_cfg, tmp_path / "one", dtype="float32")
    config = json.loads((tmp_path / "one" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and "selector_rank" not in config["dflash_config"]
    two, one = (DFlashProposer(load_exported(tmp_path / n), target) for n in ("two", "one"))
    for prompt in random_prompts(2, lengths=(6, 15), seed=3):
        a, b = speculative_generate(target, two, prompt, 24), speculative_generate(target, one, prompt, 24)
        assert a.tokens == b.tokens and a.taus == b.taus


# ----------------------------------------------------------------------------------------------
# Our speculative decoding with a DFlash2 drafter


class Proposals:
    """A proposer that hands out `inner`'s proposals and keeps them."""

    def __init__(self, inner):
        self.inner, self.block_size, self.rounds = inner, inner.block_size, []

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, *args) -> list[int]:
        self.rounds.append(self.inner.propose(*args))
        return self.rounds[-1]


@pytest.mark.parametrize("layout", ["full", "sliding_then_full"])
def test_the_slot_cache_drafter_proposes_the_selectors_walk_as_the_dynamic_one(trained_dflash2, tmp_path, layout):
    """train.serve.static_drafter with a DFlash2 drafter (eagerly here: no CUDA; tests/gpu replays it as a
    graph): the same proposals round by round as DFlashProposer, for prompts shorter and longer than a block."""
    from train.serve.static_drafter import StaticDFlashProposer

    target, model, out, _ = trained_dflash2
    if layout != "full":  # the trained weights under another attention layout: still a DFlash2 drafter to run
        cfg = dflash2_config(**LAYOUTS[layout])
        out = export_drafter(random_dflash2(cfg, seed=6).state_dict(), cfg, tmp_path / "d", dtype="float32")
    drafter = load_exported(out)
    static = StaticDFlashProposer(drafter, target, max_len=200)
    assert static.graph_note.startswith("off")
    for replayed in (False, True):
        if replayed:  # the replay's plumbing: a stand-in graph that reruns the captured round into its outputs
            static.window.graph, static.window.drafts_L = Rerun(static), torch.zeros(BLOCK - 1, dtype=torch.long)
        for prompt in random_prompts(3, lengths=(3, 12, 30), seed=8):
            ours, theirs = Proposals(static), Proposals(DFlashProposer(drafter, target))
            a, b = speculative_generate(target, ours, prompt, 40), speculative_generate(target, theirs, prompt, 40)
            assert a.tokens == b.tokens == greedy_generate(target, prompt, 40).tokens
            assert ours.rounds == theirs.rounds and len(ours.rounds) > 2
    assert static.replays > 3 and static.window.logits_LV is None  # DFlash2: the graph holds drafts only


class Rerun:
    """Stands in for a captured CUDA graph on the CPU: `replay` reruns the window round into its static outputs."""

    def __init__(self, proposer):
        self.proposer = proposer

    def replay(self) -> None:
        self.proposer.window.drafts_L.copy_(self.proposer._window_outputs()[1])


def test_ddtree_with_a_dflash2_drafter_walks_its_selectors_conditional_tree(trained_dflash2):
    """Online DDTree verification with a DFlash2 drafter is lossless, each round's τ is the walk of the
    target's tokens down the conditional tree of that round's hidden states (train.eval.selector), and
    a large enough tree accepts at least what the chain accepts on the trained prompts."""
    from train.eval.ddtree import walk_tree
    from train.serve.tree_decode import ddtree_generate, round_tree

    target, _, out, prompts = trained_dflash2
    proposer = DFlashProposer(load_exported(out), target)
    for prompt in prompts[:2]:
        base = greedy_generate(target, prompt, 40)
        sequence = prompt + base.tokens
        chain = speculative_generate(target, proposer, prompt, 40)
        for budget in (1, 16):
            gen = ddtree_generate(target, proposer, prompt, 40, budget)
            assert gen.tokens == base.tokens, budget
            proposer.reset()
            features = target.teacher_forced(torch.tensor([sequence]))[1][None]
            for r in gen.rounds:
                tree = round_tree(proposer, features[:, : r.start], sequence[r.start], r.start, budget)
                proposer.reset()
                y = torch.tensor((sequence[r.start + 1 : r.start + BLOCK] + [0] * BLOCK)[: BLOCK - 1])
                assert r.tau == 1 + walk_tree(tree, y, valid_len=min(BLOCK - 1, len(sequence) - 1 - r.start))
        assert gen.mean_tau >= chain.mean_tau and max(gen.taus) > 2


def test_the_specdecode_command_with_a_dflash2_export(tmp_path, capsys):
    """`python -m train.serve.specdecode` with a DFlash2 export: lossless, the class recorded and printed,
    and the agreement check (its offline replay drafts with the selector too) finds every round equal."""
    from tests.train.serve.test_specdecode import cli_inputs
    from train.serve.specdecode import main

    prompts = cli_inputs(tmp_path)
    cfg = dflash2_config()
    export_drafter(random_dflash2(cfg, seed=7).state_dict(), cfg, tmp_path / "drafter", dtype="float32")
    out = tmp_path / "result.json"
    args = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts)]
    assert main(args + ["--max-new-tokens", "20", "--num-prompts", "2", "--agreement", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "drafter DFlash2DraftModel (proposals: its selector's walk)" in printed and "lossless: True" in printed
    result = json.loads(out.read_text())
    assert result["config"]["drafter_architecture"] == "DFlash2DraftModel" and result["summary"]["lossless"]
    assert len(result["summary"]["tau_histogram"]) == BLOCK and result["agreement"]["round_mismatches"] == 0
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    config["dflash_config"]["input_embedding_scale"] = 2.0  # an export made for another target
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(config))
    assert main(args + ["--max-new-tokens", "4"]) == 2
    assert "input_embedding_scale 2.0" in capsys.readouterr().err
