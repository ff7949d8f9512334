"""Speculative decoding on tiny random targets: lossless against target-only greedy decoding, the τ
accounting (a perfect drafter reaches τ = 16, a wrong one τ = 1), the hybrid (Gated DeltaNet) cache,
and the agreement property: offline chain τ at the anchors where online rounds started equals the
online τ, round by round.

The lossless tests run the target in float64, so that the cached 16-token verification and the
one-token greedy steps cannot flip an argmax through rounding; the agreement test runs in float32.
A drafter trained for a few seconds on the target's own greedy text gives rounds of every length.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from tests.common.test_repeat import first_loop_reference
from train.attention import build_layer_masks
from train.blocks import BlockSpec, make_blocks
from train.dflash2 import DFlash2Drafter, build_drafter
from train.drafter_config import DrafterConfig
from train.export_format.layout import export_drafter, load_exported
from train.model import DFlashDrafter
from train.serve.agreement import agreement, offline_block_drafts
from train.serve.decoding import DFlashProposer, greedy_generate, speculative_generate
from train.serve.prompts import prompts_from_jsonl
from train.serve.results import summarize
from train.serve.spec_target import SpecTarget
from train.serve.specdecode import main
from train.serve.tree_decode import ddtree_generate, tree_attention_mask, walk_verified_tree

V = 64
MASK = V - 1
LAYER_IDS = [0, 2]
B = 16


def tiny_qwen3(seed: int = 0, dtype=torch.float64) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return Qwen3ForCausalLM(cfg).eval().to(dtype)


def drafter_config(**overrides) -> DrafterConfig:
    values = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=V,
        target_layer_ids=LAYER_IDS,
        num_target_layers=4,
        mask_token_id=MASK,
        block_size=B,
        rope_theta=10000.0,
        max_position_embeddings=1024,
    )
    values.update(overrides)
    return DrafterConfig(**values)


def exported(tmp_path, model: DFlashDrafter, name: str = "drafter", dtype=torch.float32):
    export_drafter(model.state_dict(), model.config, tmp_path / name, dtype="float32")
    return load_exported(tmp_path / name, dtype=dtype)


def random_prompts(n: int, lengths=(1, 5, 23, 9), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MASK, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


class OracleProposer:
    """Proposes the target's own greedy tokens: every verified draft is accepted."""

    block_size = B

    def __init__(self, sequence: list[int]):
        self.sequence = sequence

    def reset(self) -> None:
        pass

    def propose(self, new_features_1SF, anchor_token: int, anchor_pos: int) -> list[int]:
        assert self.sequence[anchor_pos] == anchor_token
        drafts = self.sequence[anchor_pos + 1 : anchor_pos + B]
        return drafts + [0] * (B - 1 - len(drafts))


class WrongProposer(OracleProposer):
    """Never proposes the target's token."""

    def propose(self, new_features_1SF, anchor_token: int, anchor_pos: int) -> list[int]:
        return [(t + 1) % V for t in super().propose(new_features_1SF, anchor_token, anchor_pos)]


class BrokenAtProposer(OracleProposer):
    """Right except at block position `k` (so every full round accepts k-1 drafts)."""

    def __init__(self, sequence: list[int], k: int):
        super().__init__(sequence)
        self.k = k

    def propose(self, new_features_1SF, anchor_token: int, anchor_pos: int) -> list[int]:
        drafts = super().propose(new_features_1SF, anchor_token, anchor_pos)
        drafts[self.k - 1] = (drafts[self.k - 1] + 1) % V
        return drafts


def check_round_bookkeeping(gen, block_size: int = B) -> None:
    """Rounds tile the continuation: each starts where the last one's tokens end; τ in 1..B."""
    position = gen.prompt_len
    for r in gen.rounds:
        assert r.start == position
        assert 1 <= r.tau <= block_size and 1 <= r.committed <= block_size
        assert r.tau - 1 <= r.committed and 0 <= r.accepted <= block_size - 1
        if r is not gen.rounds[-1]:  # only the last round can be cut by a stop token or the budget
            assert r.committed == r.accepted + 1 == r.tau
        position += r.committed
    assert position == gen.prompt_len + len(gen.tokens) - 1


# ----------------------------------------------------------------------------------------------
# Lossless


def test_speculative_equals_greedy_for_random_drafter(tmp_path):
    target = SpecTarget.from_model(tiny_qwen3(), LAYER_IDS, stop_ids=[])
    proposer = DFlashProposer(exported(tmp_path, DFlashDrafter(drafter_config())), target)
    for prompt in random_prompts(4):
        for max_new in (1, 2, 16, 17, 45):
            base = greedy_generate(target, prompt, max_new)
            spec = speculative_generate(target, proposer, prompt, max_new)
            assert spec.tokens == base.tokens, (prompt, max_new)
            assert len(spec.tokens) == max_new and spec.stop == base.stop == "length"
            assert len(spec.rounds) == (0 if max_new == 1 else len(spec.rounds))
            check_round_bookkeeping(spec)
    assert target.cache_mode == "crop"


