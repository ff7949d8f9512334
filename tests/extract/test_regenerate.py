"""Regeneration (`python -m extract.regenerate`) with the local backend: prompt sides and turns,
batched decoding equal to transformers' `generate` one prompt at a time (plain and hybrid Gated
DeltaNet targets, greedy and sampled), the stored corpus and its provenance, thinking modes, and
extraction reading a regenerated corpus with the loss on exactly the generated tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from common.config import ConfigError, load_config
from extract.corpus.reading import RawRecord
from extract.regenerate import conversation as V
from extract.regenerate import run as R
from extract.regenerate import store
from extract.regenerate.config import RegenerateConfig
from extract.regenerate.local import (
    Sampling,
    answer_seed,
    answer_stop_ids,
    generate_answers,
)
from tests.extract.regen_fixtures import chat_corpus, read_jsonl, save_target, word_model


@pytest.fixture(scope="module")
def word_target(tmp_path_factory, chat_tokenizer):
    model = word_model(chat_tokenizer)
    return save_target(tmp_path_factory.mktemp("word_target"), model, chat_tokenizer), model


def make_config(target, corpus, out, **overrides) -> RegenerateConfig:
    words = [
        f"target={target}",
        f"corpus={corpus}",
        f"out={out}",
        "max_new_tokens=10",
        "batch_size=3",
        "window_records=5",
        "dtype=float32",
        "device=cpu",
        "progress=false",
    ]
    words += [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in overrides.items()]
    return load_config(RegenerateConfig, None, words)


def renderer_for(tokenizer, thinking="disable") -> V.Renderer:
    return V.Renderer(
        tokenizer, thinking, {"enable_thinking": thinking != "disable"}, {"enable_thinking": thinking == "keep"}
    )


def greedy_reference(model, prompt_ids: list[int], max_new_tokens: int, stop: set[int]) -> tuple[list[int], str]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(stop),
            pad_token_id=0,
        )
    tokens = out[0, len(prompt_ids) :].tolist()
    cut = next((i for i, t in enumerate(tokens) if t in stop), None)
    return (tokens, "cap") if cut is None else (tokens[:cut], "stop")


# ----------------------------------------------------------------------------------------------
# Prompt sides


def turns_of(messages):
    return V.prompt_turns(messages)


def test_every_assistant_turn_is_answered_again_and_a_trailing_user_turn_too():
    sys_, u1, u2 = (
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    )
    old = {"role": "assistant", "content": "old", "reasoning_content": "r"}
    assert turns_of([sys_, u1, old, u2, old]) == ([[sys_, u1], [u2]], False)
    assert turns_of([u1, old, u2]) == ([[u1], [u2]], False)  # the last user turn has no answer yet: answered too
    assert turns_of([u1]) == ([[u1]], False)


def test_a_conversation_ends_before_the_answer_that_follows_a_tool_result():
    u1, u2 = {"role": "user", "content": "weather?"}, {"role": "user", "content": "thanks"}
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {}}}],
    }
    result = {"role": "tool", "content": "18 C"}
    assert turns_of(
        [u1, call, result, {"role": "assistant", "content": "18 C."}, u2, {"role": "assistant", "content": "ok"}]
    ) == ([[u1]], True)
    assert turns_of([u1, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]) == (
        [[u1]],
        True,
    )


def test_records_without_a_prompt_are_rejected_with_the_reason(chat_tokenizer):
    renderer = renderer_for(chat_tokenizer)
    cases = {
        V.NOT_A_CHAT: {"text": "plain"},
        "invalid_json": None,
        V.NO_USER_TURN: {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
        "missing_field": {"foo": 1},
    }
    for reason, record in cases.items():
        raw = RawRecord(7, "x.jsonl:8", record, error=("invalid_json", "bad") if record is None else None)
        conversation = V.Conversation(raw, renderer, "keep")
        assert conversation.outcome is not None and conversation.outcome.reason == reason, reason
        assert conversation.outcome.position == 7 and not conversation.wants_turn()


def test_record_ids_are_stable_and_depend_on_the_prompt_side_and_position():
    a = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old answer"}]
    b = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "another answer"}]
    assert V.record_id(3, a, None) == V.record_id(3, b, None) == "f" * 0 + V.record_id(3, a, None)
    assert V.record_id(3, a, None) != V.record_id(4, a, None)
    assert V.record_id(3, a, None) != V.record_id(3, [{"role": "user", "content": "ho"}], None)


# ----------------------------------------------------------------------------------------------
# Decoding


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["qwen3", "qwen3.5-gated-deltanet"])
def test_batched_answers_equal_generate_one_prompt_at_a_time(chat_tokenizer, hybrid, cache):
    """Left-padded prompts of different lengths, rows stopping at different steps and dropped from
    the batch (and its cache: the Gated DeltaNet states too, the static cache's rows): each equals
    `generate` alone. A hybrid model's recurrent states cannot live in a static cache: refused."""
    model = word_model(chat_tokenizer, hybrid=hybrid, stop_weight=3.0)
    stop = answer_stop_ids(model, chat_tokenizer)
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 300, (n,), generator=rng).tolist() for n in (3, 17, 8, 25, 5, 12, 30, 9)]
    if hybrid and cache == "static":
        with pytest.raises(ValueError, match="not all full attention"):
            generate_answers(model, prompts, 12, 4, stop, pad_id=0, cache=cache)
        return
    expected = [greedy_reference(model, p, 12, stop) for p in prompts]
    assert any(end == "stop" for _, end in expected) and not all(end == "stop" for _, end in expected), expected
    assert generate_answers(model, prompts, 12, 4, stop, pad_id=0, cache=cache) == expected


