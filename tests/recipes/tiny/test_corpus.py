"""The tiny default's corpus (`recipes.tiny.corpus`): deterministic to the byte, in any process, valid chats."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from common.hashing import tokenizer_digest
from recipes.tiny import (
    build_corpus,
    write_jsonl,
)
from tests.paths import REPO


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
        "import sys; from recipes import tiny; from common.hashing import tokenizer_digest\n"
        "train, heldout = tiny.build_corpus(seed=0)\n"
        "tiny.write_jsonl(sys.argv[1], train + heldout)\n"
        "print(tokenizer_digest(tiny.build_chat_tokenizer(tiny.record_texts(train[:300]), 600)))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "TOKENIZERS_PARALLELISM": "true"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "there.jsonl")],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env=env,
    )
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