def test_stop_token_ends_both_loops_at_the_same_token():
    model = tiny_qwen3(seed=3)
    free = SpecTarget.from_model(model, LAYER_IDS, stop_ids=[])
    prompt = random_prompts(1, lengths=(7,), seed=5)[0]
    base = greedy_generate(free, prompt, 40)
    stop = base.tokens[12]
    first = base.tokens.index(stop)
    target = SpecTarget.from_model(model, LAYER_IDS, stop_ids=[stop])
    stopped = greedy_generate(target, prompt, 40)
    assert stopped.tokens == base.tokens[: first + 1] and stopped.stop == "eos"
    for proposer in (OracleProposer(prompt + base.tokens), BrokenAtProposer(prompt + base.tokens, 3)):
        spec = speculative_generate(target, proposer, prompt, 40)
        assert spec.tokens == stopped.tokens and spec.stop == "eos"
        check_round_bookkeeping(spec)


def test_a_shorter_verify_commits_at_most_its_rows_and_stays_lossless():
    """`verify_tokens`: every round verifies the anchor and its first N-1 drafts only, so an oracle
    commits exactly N tokens a round (the last round fewer), a partly right drafter at most N, and
    the output is target-only greedy decoding; a value past the block size is refused."""
    model = tiny_qwen3(seed=3)
    target = SpecTarget.from_model(model, LAYER_IDS, stop_ids=[])
    prompt = random_prompts(1, lengths=(9,), seed=6)[0]
    base = greedy_generate(target, prompt, 41)
    for N in (1, 2, 5):
        oracle = speculative_generate(target, OracleProposer(prompt + base.tokens), prompt, 41, verify_tokens=N)
        assert oracle.tokens == base.tokens
        assert [r.committed for r in oracle.rounds[:-1]] == [N] * (len(oracle.rounds) - 1)
        partial = speculative_generate(target, BrokenAtProposer(prompt + base.tokens, 3), prompt, 41, verify_tokens=N)
        assert partial.tokens == base.tokens and max(r.committed for r in partial.rounds) == min(N, 3)
        check_round_bookkeeping(partial)
    with pytest.raises(ValueError, match="verify_tokens must be between 1 and the block size"):
        speculative_generate(target, OracleProposer(prompt + base.tokens), prompt, 8, verify_tokens=B + 1)


def test_stop_repeat_ends_both_loops_where_the_response_starts_looping():
    """With stop_repeat, a response ends right after its first repetition, where recipes.tiny cuts
    its regenerated answers (`first_loop_reference`), in target-only and speculative decoding alike."""
    target = SpecTarget.from_model(tiny_qwen3(seed=3), LAYER_IDS, stop_ids=[])
    ends = []
    for prompt in random_prompts(8, seed=7):
        free = greedy_generate(target, prompt, 60)
        loop = first_loop_reference(free.tokens, 6)
        base = greedy_generate(target, prompt, 60, stop_repeat=6)
        assert base.tokens == (free.tokens[:loop] if loop else free.tokens) and base.stop == (
            "repeat" if loop else "length"
        )
        for proposer in (OracleProposer(prompt + free.tokens), BrokenAtProposer(prompt + free.tokens, 3)):
            spec = speculative_generate(target, proposer, prompt, 60, stop_repeat=6)
            assert spec.tokens == base.tokens and spec.stop == base.stop
            check_round_bookkeeping(spec)
        ends.append((base.stop, len(base.tokens)))
    assert len({n for stop, n in ends if stop == "repeat"}) >= 2, ends  # cut at several places


# ----------------------------------------------------------------------------------------------
# τ accounting with stub drafters


@pytest.mark.parametrize("max_new", [1, 2, 16, 17, 33, 40])
def test_perfect_drafter_accepts_whole_blocks(max_new):
    target = SpecTarget.from_model(tiny_qwen3(), LAYER_IDS, stop_ids=[])
    prompt = random_prompts(1, lengths=(6,))[0]
    base = greedy_generate(target, prompt, max_new)
    spec = speculative_generate(target, OracleProposer(prompt + base.tokens), prompt, max_new)
    assert spec.tokens == base.tokens
    after_first = max_new - 1
    assert len(spec.rounds) == math.ceil(after_first / B)
    for r in spec.rounds[:-1]:
        assert (r.tau, r.accepted, r.committed) == (16, 15, 16)
    if spec.rounds:
        last = after_first - B * (len(spec.rounds) - 1)  # tokens the last round may produce
        # A cut block: its drafts agree with all `last` tokens it produced, so τ = last + 1 (at most 16).
        assert spec.rounds[-1].committed == last and spec.rounds[-1].tau == min(B, last + 1)
    # One target forward per round: the speculative loop verifies 16 tokens where greedy decoding runs 16 forwards.
    assert spec.target_forwards == len(spec.rounds) and base.target_forwards == after_first