def test_the_static_cache_samples_the_answers_of_the_dynamic_one(chat_tokenizer, qwen3_model):
    """Sampled rows (each from its own seed) and rows dropped mid-batch: the static cache's
    logits equal the dynamic cache's closely enough that every draw is the same."""
    rng = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 300, (n,), generator=rng).tolist() for n in (4, 11, 2, 7, 19, 6)]
    sampling, seeds = Sampling(0.9, 0.95, 0), [11, 12, 13, 14, 15, 16]
    caps = [3, 9, 5, 9, 2, 9]  # rows end at different steps: the batch shrinks twice
    dynamic = generate_answers(qwen3_model, prompts, caps, 6, set(), 0, sampling, seeds, cache="dynamic")
    static = generate_answers(qwen3_model, prompts, caps, 6, set(), 0, sampling, seeds, cache="static")
    assert [len(t) for t, _ in dynamic] == caps
    assert static == dynamic


def test_sampled_answers_do_not_depend_on_the_batch_they_are_in(chat_tokenizer, qwen3_model):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15, 16, 17]]
    sampling = Sampling(temperature=1.0, top_p=0.9, top_k=50)
    stop: set[int] = set()
    seeds = [answer_seed(0, f"record-{i}", 0) for i in range(len(prompts))]
    together = generate_answers(qwen3_model, prompts, 8, 4, stop, 0, sampling, seeds)
    alone = [
        generate_answers(qwen3_model, [p], 8, 1, stop, 0, sampling, [s])[0] for p, s in zip(prompts, seeds, strict=True)
    ]
    assert together == alone
    other_seed = generate_answers(
        qwen3_model, prompts, 8, 4, stop, 0, sampling, [answer_seed(1, f"record-{i}", 0) for i in range(4)]
    )
    assert other_seed != together
    greedy = generate_answers(qwen3_model, prompts, 8, 4, stop, 0)
    assert greedy != together  # sampling at temperature 1 from a random model leaves the argmax path


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_row_uniforms_are_the_integer_hash_of_seed_and_step():
    """The draws are exact integer arithmetic (so every device draws the same): checked against the hash
    in plain Python integers, for seeds across the 63-bit range."""
    from extract.regenerate.local import row_uniforms

    seeds = [0, 1, 12345, answer_seed(0, "record-1", 0), (1 << 63) - 1]
    for step in (0, 1, 255, 70_000):
        expected = []
        for seed in seeds:
            x = _lowbias32((seed >> 32) ^ 0x9E3779B9)
            x = _lowbias32(x ^ (seed & 0xFFFFFFFF))
            expected.append((_lowbias32(x ^ step) + 0.5) / 2**32)
        assert row_uniforms(torch.tensor(seeds), step).tolist() == expected


