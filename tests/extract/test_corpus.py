"""Corpus -> samples: the loss mask is exactly the assistant tokens (+ the end-of-turn token),
compared with transformers' own `{% generation %}` assistant mask; every kind of bad record is one
counted reject with its position; the length policy; every input format."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from extract import corpus as C
from recipes.tiny import CHAT_TEMPLATE, IM_END
from tests.extract.conftest import write_lines


def build(tokenizer, records, max_len=512, policy="truncate", min_loss=1, **kwargs):
    builder = C.SampleBuilder(tokenizer, C.SamplePolicy(max_len, policy, min_loss, kwargs, vocab_size=len(tokenizer)))
    return builder.build([C.RawRecord(i, f"test:{i + 1}", r) for i, r in enumerate(records)])


MULTI_TURN = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "assistant"},  # a content equal to a role name must not confuse the search
        {"role": "assistant", "content": "assistant"},
        {"role": "user", "content": "the fox?"},
        {"role": "assistant", "content": "the quick brown fox jumps", "reasoning_content": "think about the fox"},
    ]
}

# The tiny template with transformers' generation markers around each assistant answer and its <|im_end|>.
GENERATION_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{- '\\n</think>\\n\\n' + message['content'] + '<|im_end|>\\n' -}}",
    "{{- '\\n</think>\\n\\n' -}}{% generation %}{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}{{- "
    "'\\n' -}}",
).replace(
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}",
    "{%- if message['role'] == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}{% generation %}{{- "
    "message['content'] + '<|im_end|>' -}}"
    "{% endgeneration %}{{- '\\n' -}}{%- else -%}{{- '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' -}}{%- endif -%}",
)


def test_loss_mask_is_exactly_the_assistant_answers_and_their_end_of_turn(chat_tokenizer):
    tok = chat_tokenizer
    [sample] = build(tok, [MULTI_TURN])
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.astype(bool)
    # Loss tokens spell the two answers (and the rendered reasoning), each closed by <|im_end|>.
    assert (
        tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
        == f"assistant{IM_END}think about the foxthe quick brown fox jumps{IM_END}"
    )
    im_end = tok.convert_tokens_to_ids(IM_END)
    ends = [t for t, i in enumerate(ids) if i == im_end]
    assert [bool(mask[t]) for t in ends] == [
        False,
        False,
        True,
        False,
        True,
    ]  # system, user, assistant, user, assistant
    # No header, no empty-think tags, no newline after <|im_end|>, nothing from system or user turns.
    for t, i in enumerate(ids):
        if tok.convert_ids_to_tokens(i) in ("<|im_start|>", "<think>", "</think>"):
            assert not mask[t]
    assert not mask[: ends[1] + 1].any()


def test_loss_mask_matches_transformers_generation_markers(chat_tokenizer):
    """Same rendered text, two ways to the mask: our span search (template without markers) and
    transformers' `return_assistant_tokens_mask` (template with `{% generation %}`)."""
    tok = chat_tokenizer
    assert GENERATION_TEMPLATE.count("{% generation %}") == 2
    conversations = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the fox runs"}]},
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b c"},
                {"role": "user", "content": "d"},
                {"role": "assistant", "content": "the end"},
            ]
        },
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "user"},
                {"role": "assistant", "content": "user"},
            ]
        },
    ]
    for record in conversations:
        [sample] = build(tok, [record])
        reference = tok.apply_chat_template(
            record["messages"],
            chat_template=GENERATION_TEMPLATE,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        assert reference["input_ids"] == sample.input_ids.tolist()
        assert reference["assistant_masks"] == sample.loss_mask.tolist(), record


def test_template_that_rewrites_content_falls_back_to_search(chat_tokenizer):
    tok = chat_tokenizer
    stripping = CHAT_TEMPLATE.replace("message['content'] + '<|im_end|>", "message['content'] | trim + '<|im_end|>")
    assert stripping != CHAT_TEMPLATE
    record = {
        "messages": [
            {"role": "user", "content": "  the fox  "},
            {"role": "assistant", "content": "\n  the quick dog \n"},
        ]
    }
    original = tok.chat_template
    tok.chat_template = stripping
    try:
        [sample] = build(tok, [record])
    finally:
        tok.chat_template = original
    assert tok.decode(sample.input_ids[sample.loss_mask.astype(bool)]) == f"the quick dog{IM_END}"


def test_record_shapes(chat_tokenizer):
    tok = chat_tokenizer
    prompt, text, tokens = build(
        tok,
        [
            {"prompt": "the fox", "response": "runs far"},
            {"text": "the quick fox"},
            {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 0]},
        ],
    )
    assert tok.decode(prompt.input_ids[prompt.loss_mask.astype(bool)]) == f"runs far{IM_END}"
    assert text.loss_mask.all() and tok.decode(text.input_ids) == "the quick fox"
    assert tokens.input_ids.tolist() == [5, 6, 7, 8] and tokens.loss_mask.tolist() == [0, 1, 1, 0]
    assert tokens.input_ids.dtype == np.int32 and tokens.loss_mask.dtype == np.uint8
    from common.hashing import sample_id

    assert prompt.sample_id == sample_id(prompt.input_ids, prompt.loss_mask)