def test_wrong_drafter_gives_tau_one():
    target = SpecTarget.from_model(tiny_qwen3(), LAYER_IDS, stop_ids=[])
    prompt = random_prompts(1, lengths=(6,))[0]
    base = greedy_generate(target, prompt, 30)
    spec = speculative_generate(target, WrongProposer(prompt + base.tokens), prompt, 30)
    assert spec.tokens == base.tokens
    assert spec.taus == [1] * 29 and all(r.committed == 1 and r.accepted == 0 for r in spec.rounds)
    summary = summarize([spec], [base], B)
    assert summary["tau"] == 1.0 and summary["tau_histogram"] == [29] + [0] * 15 and summary["lossless"]


def test_partial_acceptance_tau_and_summary():
    target = SpecTarget.from_model(tiny_qwen3(), LAYER_IDS, stop_ids=[])
    prompts = random_prompts(2, lengths=(6, 11))
    specs, bases = [], []
    for prompt, k in zip(prompts, (5, 9), strict=True):
        base = greedy_generate(target, prompt, 48)
        spec = speculative_generate(target, BrokenAtProposer(prompt + base.tokens, k), prompt, 48)
        assert spec.tokens == base.tokens
        full = spec.rounds[:-1]
        assert full and all((r.accepted, r.tau, r.committed) == (k - 1, k, k) for r in full)
        specs.append(spec)
        bases.append(base)
    summary = summarize(specs, bases, B)
    # τ = mean over prompts of the per-prompt means (docs/dflash.md "Acceptance length (τ)"), not the pooled mean.
    assert summary["tau"] == pytest.approx((specs[0].mean_tau + specs[1].mean_tau) / 2)
    assert summary["tau_pooled"] == pytest.approx(sum(specs[0].taus + specs[1].taus) / summary["rounds"])
    assert sum(summary["tau_histogram"]) == summary["rounds"] == len(specs[0].rounds) + len(specs[1].rounds)
    assert summary["tau_histogram"][4] >= len(specs[0].rounds) - 1 and summary["lossless"]


# ----------------------------------------------------------------------------------------------
# A drafter with real acceptance: trained for a few seconds on the target's greedy text


def train_drafter(
    target: SpecTarget,
    prompts: list[list[int]],
    new_tokens: int,
    steps: int,
    config: DrafterConfig | None = None,
    features_of=lambda features_TF: features_TF,
) -> DFlashDrafter:
    """The training recipe in miniature (train.blocks anchors/labels, the training mask, weighted CE on
    the target's greedy top-1) on the target's own greedy continuations of `prompts`; `features_of`
    maps the target's tap features to what the drafter (of `config`) reads. A DFlash2 drafter also
    learns its selector (`selector_loss`)."""
    rows = []
    for prompt in prompts:
        gen = greedy_generate(target, prompt, new_tokens)
        ids = torch.tensor(prompt + gen.tokens)
        greedy, features = target.teacher_forced(ids[None])
        rows.append((ids, greedy, features_of(features.float()), len(prompt)))
    S = max(len(r[0]) for r in rows)
    input_ids = torch.zeros(len(rows), S, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), S, dtype=torch.bool)
    topk = torch.zeros(len(rows), S, 1, dtype=torch.long)
    hidden = torch.zeros(len(rows), S, rows[0][2].shape[-1])
    lengths = torch.tensor([len(r[0]) for r in rows])
    for i, (ids, greedy, features, prompt_len) in enumerate(rows):
        n = len(ids)
        input_ids[i, :n], topk[i, :n, 0], hidden[i, :n] = ids, greedy, features
        loss_mask[i, prompt_len:n] = True
    torch.manual_seed(0)
    drafter = build_drafter(config or drafter_config())
    K = drafter.config.block_size
    embed = target.embed_VD.float()
    head = target.target.lm_head.weight.float()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        blocks = make_blocks(
            input_ids,
            loss_mask,
            lengths,
            topk,
            BlockSpec(block_size=K, mask_token_id=MASK, num_anchors=12, gamma=7.0),
            generator=generator,
        )
        mask = build_layer_masks("sdpa", blocks.anchors_BN, blocks.keep_BN, S, K, drafter.config.mask_rules)
        out = drafter(F.embedding(blocks.block_ids_BQ, embed), hidden, blocks.position_ids_BP, mask)
        rows_M = blocks.loss_rows_M
        logits = out.reshape(-1, out.shape[-1])[rows_M] @ head.T
        weights = blocks.weights_BQ.reshape(-1)[rows_M]
        loss = (
            F.cross_entropy(logits, blocks.labels_BQ.reshape(-1)[rows_M], reduction="none") * weights
        ).sum() / weights.sum()
        if isinstance(drafter, DFlash2Drafter):
            loss = loss + selector_loss(drafter, blocks, out.reshape(-1, out.shape[-1])[rows_M], logits)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