def test_sampled_tokens_follow_the_cut_distribution():
    """Over 20,000 (seed, step) draws from fixed logits the tokens come with softmax's frequencies,
    within 4 standard errors, and never a token that top-k or top-p cut."""
    from extract.regenerate.local import sample_rows

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -8.0])
    rows = 2_000
    seeds = torch.arange(rows) * 7919 + 3
    for sampling, kept in ((Sampling(1.0, 1.0, 0), 6), (Sampling(0.7, 1.0, 3), 3), (Sampling(1.0, 0.8, 0), 3)):
        counts = torch.zeros(6)
        for step in range(10):
            tokens = sample_rows(logits.expand(rows, 6), sampling, seeds, step)
            counts += torch.bincount(tokens, minlength=6).float()
        scaled = logits / sampling.temperature
        probs = torch.zeros(6)
        probs[:kept] = scaled[:kept].softmax(-1)  # the kept tokens are the top ones here
        n = 10 * rows
        assert counts[kept:].sum() == 0, (sampling, counts)
        tolerance = 4 * (probs * (1 - probs) / n).sqrt() * n + 1
        assert ((counts - probs * n).abs() <= tolerance).all(), (sampling, counts, probs * n)


def test_the_nucleus_from_candidates_equals_the_nucleus_from_a_full_sort():
    """`cut_top_p` keeps exactly the tokens a full sort keeps: on peaked rows (the nucleus inside
    the candidates) and on flat rows (wider: those rows are sorted in full), in one batch."""
    from extract.regenerate.local import _cut_top_p_sorted, cut_top_p

    g = torch.Generator().manual_seed(0)
    peaked = torch.randn((6, 500), generator=g) * 6.0
    flat = torch.randn((4, 500), generator=g) * 0.1
    scores = torch.cat([peaked, flat])[torch.randperm(10, generator=g)]
    for top_p in (0.5, 0.9, 0.95):
        expected = _cut_top_p_sorted(scores, top_p)
        for candidates in (8, 64, 500):
            got = cut_top_p(scores, top_p, candidates)
            assert torch.equal(torch.isinf(got), torch.isinf(expected)), (top_p, candidates)
            assert torch.equal(got[~torch.isinf(got)], scores[~torch.isinf(expected)])
    kept = (~torch.isinf(cut_top_p(scores, 0.9, 8))).sum(-1)
    assert kept.min() <= 8 < kept.max()  # both kinds of row occurred


def test_top_k_one_samples_the_greedy_answer(qwen3_model):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    greedy = generate_answers(qwen3_model, prompts, 6, 2, set(), 0)
    assert generate_answers(qwen3_model, prompts, 6, 2, set(), 0, Sampling(1.3, 1.0, 1), [1, 2]) == greedy
    assert generate_answers(qwen3_model, prompts, 6, 2, set(), 0, Sampling(1.3, 1e-6, 0), [1, 2]) == greedy  # top_p ~ 0


# ----------------------------------------------------------------------------------------------
# A whole local run


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, word_target, chat_tokenizer):
    target_dir, model = word_target
    root = tmp_path_factory.mktemp("regen")
    extra = [
        {"text": "no prompt"},
        "{broken",
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"name": "w", "arguments": {}}]},
                {"role": "tool", "content": "18 C"},
                {"role": "assistant", "content": "warm"},
            ]
        },
    ]
    corpus = chat_corpus(root / "corpus.jsonl", 12, extra=extra)
    cfg = make_config(target_dir, corpus, root / "out")
    summary = R.run(cfg, model=model, tokenizer=chat_tokenizer)
    return {"cfg": cfg, "summary": summary, "out": str(root / "out"), "corpus": corpus, "model": model}


def test_local_run_stores_the_targets_greedy_answers_for_every_turn(local_run, chat_tokenizer):
    model, out = local_run["model"], local_run["out"]
    assert local_run["summary"]["complete"]
    records = read_jsonl(os.path.join(out, store.DATA_FILE))
    stop = answer_stop_ids(model, chat_tokenizer)
    renderer = renderer_for(chat_tokenizer)
    checked = 0
    for record in records:
        messages = record["messages"]
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = renderer.prompt_text(messages[:turn], None)
            prompt_ids = renderer.encode(prompt)
            expected, _ = greedy_reference(model, prompt_ids, 10, stop)
            assert renderer.encode(prompt + message["content"]) == prompt_ids + expected
            checked += 1
    counts = local_run["summary"]["corpus_counts"]
    assert checked == counts["answers"] > len(records) == counts["stored"]
    # 12 chats (3 of them two-turn), 1 tool conversation cut after its first answer; 2 bad lines.
    assert (
        counts["records"] == 15
        and counts["stored"] == 13
        and counts["rejected_by_reason"] == {"not_a_chat": 1, "invalid_json": 1}
    )
    assert counts["records_cut_at_tool_turn"] == 1 and counts["answers"] == 12 + 3 + 1
    assert not store.journal_files(out)
    # Whole-word answers survive the round trip: it checked every answer token and cut none.
    assert counts["round_trip_tokens"] == counts["answer_tokens"] and counts["round_trip_cut_tokens"] == 0
    assert "the round trip cut 0 of" in R.format_summary(local_run["summary"])


