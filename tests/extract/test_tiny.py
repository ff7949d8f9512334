"""The tiny default: corpus, chat tokenizer, target builder and the cached `python -m extract.tiny` build."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.hashing import tokenizer_digest
from extract import tiny
from extract.tiny import (
    EOS_TOKEN,
    IM_END,
    IM_START,
    MASK_TOKEN,
    TinyConfig,
    build_chat_tokenizer,
    build_corpus,
    build_tiny,
    build_tiny_target,
    record_texts,
    tap_layer_ids,
    write_jsonl,
)

from tests.common.test_repeat import first_loop_reference

REPO = Path(__file__).resolve().parents[2]
# Sizes that make a whole build take a few seconds.
TINY_MODEL = dict(vocab_size=400, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2,
                  num_kv_heads=1, head_dim=16, n_taps=2, steps=2, batch_tokens=2048, warmup_steps=1, threads=1)


@pytest.fixture(autouse=True)
def _restore_omp_env(monkeypatch):
    # tiny.main sets OMP_WAIT_POLICY for the torch it is about to load; undo that after each test.
    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(seed=0)


@pytest.fixture(scope="module")
def small_tokenizer(corpus):
    train, _ = corpus
    return build_chat_tokenizer(record_texts(train[:300]), 600)


# ----------------------------------------------------------------------------------------------
# Corpus


def test_corpus_is_deterministic_to_the_byte(tmp_path, corpus):
    train, heldout = corpus
    write_jsonl(tmp_path / "a.jsonl", train + heldout)
    again_train, again_heldout = build_corpus(seed=0)
    write_jsonl(tmp_path / "b.jsonl", again_train + again_heldout)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    other_train, _ = build_corpus(seed=1)
    assert other_train != train


def test_corpus_and_tokenizer_are_the_same_in_another_process(tmp_path, corpus, small_tokenizer):
    train, heldout = corpus
    write_jsonl(tmp_path / "here.jsonl", train + heldout)
    code = (
        "import sys; from extract import tiny; from common.hashing import tokenizer_digest\n"
        "train, heldout = tiny.build_corpus(seed=0)\n"
        "tiny.write_jsonl(sys.argv[1], train + heldout)\n"
        "print(tokenizer_digest(tiny.build_chat_tokenizer(tiny.record_texts(train[:300]), 600)))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "TOKENIZERS_PARALLELISM": "true"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "there.jsonl")], capture_output=True, text=True,
                         check=True, cwd=REPO, env=env)
    assert (tmp_path / "there.jsonl").read_bytes() == (tmp_path / "here.jsonl").read_bytes()
    assert out.stdout.strip() == tokenizer_digest(small_tokenizer)


def test_corpus_records_are_valid_chats_with_short_and_long_answers(corpus):
    train, heldout = corpus
    assert len(heldout) >= 20 and len(train) > 10 * len(heldout)
    keys = {json.dumps(r, sort_keys=True) for r in train}
    assert not any(json.dumps(r, sort_keys=True) in keys for r in heldout)
    answers, multi_turn, text_records = [], 0, 0
    for record in train + heldout:
        if "text" in record:
            assert set(record) == {"text"} and record["text"].strip()
            text_records += 1
            continue
        assert set(record) == {"messages"}
        messages = record["messages"]
        assert len(messages) % 2 == 0 and len(messages) >= 2
        for i, message in enumerate(messages):
            assert message["role"] == ("user" if i % 2 == 0 else "assistant")
            assert isinstance(message["content"], str) and message["content"].strip()
        answers += [m["content"] for m in messages[1::2]]
        multi_turn += len(messages) > 2
    lengths = sorted(len(a) for a in answers)
    assert lengths[0] < 100 and lengths[-1] > 4000
    assert sum(n < 500 for n in lengths) > 100 and sum(n > 3000 for n in lengths) > 20
    assert multi_turn > 50 and 0 < text_records < 20
    assert len({r["messages"][0]["content"] for r in train if "messages" in r}) > 0.9 * len(train) - text_records


# ----------------------------------------------------------------------------------------------
# Tokenizer and chat template


def test_tokenizer_round_trips_text(small_tokenizer):
    for text in ["def f(x):\n    return x ** 2  # square\n", "Héllo wörld — ünïcode ✓ 日本語 🙂", "  two  spaces\t\ttabs\n\n\n"]:
        ids = small_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert small_tokenizer.decode(ids) == text


def test_tokenizer_special_tokens_and_mask(small_tokenizer):
    tok = small_tokenizer
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == EOS_TOKEN and tok.mask_token == MASK_TOKEN
    assert tok.pad_token_id == tok.eos_token_id
    n = len(tok)
    assert n <= 600
    ids = {t: tok.convert_tokens_to_ids(t) for t in [EOS_TOKEN, IM_START, IM_END, MASK_TOKEN, "<think>", "</think>"]}
    assert sorted(ids.values()) == list(range(n - 6, n))  # added last, as in Qwen
    assert tok.mask_token_id == ids[MASK_TOKEN]
    for token, token_id in ids.items():
        assert tok(f"a{token}b", add_special_tokens=False)["input_ids"].count(token_id) == 1
    assert tok("plain text", add_special_tokens=True)["input_ids"] == tok("plain text", add_special_tokens=False)["input_ids"]


def test_tokenizer_training_is_deterministic(corpus, small_tokenizer):
    train, _ = corpus
    again = build_chat_tokenizer(record_texts(train[:300]), 600)
    assert tokenizer_digest(again) == tokenizer_digest(small_tokenizer)
    with pytest.raises(ValueError):
        build_chat_tokenizer(["some text"], 100)


CONVERSATION = [
    {"role": "user", "content": "What is a tuple?"},
    {"role": "assistant", "content": "An immutable sequence."},
    {"role": "user", "content": "Go on."},
    {"role": "assistant", "content": "It can be hashed."},
]


def test_chat_template_renders_qwen3_style(small_tokenizer):
    tok = small_tokenizer
    full = tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert full == (
        "<|im_start|>user\nWhat is a tuple?<|im_end|>\n"
        "<|im_start|>assistant\nAn immutable sequence.<|im_end|>\n"
        "<|im_start|>user\nGo on.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nIt can be hashed.<|im_end|>\n"
    )
    prompt = CONVERSATION[:3]
    thinking = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    plain = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert thinking.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert plain == thinking + "<think>\n\n</think>\n\n"
    # Non-thinking generation prompt + answer = the rendered training sample, token for token.
    assert full.startswith(plain)
    as_ids = tok(full, add_special_tokens=False)["input_ids"]
    assert as_ids[: len(tok(plain, add_special_tokens=False)["input_ids"])] == tok(plain, add_special_tokens=False)["input_ids"]
    with_reasoning = [CONVERSATION[0], {**CONVERSATION[1], "reasoning_content": "\nShort.\n"}]
    assert "<think>\nShort.\n</think>\n\nAn immutable" in tok.apply_chat_template(with_reasoning, tokenize=False)


def test_tokenizer_survives_save_and_load(tmp_path, small_tokenizer):
    from transformers import AutoTokenizer

    small_tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer_digest(loaded) == tokenizer_digest(small_tokenizer)
    assert (loaded.mask_token_id, loaded.eos_token_id, loaded.pad_token_id) == (
        small_tokenizer.mask_token_id, small_tokenizer.eos_token_id, small_tokenizer.pad_token_id)
    for kwargs in [{}, {"add_generation_prompt": True, "enable_thinking": False}]:
        messages = CONVERSATION if not kwargs else CONVERSATION[:3]
        text = loaded.apply_chat_template(messages, tokenize=False, **kwargs)
        assert text == small_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        assert loaded(text)["input_ids"] == small_tokenizer(text)["input_ids"]


def test_importing_the_module_is_cheap():
    code = "import sys, extract.tiny; print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------------------------------------
# Target


@pytest.mark.parametrize("layers, taps", [(64, 4), (36, 5), (8, 4), (6, 3), (4, 3), (3, 2), (2, 1)])
def test_tap_layer_ids_are_spread_and_never_the_last_layer(layers, taps):
    ids = tap_layer_ids(layers, taps)
    assert len(ids) == taps and ids == sorted(set(ids))
    assert ids[0] >= 0 and ids[-1] <= layers - 2
    if layers >= taps + 3:
        assert ids[0] == 1
    assert tap_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # the published Qwen3-8B drafter's taps


def test_build_tiny_target_writes_a_loadable_hf_directory(tmp_path, corpus):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train, heldout = corpus
    cfg = TinyConfig(**TINY_MODEL)
    report = build_tiny_target(tmp_path, train[:60], heldout[:10], cfg, progress=False)
    for name in ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tiny_report.json"]:
        assert (tmp_path / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert model.config.model_type == "qwen3" and model.config.num_hidden_layers == 3
    assert model.config.vocab_size == len(tok) and tok.mask_token == MASK_TOKEN
    assert model.generation_config.eos_token_id == [tok.convert_tokens_to_ids(IM_END), tok.eos_token_id]
    ids = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    saved = json.loads((tmp_path / "tiny_report.json").read_text())
    assert saved == report
    assert 0.0 <= report["heldout_next_token_accuracy"] <= 1.0 and report["heldout_positions"] > 0
    assert 0.0 < report["most_frequent_token_accuracy"] < 1.0
    assert report["tap_layer_ids"] == [0, 1] and report["mask_token_id"] == tok.mask_token_id
    assert report["corpus"]["train"]["records"] == 60

    build_tiny_target(tmp_path / "again", train[:60], heldout[:10], cfg, progress=False)
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / name).read_bytes(), name


def round_trip_length(tok, prompt: str, prompt_ids: list[int], answer: list[int]) -> int:
    """The kept length of an answer to "Say it." as the regeneration decides it (`fitted_length`)."""
    from extract.regenerate.conversation import Renderer, fitted_length

    no_thinking = {"enable_thinking": False}
    renderer = Renderer(tok, "disable", no_thinking, no_thinking)
    return fitted_length(renderer, [{"role": "user", "content": "Say it."}], None, prompt, prompt_ids, answer)


def test_an_answer_bpe_would_merge_is_cut_to_what_tokenizes_back(small_tokenizer):
    tok = small_tokenizer
    prompt = tiny.answer_prompt(tok, [{"role": "user", "content": "Say it."}])
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    word = next(t for t, i in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]) if len(t) >= 4 and t.isalpha())
    pieces = [tok.convert_tokens_to_ids(c) for c in word]  # one token per letter: BPE would merge them
    whole = tok(prompt + "ok", add_special_tokens=False)["input_ids"][len(prompt_ids):]
    assert round_trip_length(tok, prompt, prompt_ids, whole) == len(whole)
    kept = round_trip_length(tok, prompt, prompt_ids, whole + pieces)
    assert len(whole) <= kept < len(whole) + len(pieces)
    text = tok.decode((whole + pieces)[:kept], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert tok(prompt + text, add_special_tokens=False)["input_ids"] == prompt_ids + (whole + pieces)[:kept]


def test_batched_greedy_decoding_equals_generate_one_prompt_at_a_time(qwen3_model, monkeypatch):
    """Left-padded prompts of different lengths, rows that stop at different steps and are dropped
    from the batch: every row's tokens and stop flag equal transformers' greedy `generate` alone."""
    from transformers import DynamicCache

    model, new_tokens = qwen3_model, 10
    rng = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(10, vocab, (n,), generator=rng).tolist() for n in (3, 17, 8, 25, 5, 12, 30, 9, 14, 4, 21, 7)]

    def generate_alone(prompt, stop):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                                 eos_token_id=sorted(stop) or None, pad_token_id=0)
        tokens = out[0, len(prompt):].tolist()
        cut = next((i for i, t in enumerate(tokens) if t in stop), None)
        return (tokens, "cap") if cut is None else (tokens[:cut], "stop")

    # Stop tokens chosen from the free-running answers so that rows stop at different steps and some never.
    free = [generate_alone(p, set())[0] for p in prompts]
    # (Batches are formed by prompt length: two rows of each batch of 6 get a stop token.)
    stop = {free[0][2], free[9][4], free[5][3], free[1][6]}
    expected = [generate_alone(p, stop) for p in prompts]
    stop_steps = {len(tokens) for tokens, end in expected if end == "stop"}
    assert len(stop_steps) >= 2 and not all(end == "stop" for _, end in expected), (stop_steps, expected)

    drops = []
    real_select = DynamicCache.batch_select_indices
    monkeypatch.setattr(DynamicCache, "batch_select_indices", lambda self, keep: (drops.append(len(keep)), real_select(self, keep))[1])
    got = tiny.greedy_answers(model, prompts, new_tokens, batch_size=6, stop_ids=stop, pad_id=0)
    assert got == expected
    assert drops, "no finished row was ever dropped from a batch: the test does not exercise that path"


def test_batched_greedy_decoding_cut_where_it_loops_equals_generate_cut_there(qwen3_model):
    """Rows of a random model loop at different steps: each row stops right after its first
    repetition (as `first_loop_reference` finds it in generate's free-running answer), or at a stop
    token before it, or at the cap; rows are dropped from the batch as they finish."""
    model, new_tokens, min_repeat = qwen3_model, 40, 6
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, model.config.vocab_size, (n,), generator=rng).tolist() for n in (3, 17, 8, 25, 5, 12, 30, 9, 14, 4, 21, 7)]
    free = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
        free.append(out[0, len(prompt):].tolist())
    stop = {free[1][20]}  # one stop token, so that a stop before a loop is exercised too
    expected = []
    for tokens in free:
        cut = next((i for i, t in enumerate(tokens) if t in stop), None)
        loop = first_loop_reference(tokens[:cut], min_repeat)
        expected.append((tokens[:loop], "repeat") if loop else (tokens[:cut], "stop") if cut is not None else (tokens, "cap"))
    ends = [end for _, end in expected]
    assert {"repeat", "stop", "cap"} <= set(ends) and len({len(t) for t, end in expected if end == "repeat"}) >= 3, expected

    got = tiny.greedy_answers(model, prompts, new_tokens, batch_size=6, stop_ids=stop, pad_id=0, stop_repeat=min_repeat)
    assert got == expected


def test_round_trip_keeps_the_longest_prefix_that_survives(small_tokenizer):
    tok = small_tokenizer
    prompt = tiny.answer_prompt(tok, [{"role": "user", "content": "Say it."}])
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]

    def survives(answer, n):
        text = tok.decode(answer[:n], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return tok(prompt + text, add_special_tokens=False)["input_ids"] == prompt_ids + answer[:n]

    rng = random.Random(0)
    words = [w for w in tok.get_vocab() if len(w) >= 3]
    for _ in range(40):
        text = "".join(rng.choice(words) for _ in range(4)).replace("Ġ", " ").replace("Ċ", "\n")
        whole = tok(prompt + text, add_special_tokens=False)["input_ids"][len(prompt_ids):]
        # Split one token of it into its characters: BPE would merge them back.
        at = rng.randrange(len(whole))
        piece = tok.convert_ids_to_tokens(whole[at])
        chars = [tok.convert_tokens_to_ids(c) for c in piece]
        if len(chars) < 2 or tok.unk_token_id in chars:
            continue
        answer = whole[:at] + chars + whole[at + 1:]
        longest = max((n for n in range(len(answer) + 1) if survives(answer, n)), default=0)
        assert round_trip_length(tok, prompt, prompt_ids, answer) == longest, (text, at)


def test_regenerated_answers_are_the_targets_greedy_decoding(tmp_path, corpus):
    """Against transformers' own `generate` (greedy), one prompt at a time; the batched, left-padded
    decoding must not change a token, and the saved text must tokenize back to the generated ids."""
    from common.target import load_target

    train, heldout = corpus
    # Trained a little, so its greedy answers round-trip through the tokenizer (a near-random model's do not).
    build_tiny_target(tmp_path, train[:200], heldout[:10], TinyConfig(**{**TINY_MODEL, "steps": 60}), progress=False)
    target = load_target(str(tmp_path), dtype="float32")
    model, tok = target.model, target.tokenizer
    multi_turn = {"messages": [{"role": "user", "content": "Describe `os.path`."}, {"role": "assistant", "content": "x"},
                               {"role": "user", "content": "And `os.sep`?"}, {"role": "assistant", "content": "y"}]}
    records = heldout[:7] + [multi_turn, {"text": "plain text has no user turn"}]
    out, stats = tiny.regenerate_records(model, tok, records, max_new_tokens=12, batch_size=3)
    alone, _ = tiny.regenerate_records(model, tok, records, max_new_tokens=12, batch_size=1)
    assert out == alone
    assert stats["skipped_no_user_turn"] == 1
    assert stats["records_out"] + stats["dropped_empty_answer"] + stats["skipped_no_user_turn"] == len(records) == stats["records_in"]
    assert len(out) == stats["records_out"] >= 4

    stop = sorted(tiny.answer_stop_ids(model, tok))
    checked = 0
    for record in out:
        messages = record["messages"]
        assert [m["role"] for m in messages[::2]] == ["user"] * (len(messages) // 2)
        for turn in range(1, len(messages), 2):
            prompt = tiny.answer_prompt(tok, messages[:turn])
            prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
            answer_ids = tok(prompt + messages[turn]["content"], add_special_tokens=False)["input_ids"]
            assert answer_ids[: len(prompt_ids)] == prompt_ids and len(answer_ids) > len(prompt_ids)
            with torch.no_grad():
                generated = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                           do_sample=False, max_new_tokens=12, eos_token_id=stop, pad_token_id=tok.pad_token_id)
            reference = generated[0, len(prompt_ids):].tolist()
            reference = reference[: next((i for i, t in enumerate(reference) if t in stop), len(reference))]
            new = answer_ids[len(prompt_ids):]
            assert new == reference[: len(new)], (prompt, new, reference)
            checked += 1
    assert checked == stats["answers"] and checked >= len(out)


# ----------------------------------------------------------------------------------------------
# Cached build


def fail_if_called(*args, **kwargs):
    raise AssertionError("the target was rebuilt")


def test_build_is_cached_and_a_changed_recipe_rebuilds(tmp_path, monkeypatch, capsys):
    cfg = TinyConfig(out_dir=str(tmp_path / "tiny"), **TINY_MODEL)
    out = build_tiny(cfg, progress=False)
    for name in tiny.REQUIRED_FILES:
        assert (out / name).is_file(), name
    assert json.loads((out / "build.json").read_text())["recipe_digest"] == tiny.recipe_digest(cfg)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []

    monkeypatch.setattr(tiny, "build_tiny_target", fail_if_called)
    assert tiny.main([f"out_dir={cfg.out_dir}"] + [f"{k}={v}" for k, v in TINY_MODEL.items()] + ["threads=2"]) == 0
    assert "nothing to do" in capsys.readouterr().out

    changed = TinyConfig(out_dir=cfg.out_dir, **{**TINY_MODEL, "steps": 3})
    assert tiny.recipe_digest(changed) != tiny.recipe_digest(cfg)
    with pytest.raises(AssertionError, match="rebuilt"):
        build_tiny(changed, progress=False)
    assert tiny.is_built(out, tiny.recipe_digest(cfg))  # the failed rebuild left the old build intact
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def fake_target(out_dir, train, heldout, cfg, progress=True):
    """Stands in for the (slow) real target build: writes the files the cache checks."""
    out = Path(out_dir)
    out.mkdir(parents=True)
    for name in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]:
        (out / name).write_text("{}")
    report = {"heldout_next_token_accuracy": 0.5, "most_frequent_token_accuracy": 0.1, "train_probe_next_token_accuracy": 0.6,
              "heldout_answer_next_token_accuracy": 0.4, "most_frequent_token_answer_accuracy": 0.1,
              "num_layers": 3, "hidden_size": 32, "parameters": 1, "vocab_size": 400, "mask_token": MASK_TOKEN,
              "mask_token_id": 399, "tap_layer_ids": [0, 1],
              "corpus": {"train": {"records": len(train), "tokens": 1}, "heldout": {"records": len(heldout), "tokens": 1}}}
    (out / "tiny_report.json").write_text(json.dumps(report))
    return {**report, "train_seconds": 0.0, "device": "cpu"}


def fake_regeneration(target_dir, train, heldout, cfg=None, progress=True):
    """Stands in for the greedy re-answering, which needs a real target."""
    return train, heldout, {}


def test_a_partial_build_is_detected_and_redone(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny, "build_tiny_target", fake_target)
    monkeypatch.setattr(tiny, "regenerate_corpus", fake_regeneration)
    cfg = TinyConfig(out_dir=str(tmp_path / "tiny"), **TINY_MODEL)
    out = build_tiny(cfg, progress=False)
    digest = tiny.recipe_digest(cfg)
    assert tiny.is_built(out, digest)

    (out / "target" / "model.safetensors").unlink()  # damaged after the fact
    leftover = tmp_path / "tiny.deadbeef.tmp"  # what a build killed midway leaves behind
    (leftover / "target").mkdir(parents=True)
    assert not tiny.is_built(out, digest)
    build_tiny(cfg, progress=False)
    assert tiny.is_built(out, digest) and not leftover.exists()


def test_a_build_that_dies_midway_leaves_nothing_that_looks_finished(tmp_path, monkeypatch):
    def dies(out_dir, *args, **kwargs):
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "build_tiny_target", dies)
    cfg = TinyConfig(out_dir=str(tmp_path / "tiny"), **TINY_MODEL)
    with pytest.raises(KeyboardInterrupt):
        build_tiny(cfg, progress=False)
    assert not (tmp_path / "tiny").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_the_recipe_keys_on_the_device_type_and_the_precision_it_resolves_to(monkeypatch):
    cfg = TinyConfig(**TINY_MODEL)
    seen = {}
    for device in ("cpu", "cuda"):
        monkeypatch.setattr(tiny, "resolve_build_device", lambda choice, device=device: device)
        seen[device] = (tiny.recipe(cfg)["params"], tiny.recipe_digest(cfg))
        # how many threads build it changes the rounding at most, not the recipe
        assert tiny.recipe_digest(TinyConfig(**{**TINY_MODEL, "threads": 2})) == seen[device][1]
    assert seen["cpu"][0]["device"] == "cpu" and seen["cuda"][0]["device"] == "cuda"
    assert seen["cuda"][0]["precision"] == "bf16"  # auto on a GPU
    assert seen["cpu"][1] != seen["cuda"][1]  # a CPU-built cache is not taken for a GPU build


def test_build_compute_sets_and_restores_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    before = torch.get_num_threads()
    with tiny.build_compute(TinyConfig(device="cpu")) as compute:
        assert compute.device.type == "cpu" and torch.get_num_threads() == 3
    with tiny.build_compute(TinyConfig(device="cpu", threads=1)):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_deterministic_mode_reports_ops_without_a_deterministic_kernel_and_is_undone():
    """What the GPU build runs under, checked on the CPU: `put_` has no deterministic kernel on any device."""
    noticed = []
    with tiny.deterministic_cuda(noticed):
        assert torch.are_deterministic_algorithms_enabled()
        torch.zeros(3).put_(torch.tensor([0]), torch.tensor([1.0]))
        torch.zeros(3).put_(torch.tensor([1]), torch.tensor([1.0]))  # the same op again: reported once
    assert len(noticed) == 1 and "put_" in noticed[0]
    assert not torch.are_deterministic_algorithms_enabled()


def test_next_token_loss_equals_the_models_own_loss(qwen3_model):
    ids = torch.randint(10, qwen3_model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        out = qwen3_model(input_ids=ids, attention_mask=mask, labels=labels)
    assert torch.allclose(tiny.next_token_loss(out.logits, labels), out.loss, rtol=1e-5)


def test_config_checks_name_the_key():
    from common.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="num_kv_heads"):
        load_config(TinyConfig, None, ["num_heads=4", "num_kv_heads=3"])
    with pytest.raises(ConfigError, match="n_taps"):
        load_config(TinyConfig, None, ["num_layers=4", "n_taps=4"])
    assert tiny.main(["no_such_key=1"]) == 2


def test_assistant_masks_mark_exactly_the_answers(corpus, small_tokenizer):
    train, _ = corpus
    records = [r for r in train if len(r.get("messages", [])) > 2][:3] + [r for r in train if "text" in r][:1]
    seqs = tiny.encode_records(small_tokenizer, records, 4096)
    masks = tiny.assistant_masks(small_tokenizer, records, 4096)
    for record, ids, mask in zip(records, seqs, masks):
        assert len(mask) == len(ids)
        answers = "".join(m["content"] + IM_END for m in record.get("messages", []) if m["role"] == "assistant")
        assert small_tokenizer.decode([t for t, keep in zip(ids, mask) if keep]) == answers


def test_length_batches_cover_every_sequence_once_within_the_budget():
    import random

    lengths = [random.Random(i).randint(1, 600) for i in range(300)] + [900]
    batches = tiny.length_batches(lengths, 1024, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or len(batch) * tiny.padded_width(max(lengths[i] for i in batch)) <= 1024
    assert batches == tiny.length_batches(lengths, 1024, random.Random(0))
    assert batches != tiny.length_batches(lengths, 1024, random.Random(1))