def selector_loss(drafter: DFlash2Drafter, blocks, hidden_MD: torch.Tensor, logits_MV: torch.Tensor) -> torch.Tensor:
    """Teacher-forced CE of the selector over the unary top-k, where the label is among them: the
    predecessor of block position k is the label of k-1 (the anchor for k = 1)."""
    K = drafter.config.block_size
    labels_BQ, ids_BQ = blocks.labels_BQ, blocks.block_ids_BQ
    first_BQ = (torch.arange(labels_BQ.shape[1]) % K == 1)[None]
    previous_BQ = torch.where(first_BQ, ids_BQ.roll(1, dims=1), labels_BQ.roll(1, dims=1))
    rows_M = blocks.loss_rows_M
    labels_M, previous_M = labels_BQ.reshape(-1)[rows_M], previous_BQ.reshape(-1)[rows_M]
    unary_Mk, candidates_Mk = logits_MV.topk(drafter.config.selector_top_k, dim=-1)
    covered_Mk = candidates_Mk == labels_M[:, None]
    scores_Mk = drafter.candidate_selector.scores(hidden_MD, unary_Mk, candidates_Mk, previous_M)
    covered_M = covered_Mk.any(-1)
    if not bool(covered_M.any()):
        return scores_Mk.sum() * 0.0
    return F.cross_entropy(scores_Mk[covered_M], covered_Mk[covered_M].float().argmax(-1))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A float32 tiny target and a drafter trained on its greedy continuations of four prompts (about 3 s)."""
    torch.set_num_threads(1)
    target = SpecTarget.from_model(tiny_qwen3(seed=0, dtype=torch.float32), LAYER_IDS, stop_ids=[])
    prompts = random_prompts(4, lengths=(5, 9, 14, 20), seed=11)
    drafter = train_drafter(target, prompts, new_tokens=60, steps=80)
    out = tmp_path_factory.mktemp("trained")
    # Three of its training prompts (the tiny drafter memorized those continuations: long acceptances)
    # and an unseen one (mostly τ = 1).
    return target, exported(out, drafter), prompts[:3] + random_prompts(1, lengths=(7,), seed=99)


def test_trained_drafter_is_lossless_and_accepts(trained):
    target, drafter, prompts = trained
    proposer = DFlashProposer(drafter, target)
    taus = []
    for prompt in prompts:
        base = greedy_generate(target, prompt, 60)
        spec = speculative_generate(target, proposer, prompt, 60)
        assert spec.tokens == base.tokens
        check_round_bookkeeping(spec)
        taus += spec.taus
    # The drafter learned something: this test exercises partial acceptances, not only τ = 1.
    assert sum(taus) / len(taus) > 2.0 and len(set(taus)) >= 4, taus


def test_context_cache_gives_the_same_rounds_as_recomputing(trained):
    target, drafter, prompts = trained
    cached, recomputed = DFlashProposer(drafter, target), DFlashProposer(drafter, target, context_cache=False)
    for prompt in prompts[:2]:
        a = speculative_generate(target, cached, prompt, 50)
        b = speculative_generate(target, recomputed, prompt, 50)
        assert a.tokens == b.tokens and a.taus == b.taus


def test_offline_block_drafts_equal_one_block_at_a_time(trained):
    """Many blocks under the training mask = each block alone with the context before its anchor."""
    target, drafter, prompts = trained
    ids = torch.tensor(prompts[0] + greedy_generate(target, prompts[0], 40).tokens)
    _, features = target.teacher_forced(ids[None])
    anchors = [7, 8, 20, 31, 43]
    assert len(ids) == 45
    batched = offline_block_drafts(drafter, target, ids, features, anchors, chunk=3)
    for row, a in enumerate(anchors):
        block = torch.full((1, B), MASK)
        block[0, 0] = ids[a]
        with torch.no_grad():
            hidden = drafter(
                position_ids=torch.arange(a + B)[None],
                noise_embedding=F.embedding(block, target.embed_VD),
                target_hidden=features[None, :a],
            )
        assert batched[row].tolist() == target.draft_logits(hidden[:, 1:]).argmax(-1)[0].tolist()


def test_offline_tau_at_round_starts_equals_online_tau(trained):
    """The agreement property, float32, features from one teacher-forced forward (as extraction stores them)."""
    target, drafter, prompts = trained
    result = agreement(target, drafter, prompts, 60)
    assert result["prompts"] == len(prompts) and result["greedy_mismatches"] == 0
    assert result["round_mismatches"] == 0
    assert result["offline_tau_at_rounds"] == result["online_tau"] == result["offline_tau_chained"]
    for p in result["per_prompt"]:
        assert p["offline_tau_at_rounds"] == p["online_tau"] == p["offline_tau_chained"]
        assert p["anchors"] == 59 and p["rounds"] < p["anchors"]
    # The arithmetic mean over all anchors is at least the harmonic mean (which predicts tokens per round).
    assert result["offline_tau_all"] >= result["offline_tau_harmonic"] > 1.0
    # The online rounds really are a subset: recompute them by hand for the first prompt.
    spec = speculative_generate(target, DFlashProposer(drafter, target), prompts[0], 60)
    assert sum(spec.taus) / len(spec.taus) == pytest.approx(result["per_prompt"][0]["online_tau"])
    # Given the generations a benchmark already decoded, it reuses them and finds the same.
    gens = [speculative_generate(target, DFlashProposer(drafter, target), p, 60) for p in prompts]
    assert agreement(target, drafter, prompts, 60, generations=gens) == result
    with pytest.raises(ValueError, match="generations"):
        agreement(target, drafter, prompts, 60, generations=gens[:1])


def test_shard_prompts_and_corpus_offline_tau(trained, tmp_path):
    """--data: prompts are the tokens before each sample's first response; when the stored response is
    the target's greedy continuation, offline τ on the shards equals the agreement's all-anchor τ with
    features rounded to bf16 as the shards store them."""
    from common.hashing import sample_id
    from shards import ShardWriter, sample_from_torch
    from train.serve.agreement import corpus_offline_tau
    from train.serve.prompts import prompts_from_shards

    target, drafter, prompts = trained
    provenance = {"target": {"hidden_size": 32, "vocab_size": V}, "taps": {"layer_ids": LAYER_IDS}, "topk": 1}
    with ShardWriter(str(tmp_path / "shards"), provenance=provenance, hidden_width=64, topk=1) as writer:
        for prompt in prompts:
            ids = torch.tensor(prompt + greedy_generate(target, prompt, 40).tokens)
            greedy, features = target.teacher_forced(ids[None])
            loss_mask = torch.arange(len(ids)) >= len(prompt)
            writer.write(
                sample_from_torch(
                    sample_id(ids.numpy(), loss_mask.numpy().astype("uint8")),
                    ids,
                    loss_mask,
                    features.bfloat16(),
                    greedy[:, None],
                    torch.zeros(len(ids), 1),
                )
            )
    got, samples = prompts_from_shards(str(tmp_path / "shards"), None)
    assert got == prompts
    corpus = corpus_offline_tau(drafter, target, samples)
    online = agreement(target, drafter, prompts, 40, feature_dtype=torch.bfloat16)
    assert corpus["samples"] == len(prompts)
    assert corpus["offline_tau_corpus"] == pytest.approx(online["offline_tau_all"], abs=1e-12)
    assert corpus["offline_tau_corpus_chained"] == pytest.approx(online["offline_tau_chained"], abs=1e-12)


def test_chained_anchors_replay_the_online_schedule():
    from train.serve.agreement import chained_anchors

    tau = torch.tensor([3, 9, 9, 1, 16, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 2, 5, 1, 1])  # anchors 10..29, end 31
    assert chained_anchors(tau, 10, 31) == [10, 13, 14]  # 14 + 16 = 30 = the last token: nothing left
    assert chained_anchors(tau[:1], 10, 12) == [10] and chained_anchors(tau[:0], 10, 11) == []


# ----------------------------------------------------------------------------------------------
# Hybrid target (Qwen3.5 Gated DeltaNet + attention): per-token states instead of a crop


def tiny_qwen35(seed: int = 0):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3_5TextConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    )
    return Qwen3_5ForCausalLM(cfg).eval().to(torch.float64)


def test_hybrid_target_keeps_per_token_states_and_stays_lossless(tmp_path):
    """Float64 on the one-family fixture (every acceptance length in float32 on both hybrid families:
    tests/train/serve/test_rollback.py): the accepted tokens are never run again."""
    target = SpecTarget.from_model(tiny_qwen35(), LAYER_IDS, stop_ids=[])
    proposer = DFlashProposer(exported(tmp_path, DFlashDrafter(drafter_config(partial_rotary_factor=0.25))), target)
    prompt = random_prompts(1, lengths=(9,), seed=7)[0]
    base = greedy_generate(target, prompt, 40)
    sequence = prompt + base.tokens
    for stub in (proposer, OracleProposer(sequence), BrokenAtProposer(sequence, 6), WrongProposer(sequence)):
        spec = speculative_generate(target, stub, prompt, 40)
        assert spec.tokens == base.tokens, type(stub).__name__
        check_round_bookkeeping(spec)
        assert spec.target_forwards == len(spec.rounds)  # one verify per round, no re-run
    assert target.cache_mode == "rollback"


# ----------------------------------------------------------------------------------------------
# The command line, end to end on a saved tiny target with a tokenizer


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
    words = [f"w{i}" for i in range(V - len(specials) - 3)] + ["user", "assistant", "[UNK]"]
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({s: len(words) + i for i, s in enumerate(specials)})
    assert len(vocab) == V and vocab["<|MASK|>"] == MASK
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        mask_token="<|MASK|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    wrapped.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    return wrapped


def test_prompts_are_first_user_turns_with_the_generation_prompt_or_texts(tmp_path):
    tokenizer = word_tokenizer()
    path = tmp_path / "p.jsonl"
    records = [
        {
            "messages": [
                {"role": "user", "content": "w1 w2"},
                {"role": "assistant", "content": "w3"},
                {"role": "user", "content": "w4"},
                {"role": "assistant", "content": "w5"},
            ]
        },
        {"text": "w9 w9"},
        {"messages": [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    prompts = prompts_from_jsonl(path, tokenizer, limit=None)
    decode = [tokenizer.convert_ids_to_tokens(p) for p in prompts]
    assert decode == [
        ["<|im_start|>", "user", "w1", "w2", "<|im_end|>", "<|im_start|>", "assistant"],
        ["w9", "w9"],  # a text record is a prompt as given (base models)
        ["<|im_start|>", "user", "w7", "<|im_end|>", "<|im_start|>", "assistant"],
    ]
    assert len(prompts_from_jsonl(path, tokenizer, limit=1)) == 1


def cli_inputs(tmp_path, n_prompts: int = 3, model=None):
    """A saved tiny target (`model`, default a Qwen3) with a tokenizer, an exported random drafter and a
    prompts file, as the CLI takes them."""
    from transformers import GenerationConfig

    tokenizer = word_tokenizer()
    model = tiny_qwen3(seed=4, dtype=torch.float32) if model is None else model
    model.generation_config = GenerationConfig(eos_token_id=[tokenizer.convert_tokens_to_ids("<|im_end|>")])
    model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    export_drafter(DFlashDrafter(drafter_config()).state_dict(), drafter_config(), tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"w{i} w{i + 1}"}]}) + "\n" for i in range(n_prompts)
        )
    )
    return prompts


def test_a_base_target_takes_a_chat_template_file_or_text_prompts(tmp_path, capsys):
    """A target whose tokenizer has no chat template: chat prompts need chat_template=FILE (whose hash the
    result records), {"text": ...} prompts are taken as they are."""
    from transformers import AutoTokenizer

    from common.hashing import text_digest

    prompts = cli_inputs(tmp_path, n_prompts=1)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "target")
    template = tmp_path / "chat.jinja"
    template.write_text(tokenizer.chat_template)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "target")
    (tmp_path / "target" / "chat_template.jinja").unlink(missing_ok=True)
    base = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--max-new-tokens", "4"]
    assert main([*base, "--prompts", str(prompts)]) == 2
    assert "set chat_template=FILE" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert main([*base, "--prompts", str(prompts), "--chat-template", str(template), "--out", str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["chat_template"] == str(template) and config["chat_template_hash"] == text_digest(
        template.read_text()
    )
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "w1 w2 w3"}) + "\n")
    assert main([*base, "--prompts", str(text), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["chat_template_hash"] is None and result["prompts"][0]["prompt_tokens"] == 3


def test_a_target_without_sdpa_decodes_with_eager_attention(tmp_path, capsys):
    """Gemma2 has no sdpa attention in transformers: attn_implementation=eager (or auto, transformers'
    own choice) decodes it losslessly, and the result records the implementation used."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    prompts = cli_inputs(tmp_path, n_prompts=1)
    shape = {k: getattr(tiny_qwen3().config, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers")}
    gemma = Gemma2Config(**shape, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    Gemma2ForCausalLM(gemma).save_pretrained(tmp_path / "target")  # over the Qwen3 weights, beside the tokenizer
    args = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts)]
    args += ["--max-new-tokens", "8"]
    assert main(args) == 2
    assert "attn_implementation" in capsys.readouterr().err
    for asked in ("eager", "auto"):
        out = tmp_path / f"{asked}.json"
        assert main([*args, f"attn_implementation={asked}", "--out", str(out)]) == 0
        result = json.loads(out.read_text())
        assert result["summary"]["lossless"] and result["config"]["attn_implementation_used"] == "eager"


def test_cli_end_to_end(tmp_path, capsys):
    prompts = cli_inputs(tmp_path)
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
            "24",
            "--num-prompts",
            "2",
            "--out",
            str(out),
            "--agreement",
            "--threads",
            "1",
            "--tf32",
        ]
    )
    assert code == 0
    assert not torch.backends.cuda.matmul.allow_tf32  # the run's precision setting does not outlive it
    printed = capsys.readouterr().out
    assert "lossless: True" in printed and "speed-up" in printed and "offline τ at the online round starts" in printed
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["prompts"] == 2 and summary["lossless"] and summary["speedup"] > 0
    assert sum(summary["tau_histogram"]) == summary["rounds"] and len(summary["tau_histogram"]) == B
    assert result["agreement"]["round_mismatches"] == 0 and result["agreement"]["seconds"] > 0
    assert f"the agreement check took {result['agreement']['seconds']:.1f} s" in printed
    assert result["config"]["max_new_tokens"] == 24 and result["cache_mode"] == "crop"
    assert result["decoding_path"] == "full-attention eager" and "decoding path: full-attention eager" in printed
    assert result["config"]["tf32"] is True and result["config"]["verify_tokens"] == B
    assert result["config"]["compile"] is None  # no static cache on the CPU, so nothing was compiled
    args = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts)]
    short = tmp_path / "short.json"
    assert (
        main(args + ["--num-prompts", "1", "--max-new-tokens", "12", "--verify-tokens", "3", "--out", str(short)]) == 0
    )
    result = json.loads(short.read_text())
    assert result["summary"]["lossless"] and result["config"]["verify_tokens"] == 3
    assert not any(result["summary"]["tau_histogram"][3:])  # no round got past its third position
    swept = tmp_path / "sweep.json"
    sweep_args = ["--num-prompts", "1", "--max-new-tokens", "12", "--verify-sweep", "2,3", "--out", str(swept)]
    assert main(args + sweep_args) == 0
    result = json.loads(swept.read_text())
    assert sorted(result["verify_sweep"]) == ["2", "3"] and result["config"]["verify_sweep"] == [2, 3]
    for n, run in result["verify_sweep"].items():  # each size decoded the prompt losslessly, at most n per round
        assert run["lossless"] and run["new_tokens"] == result["summary"]["new_tokens"]
        assert not any(run["tau_histogram"][int(n) :]) and sum(run["tau_histogram"]) == run["rounds"]
    assert "verify 2 tokens: τ" in capsys.readouterr().out
    assert main(args + ["--verify-tokens", str(B + 1)]) == 2
    assert main(args + ["--verify-sweep", f"2,{B + 1}"]) == 2
    assert main(args + ["--verify-sweep", "two"]) == 2
    assert (
        main(
            [
                "--target",
                str(tmp_path / "target"),
                "--drafter",
                str(tmp_path / "drafter"),
                "--prompts",
                str(tmp_path / "missing.jsonl"),
            ]
        )
        == 2
    )