def test_rejects_and_provenance_are_written(local_run):
    out = local_run["out"]
    rejects = read_jsonl(os.path.join(out, store.REJECTS_FILE))
    assert [(r["position"], r["reason"]) for r in rejects] == [(12, "not_a_chat"), (13, "invalid_json")]
    assert rejects[1]["source"].endswith("corpus.jsonl:14")
    provenance = json.loads(Path(os.path.join(out, store.PROVENANCE_FILE)).read_text())
    assert provenance["complete"] and provenance["backend"]["kind"] == "local"
    assert provenance["sampling"] == {
        "max_new_tokens": 10,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "seed": 0,
        "at_cap": "keep",
    }
    assert provenance["thinking"]["mode"] == "disable" and provenance["chat_template_kwargs"] == {
        "enable_thinking": False
    }
    assert provenance["target"]["weights_digest"] and provenance["corpus"]["records"] == 15
    assert provenance["counts"]["stored"] == 13


def test_a_finished_corpus_is_not_made_again(local_run, chat_tokenizer):
    summary = R.run(local_run["cfg"], model=local_run["model"], tokenizer=chat_tokenizer)
    assert summary["already_complete"] and summary["counts"]["stored"] == 13
    changed = make_config(local_run["cfg"].target, local_run["corpus"], local_run["out"], max_new_tokens=11)
    with pytest.raises(ValueError, match="max_new_tokens"):
        R.run(changed, model=local_run["model"], tokenizer=chat_tokenizer)


def test_answers_at_the_cap_are_dropped_when_asked(tmp_path, word_target, chat_tokenizer):
    target_dir, model = word_target
    corpus = chat_corpus(tmp_path / "c.jsonl", 8)
    summary = R.run(
        make_config(target_dir, corpus, tmp_path / "out", max_new_tokens=2, at_cap="drop"),
        model=model,
        tokenizer=chat_tokenizer,
    )
    kept = R.run(
        make_config(target_dir, corpus, tmp_path / "kept", max_new_tokens=2), model=model, tokenizer=chat_tokenizer
    )
    dropped = summary["corpus_counts"]["rejected_by_reason"].get(V.LENGTH_CAP, 0)
    assert dropped > 0 and kept["corpus_counts"]["answers_at_cap"] >= dropped
    assert summary["corpus_counts"]["stored"] + dropped == 8 == kept["corpus_counts"]["stored"]


# ----------------------------------------------------------------------------------------------
# Thinking


def conversation_with_prompt(tokenizer, thinking: str, user: str = "the quick fox") -> V.Conversation:
    raw = RawRecord(0, "t:1", {"messages": [{"role": "user", "content": user}]})
    return V.Conversation(raw, renderer_for(tokenizer, thinking), "keep")


def test_thinking_keep_stores_reasoning_and_answer_as_rendered(chat_tokenizer):
    conversation = conversation_with_prompt(chat_tokenizer, "keep")
    prompt = conversation.prompt()[0]
    assert prompt.endswith("<|im_start|>assistant\n")  # thinking on: the target opens <think> itself
    answer = "<think>\n the fox runs\n</think>\n\n the dog sleeps"
    conversation.finish_turn(V.Generated(text=answer))
    stored = conversation.outcome.record["messages"][-1]
    assert stored == {"role": "assistant", "content": " the dog sleeps", "reasoning_content": " the fox runs"}
    rendered = chat_tokenizer.apply_chat_template(
        conversation.outcome.record["messages"], tokenize=False, enable_thinking=True
    )
    assert rendered.startswith(prompt + answer)  # what extraction renders is exactly what the target wrote
    badly_spaced = conversation_with_prompt(chat_tokenizer, "keep")
    badly_spaced.finish_turn(
        V.Generated(text="<think>\n\n\n the fox\n</think>\n\n the dog")
    )  # the template would re-space it
    assert badly_spaced.outcome.reason == V.NOT_REPRODUCIBLE or badly_spaced.outcome.stats["cut"] == 1


