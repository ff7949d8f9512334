"""The tiny default's chat tokenizer and template (`recipes.tiny.chat`)."""

from __future__ import annotations

import pytest

from common.hashing import tokenizer_digest
from recipes.tiny import (
    EOS_TOKEN,
    IM_END,
    IM_START,
    MASK_TOKEN,
    build_chat_tokenizer,
    record_texts,
)


def test_tokenizer_round_trips_text(small_tokenizer):
    for text in [
        "def f(x):\n    return x ** 2  # square\n",
        "Héllo wörld — ünïcode ✓ 日本語 🙂",
        "  two  spaces\t\ttabs\n\n\n",
    ]:
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
    assert (
        tok("plain text", add_special_tokens=True)["input_ids"]
        == tok("plain text", add_special_tokens=False)["input_ids"]
    )


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
    assert (
        as_ids[: len(tok(plain, add_special_tokens=False)["input_ids"])]
        == tok(plain, add_special_tokens=False)["input_ids"]
    )
    with_reasoning = [CONVERSATION[0], {**CONVERSATION[1], "reasoning_content": "\nShort.\n"}]
    assert "<think>\nShort.\n</think>\n\nAn immutable" in tok.apply_chat_template(with_reasoning, tokenize=False)


def test_tokenizer_survives_save_and_load(tmp_path, small_tokenizer):
    from transformers import AutoTokenizer

    small_tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer_digest(loaded) == tokenizer_digest(small_tokenizer)
    assert (loaded.mask_token_id, loaded.eos_token_id, loaded.pad_token_id) == (
        small_tokenizer.mask_token_id,
        small_tokenizer.eos_token_id,
        small_tokenizer.pad_token_id,
    )
    for kwargs in [{}, {"add_generation_prompt": True, "enable_thinking": False}]:
        messages = CONVERSATION if not kwargs else CONVERSATION[:3]
        text = loaded.apply_chat_template(messages, tokenize=False, **kwargs)
        assert text == small_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        assert loaded(text)["input_ids"] == small_tokenizer(text)["input_ids"]