# ----------------------------------------------------------------------------------------------
# DDTree verification (stretch goal)


class OneHot:
    """Gives a stub proposer confident logits (its drafts at +50): the DDTree of budget 15 is then
    exactly the drafted chain, one node per depth."""

    def __init__(self, stub):
        self.stub, self.block_size = stub, B

    def reset(self) -> None:
        self.stub.reset()

    def propose(self, *args) -> list[int]:
        return self.stub.propose(*args)

    def draft_logits(self, *args) -> torch.Tensor:
        return F.one_hot(torch.tensor(self.stub.propose(*args)), V).double() * 50.0


class Recording:
    """Records the drafter's logits of every round."""

    def __init__(self, proposer):
        self.proposer, self.block_size, self.logits = proposer, proposer.block_size, []

    def reset(self) -> None:
        self.proposer.reset()

    def draft_logits(self, *args) -> torch.Tensor:
        self.logits.append(self.proposer.draft_logits(*args))
        return self.logits[-1]


def test_tree_mask_and_walk():
    parent = torch.tensor([-1, -1, 0, 2, 1])  # nodes: a, b (depth 1), a->c, a->c->d, b->e
    token = torch.tensor([5, 6, 7, 8, 9])
    visible = tree_attention_mask(parent, cached=2, dtype=torch.float32)[0, 0] == 0
    assert visible.shape == (6, 8) and visible[:, :2].all()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 1, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(visible[:, 2:], expected)
    # greedy[0] at the root, greedy[i + 1] at node i
    assert walk_verified_tree(parent, token, [5, 7, 0, 8, 3, 0]) == [0, 2, 3]
    assert walk_verified_tree(parent, token, [6, 0, 9, 0, 0, 0]) == [1, 4]
    assert walk_verified_tree(parent, token, [4, 0, 0, 0, 0, 0]) == []