def test_thinking_strip_stores_the_answer_after_the_think_block(chat_tokenizer):
    conversation = conversation_with_prompt(chat_tokenizer, "strip")
    conversation.finish_turn(V.Generated(text="<think>\n the fox runs\n</think>\n\n the dog sleeps"))
    assert conversation.outcome.record["messages"][-1] == {"role": "assistant", "content": " the dog sleeps"}
    unclosed = conversation_with_prompt(chat_tokenizer, "strip")
    unclosed.finish_turn(V.Generated(text="<think>\n the fox runs and runs", at_cap=True))
    assert unclosed.outcome.reason == V.THINKING_NOT_CLOSED


def test_an_answer_the_tokenizer_would_merge_is_cut_to_what_survives(chat_tokenizer):
    conversation = conversation_with_prompt(chat_tokenizer, "disable")
    prompt, prompt_ids = conversation.prompt()
    whole = chat_tokenizer(prompt + " the quick", add_special_tokens=False)["input_ids"][len(prompt_ids) :]
    word = next(t for t in chat_tokenizer.get_vocab() if t.startswith("Ġ") and len(t) >= 5 and t[1:].isalpha())
    pieces = [chat_tokenizer.convert_tokens_to_ids(c) for c in word]  # one token per character: BPE merges them
    conversation.finish_turn(V.Generated(ids=whole + pieces))
    stored = conversation.outcome.record["messages"][-1]["content"]
    assert (
        conversation.outcome.stats["cut"] == 1
        and stored.startswith(" the quick")
        and len(stored) < len(" the quick") + len(word)
    )
    assert (
        chat_tokenizer(prompt + stored, add_special_tokens=False)["input_ids"][len(prompt_ids) :]
        == (whole + pieces)[: conversation.outcome.stats["answer_tokens"]]
    )
    stats = conversation.outcome.stats  # the tokens the round trip checked and cut away are counted
    assert stats["round_trip_tokens"] == len(whole + pieces)
    assert stats["round_trip_cut_tokens"] == len(whole + pieces) - stats["answer_tokens"] > 0


# ----------------------------------------------------------------------------------------------
# Extraction of a regenerated corpus


def test_a_regenerated_corpus_extracts_with_the_loss_on_exactly_the_generated_tokens(
    tmp_path, local_run, word_target, chat_tokenizer
):
    from extract import pipeline
    from extract.config import ExtractConfig
    from extract.ranks import Ranks
    from shards import ShardDataset
    from target.load import load_target

    target_dir, model = word_target
    target = load_target(target_dir, dtype="float32")
    words = [
        f"target={target_dir}",
        f"corpus={local_run['out']}",
        f"out_dir={tmp_path / 'shards'}",
        "layer_ids=[0]",
        "topk=4",
        "max_len=256",
        "tokens_per_batch=512",
        "min_loss_tokens=1",
        "dtype=float32",
        "device=cpu",
        "progress=false",
        "writer_threads=1",
    ]
    summary = pipeline.run(load_config(ExtractConfig, None, words), target=target, ranks=Ranks())[None]
    assert summary["samples"] == 13 and not summary["rejects"]
    ds = ShardDataset(str(tmp_path / "shards"))
    provenance = ds.provenance
    assert provenance.tokenizer.chat_template_kwargs == {"enable_thinking": False}
    regeneration = provenance.corpus.regeneration
    assert regeneration["sampling"]["max_new_tokens"] == 10
    assert regeneration["backend"]["kind"] == "local" and "config" not in regeneration

    stop = answer_stop_ids(model, chat_tokenizer)
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    renderer = renderer_for(chat_tokenizer)
    expected_loss = {}
    for record in read_jsonl(os.path.join(local_run["out"], store.DATA_FILE)):
        messages, tokens = record["messages"], []
        for turn, message in enumerate(messages):
            if message["role"] == "assistant":
                answer, _ = greedy_reference(
                    model, renderer.encode(renderer.prompt_text(messages[:turn], None)), 10, stop
                )
                tokens += answer + [im_end]  # the end-of-turn token closes every turn, also one cut at the cap
        expected_loss[tuple(tokens)] = True
    got = {tuple(int(t) for t in s.input_ids[s.loss_mask.astype(bool)]) for s in ds}
    assert got == set(expected_loss)