@pytest.mark.parametrize(
    "record, reason",
    [
        ([1, 2], C.NOT_AN_OBJECT),
        ({"foo": 1}, C.MISSING_FIELD),
        ({"prompt": "x"}, C.MISSING_FIELD),
        ({"messages": []}, C.EMPTY_CONVERSATION),
        ({"messages": "hello"}, C.BAD_MESSAGE),
        ({"messages": [{"content": "x"}]}, C.MISSING_FIELD),
        ({"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}, C.UNKNOWN_ROLE),
        (
            {"messages": [{"role": "user", "content": ["a", "b"]}, {"role": "assistant", "content": "y"}]},
            C.NON_STRING_CONTENT,
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
            C.NON_STRING_CONTENT,
        ),
        ({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]}, C.NO_ASSISTANT_TURN),
        ({"text": 12}, C.NON_STRING_CONTENT),
        ({"text": ""}, C.EMPTY_SAMPLE),
        ({"input_ids": [1, "a"]}, C.BAD_TOKENS),
        ({"input_ids": [1, 2], "loss_mask": [1]}, C.BAD_TOKENS),
        ({"input_ids": [1, 10**6]}, C.BAD_TOKENS),  # beyond the target's vocabulary
    ],
)
def test_bad_records_become_rejects_with_position(chat_tokenizer, record, reason):
    good = {"text": "the fox"}
    results = build(chat_tokenizer, [good, record, good])
    reject = results[1]
    assert isinstance(reject, C.Reject), reject
    assert (reject.reason, reject.position, reject.source) == (reason, 1, "test:2")
    assert reject.detail
    assert isinstance(results[0], C.TokenizedSample) and isinstance(results[2], C.TokenizedSample)


def test_template_error_is_a_reject(chat_tokenizer):
    tok = chat_tokenizer
    original = tok.chat_template
    tok.chat_template = (
        "{{ raise_exception('no system messages here') if messages[0]['role'] == 'system' else '' "
        "}}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    try:
        [reject] = build(
            tok, [{"messages": [{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}]}]
        )
    finally:
        tok.chat_template = original
    assert reject.reason == C.TEMPLATE_ERROR and "no system messages" in reject.detail


def test_chat_record_without_template_stops_the_run(chat_tokenizer):
    tok = chat_tokenizer
    original = tok.chat_template
    tok.chat_template = None
    try:
        with pytest.raises(C.CorpusError, match="no chat_template"):
            build(tok, [{"prompt": "a", "response": "b"}])
    finally:
        tok.chat_template = original


def test_length_policy_and_min_loss_tokens(chat_tokenizer):
    record = {"input_ids": list(range(10, 60)), "loss_mask": [0] * 20 + [1] * 30}
    [cut] = build(chat_tokenizer, [record], max_len=32, policy="truncate")
    assert cut.n_tokens == 32 and cut.truncated_from == 50 and cut.loss_mask.sum() == 12
    [dropped] = build(chat_tokenizer, [record], max_len=32, policy="drop")
    assert dropped.reason == C.TOO_LONG and "50 tokens > max_len 32" in dropped.detail
    [few] = build(chat_tokenizer, [record], max_len=32, policy="truncate", min_loss=13)
    assert few.reason == C.TOO_FEW_LOSS_TOKENS and "after truncation from 50" in few.detail
    [kept] = build(chat_tokenizer, [record], max_len=64, min_loss=30)
    assert kept.n_tokens == 50


def test_jsonl_reader_positions_bad_lines_and_compression(tmp_path):
    lines = [{"text": "a"}, '{"text": broken', "", {"text": "b"}]
    plain = write_lines(tmp_path / "a.jsonl", lines)
    with open(plain, "rb") as f, gzip.open(tmp_path / "b.jsonl.gz", "wb") as g:
        g.write(f.read())
    corpus = C.find_corpus(str(tmp_path))
    assert corpus.format == "jsonl" and [p.rsplit("/", 1)[1] for p in corpus.files] == ["a.jsonl", "b.jsonl.gz"]
    records = list(C.iter_records(corpus))
    assert [(r.position, r.source) for r in records] == [
        (0, "a.jsonl:1"),
        (1, "a.jsonl:2"),
        (3, "a.jsonl:4"),
        (4, "b.jsonl.gz:1"),
        (5, "b.jsonl.gz:2"),
        (7, "b.jsonl.gz:4"),
    ]
    assert records[1].error[0] == C.INVALID_JSON and records[0].record == {"text": "a"}
    assert C.count_records(corpus) == 8
    assert [r.position for r in C.iter_records(corpus, max_records=4)] == [0, 1, 3]


def test_parquet_and_saved_datasets_are_read_in_order(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}], "text": None}
        for i in range(5)
    ]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "c.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for path in (str(tmp_path / "c.parquet"), str(tmp_path / "saved")):
        for streaming in (True, False):
            corpus = C.find_corpus(path)
            records = list(C.iter_records(corpus, streaming=streaming))
            assert [r.position for r in records] == list(range(5))
            assert [r.record["messages"][1]["content"] for r in records] == [f"a{i}" for i in range(5)]
            assert C.count_records(corpus) == 5
    assert C.find_corpus(str(tmp_path / "saved")).format == "datasets"


def test_corpus_path_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        C.find_corpus(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="cannot tell the format"):
        C.find_corpus(str(tmp_path / "x.txt"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no"):
        C.find_corpus(str(empty))
    with pytest.raises(ValueError, match="matches no files"):
        C.find_corpus(str(tmp_path / "*.parquet"))


def test_parquet_rows_with_null_fields_are_not_confused(chat_tokenizer):
    # Columnar rows carry every column: a None reasoning_content or text must read as absent.
    record = {
        "messages": [
            {"role": "user", "content": "q", "reasoning_content": None},
            {"role": "assistant", "content": "the fox", "reasoning_content": None},
        ],
        "text": None,
    }
    [sample] = build(chat_tokenizer, [record])
    assert chat_tokenizer.decode(sample.input_ids[sample.loss_mask.astype(bool)]) == f"the fox{IM_END}"
    assert json.dumps(record)  # unchanged input