def test_ddtree_is_lossless_and_its_tau_is_the_tree_walk(trained):
    """Every budget gives the greedy tokens; each round's τ is train.eval.ddtree's walk of the target's
    tokens down the tree built from that round's drafter logits."""
    from train.eval.ddtree import build_ddtree, draft_topk, walk_tree

    _, drafter, prompts = trained
    target = SpecTarget.from_model(tiny_qwen3(seed=0, dtype=torch.float64), LAYER_IDS, stop_ids=[])
    proposer = DFlashProposer(drafter, target)
    for prompt in prompts[:2] + prompts[3:]:
        base = greedy_generate(target, prompt, 50)
        sequence = prompt + base.tokens
        for budget in (1, 8, 32):
            recording = Recording(proposer)
            tree_gen = ddtree_generate(target, recording, prompt, 50, budget)
            assert tree_gen.tokens == base.tokens, budget
            check_round_bookkeeping(tree_gen)
            for r, logits in zip(tree_gen.rounds, recording.logits, strict=True):
                lp, ids = draft_topk(logits[None].float(), min(budget, V))
                tree = build_ddtree(lp[0], ids[0], budget)
                y = torch.tensor((sequence[r.start + 1 : r.start + B] + [0] * B)[: B - 1])
                left = len(sequence) - 1 - r.start
                assert r.tau == 1 + walk_tree(tree, y, valid_len=min(B - 1, left))
            if budget == 1:
                assert max(tree_gen.taus) <= 2