def test_extraction_refuses_other_template_variables_than_the_regeneration_used(tmp_path, local_run, word_target):
    from extract.checks import check_inputs
    from extract.config import ExtractConfig

    words = [
        f"target={word_target[0]}",
        f"corpus={local_run['out']}",
        f"out_dir={tmp_path / 'x'}",
        "layer_ids=[0]",
        "topk=4",
        "chat_template_kwargs={enable_thinking = true}",
    ]
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        check_inputs(load_config(ExtractConfig, None, words))


# ----------------------------------------------------------------------------------------------
# Config


def test_config_errors_name_the_key(tmp_path):
    base = ["target=/x", "corpus=/y", f"out={tmp_path}"]
    for words, key in [
        (["backend=server"], "urls"),
        (['urls=["ftp://x"]', "backend=server"], "urls[0]"),
        (["top_p=0.5"], "top_p"),
        (["chat_template_kwargs={enable_thinking = true}"], "enable_thinking"),
        (["thinking=maybe"], "thinking"),
        (["batch_size=100", "window_records=10"], "window_records"),
    ]:
        with pytest.raises(ConfigError, match=key.replace("[", r"\[")):
            load_config(RegenerateConfig, None, base + words)


def test_thinking_choices_set_generation_and_extraction_template_variables(tmp_path):
    base = ["target=/x", "corpus=/y", f"out={tmp_path}"]
    expect = {"disable": (False, False), "keep": (True, True), "strip": (True, False)}
    for mode, (generation, extraction) in expect.items():
        cfg = load_config(RegenerateConfig, None, base + [f"thinking={mode}", "chat_template_kwargs={x = 1}"])
        assert cfg.generation_template_kwargs() == {"x": 1, "enable_thinking": generation}
        assert cfg.extraction_template_kwargs() == {"x": 1, "enable_thinking": extraction}


def test_the_shipped_configs_regenerate_tables_are_valid():
    from tests.paths import REPO

    for name in ("tiny.toml", "qwen3.6-27b.toml"):
        cfg = load_config(RegenerateConfig, REPO / "configs" / name, section="regenerate")
        assert cfg.target and cfg.max_new_tokens >= 256
    assert (
        load_config(RegenerateConfig, REPO / "configs" / "qwen3.6-27b.toml", section="regenerate").backend == "server"
    )


def test_help_lists_every_key():
    from tests.extract.regen_fixtures import regenerate_cli

    done = regenerate_cli("--help")
    assert done.returncode == 0
    for key in ("backend", "urls", "max_in_flight", "thinking", "at_cap", "window_records", "max_retries"):
        assert f"\n{key} = " in "\n" + done.stdout, key


def test_ranks_answer_their_shares_and_rank_zero_commits_the_whole_corpus(
    tmp_path, local_run, word_target, chat_tokenizer, monkeypatch
):
    """Two ranks (RANK / WORLD_SIZE as torchrun sets them, run one after the other here): each answers
    the records with position % 2 == rank into its own journal; rank 0 commits when both are done,
    and the corpus equals the one-process run's."""
    target_dir, model = word_target
    cfg = make_config(target_dir, local_run["corpus"], tmp_path / "out")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("RANK", "0")
    early = R.run(cfg, model=model, tokenizer=chat_tokenizer)  # rank 0 first: rank 1's share is missing
    assert not early["complete"] and early["finished_records"] == early["counts"]["records_owned"] == 8
    monkeypatch.setenv("RANK", "1")
    rank1 = R.run(cfg, model=model, tokenizer=chat_tokenizer)
    assert rank1["counts"]["records_owned"] == 7 and not rank1["complete"]
    monkeypatch.setenv("RANK", "0")
    final = R.run(cfg, model=model, tokenizer=chat_tokenizer)
    assert final["complete"] and final["counts"]["already_done"] == 8
    for name in (store.DATA_FILE, store.REJECTS_FILE):
        assert (tmp_path / "out" / name).read_bytes() == Path(os.path.join(local_run["out"], name)).read_bytes()
    assert json.loads((tmp_path / "out" / store.PROVENANCE_FILE).read_text())["backend"]["world_sizes"] == [2]