def test_ddtree_with_one_node_per_depth_is_the_chain():
    target = SpecTarget.from_model(tiny_qwen3(seed=2), LAYER_IDS, stop_ids=[])
    prompt = random_prompts(1, lengths=(8,), seed=4)[0]
    base = greedy_generate(target, prompt, 45)
    for stub in (
        BrokenAtProposer(prompt + base.tokens, 4),
        OracleProposer(prompt + base.tokens),
        WrongProposer(prompt + base.tokens),
    ):
        chain = speculative_generate(target, stub, prompt, 45)
        tree = ddtree_generate(target, OneHot(stub), prompt, 45, budget=B - 1)
        assert tree.tokens == chain.tokens == base.tokens
        assert tree.taus == chain.taus and [r.committed for r in tree.rounds] == [r.committed for r in chain.rounds]


def test_ddtree_refuses_hybrid_targets(tmp_path):
    target = SpecTarget.from_model(tiny_qwen35(), LAYER_IDS, stop_ids=[])
    proposer = DFlashProposer(exported(tmp_path, DFlashDrafter(drafter_config())), target)
    with pytest.raises(ValueError, match="hybrid"):
        ddtree_generate(target, proposer, [1, 2, 3], 10, budget=8)


# ----------------------------------------------------------------------------------------------
# z-lab's quick start on our export: `drafter.spec_generate(...)` of the exported dflash.py


def quick_start(drafter_dir, target_model, prompt: list[int], max_new_tokens: int, stop_token_ids, **sampling):
    """z-lab's README snippet, from `AutoModel.from_pretrained` on (no device_map: CPU)."""
    from transformers import AutoModel

    draft = AutoModel.from_pretrained(str(drafter_dir), trust_remote_code=True, dtype="auto").eval()
    input_ids = torch.tensor([prompt]).to(draft.device)
    output = draft.spec_generate(
        input_ids=input_ids,
        max_new_tokens=max_new_tokens,
        temperature=sampling.pop("temperature", 0.0),
        target=target_model,
        stop_token_ids=stop_token_ids,
        **sampling,
    )
    assert output.shape[0] == 1 and output[0, : len(prompt)].tolist() == prompt
    return output[0, len(prompt) :].tolist(), draft


def test_quick_start_on_our_export_is_target_greedy_decoding(trained):
    target, drafter, prompts = trained
    drafter_dir = drafter.name_or_path
    taus = []
    for prompt in prompts:
        base = greedy_generate(target, prompt, 60)
        tokens, draft = quick_start(drafter_dir, target.model, prompt, 60, stop_token_ids=None)
        assert type(draft).__module__.endswith("dflash")  # the export's own dflash.py ran
        assert tokens == base.tokens
        assert sum(draft.last_acceptance_lengths) == len(tokens) - 1  # the first token is the prefill's
        taus += draft.last_acceptance_lengths
    assert max(taus) > 4 and min(taus) == 1, taus  # whole blocks, partial blocks and rejections were all exercised
    # transformers' own greedy generate agrees, stop token included (cut right after its first occurrence).
    prompt = prompts[0]
    stop = greedy_generate(target, prompt, 60).tokens[20]
    reference = target.model.generate(
        torch.tensor([prompt]), max_new_tokens=60, do_sample=False, eos_token_id=stop, pad_token_id=stop
    )[0, len(prompt) :].tolist()
    tokens, _ = quick_start(drafter_dir, target.model, prompt, 60, stop_token_ids=[stop])
    assert tokens == reference and tokens[-1] == stop and stop not in tokens[:-1]


def test_quick_start_with_sliding_layers_and_a_hybrid_target(tmp_path):
    """The published Qwen3.6 layout (sliding layers, a window shorter than the context) on a Gated
    DeltaNet target whose cache cannot be cut back: still the target's greedy tokens."""
    torch.manual_seed(3)
    cfg = drafter_config(num_hidden_layers=3, layer_types="sliding_then_full", sliding_window=8)
    export_drafter(DFlashDrafter(cfg).state_dict(), cfg, tmp_path / "d", dtype="float32")
    for model in (tiny_qwen3(), tiny_qwen35()):
        target = SpecTarget.from_model(model, LAYER_IDS, stop_ids=[])
        proposer = DFlashProposer(load_exported(tmp_path / "d"), target)  # train.serve.specdecode's own loop too
        for prompt in random_prompts(2, lengths=(23, 9), seed=4):
            base = greedy_generate(target, prompt, 40)
            tokens, draft = quick_start(tmp_path / "d", model, prompt, 40, stop_token_ids=[])
            assert tokens == base.tokens == speculative_generate(target, proposer, prompt, 40).tokens
            assert draft.layer_attention == [(8, True), (8, True), (None, False)]


def test_quick_start_sampling_with_top_k_one_is_greedy(trained):
    """Temperature > 0 goes through rejection sampling; with top_k = 1 both distributions are one-hot,
    so it must reproduce greedy decoding exactly (and use the sampling code to do it)."""
    target, drafter, prompts = trained
    base = greedy_generate(target, prompts[1], 40)
    torch.manual_seed(0)
    tokens, draft = quick_start(
        drafter.name_or_path, target.model, prompts[1], 40, stop_token_ids=None, temperature=0.7, top_k=1
    )
    assert tokens == base.tokens and max(draft.last_acceptance_lengths) > 1
    with pytest.raises(ValueError, match="temperature"):
        quick_start(drafter.name_or_path, target.model, prompts[1], 4, stop_token_ids=None, temperature=-1.0)
