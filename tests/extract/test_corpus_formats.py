"""Corpora as users bring them: ShareGPT, OpenAI content parts, UTF-16/32 and BOMs,
directories mixing JSONL and Parquet, and errors that name the file."""

from __future__ import annotations

import codecs
import json

import pytest

from extract import corpus as C
from tests.extract.conftest import write_lines

RECORDS = [
    {
        "messages": [
            {"role": "user", "content": "the fox?"},
            {"role": "assistant", "content": "the quick brown fox jumps"},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "a bird é 😀"},
            {"role": "assistant", "content": "sings ü"},
        ]
    },
    {"text": "plain words"},
]


def build(tokenizer, records):
    builder = C.SampleBuilder(tokenizer, C.SamplePolicy(512, "truncate", 1, {}, vocab_size=len(tokenizer)))
    return builder.build([C.RawRecord(i, f"test:{i + 1}", r) for i, r in enumerate(records)])


def same_samples(a, b) -> bool:
    return a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()


def read(path, corpus_format="auto"):
    corpus = C.find_corpus(str(path), corpus_format)
    return corpus, list(C.iter_records(corpus))


# ----------------------------------------------------------------------------------------------
# Record shapes


def test_sharegpt_conversations_read_like_messages(chat_tokenizer):
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "a bird é 😀"},
            {"from": "gpt", "value": "sings ü"},
        ]
    }
    with_system_field = {
        "system": "be brief",
        "conversations": [{"from": "human", "value": "a bird é 😀"}, {"from": "gpt", "value": "sings ü"}],
    }
    role_content = {"conversations": RECORDS[1]["messages"]}  # some sets use the key with role/content turns
    reference, *others = build(chat_tokenizer, [RECORDS[1], sharegpt, with_system_field, role_content])
    assert isinstance(reference, C.TokenizedSample)
    for sample in others:
        assert isinstance(sample, C.TokenizedSample), sample
        assert same_samples(sample, reference)


@pytest.mark.parametrize(
    "turn, reason",
    [
        ({"from": "wizard", "value": "x"}, C.UNKNOWN_ROLE),
        ({"from": "human"}, C.MISSING_FIELD),
        ({"from": "human", "value": 5}, C.NON_STRING_CONTENT),
    ],
)
def test_bad_sharegpt_turns_are_counted_rejects(chat_tokenizer, turn, reason):
    [reject] = build(chat_tokenizer, [{"conversations": [turn, {"from": "gpt", "value": "y"}]}])
    assert isinstance(reject, C.Reject) and reject.reason == reason and "conversations[0]" in reject.detail


def test_openai_content_parts_are_joined_text(chat_tokenizer):
    parts = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "the "}, {"type": "text", "text": "fox?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "the quick brown fox jumps"}]},
        ]
    }
    reference, sample = build(chat_tokenizer, [RECORDS[0], parts])
    assert isinstance(sample, C.TokenizedSample), sample
    assert same_samples(sample, reference)
    [image] = build(
        chat_tokenizer,
        [
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                    {"role": "assistant", "content": "a cat"},
                ]
            }
        ],
    )
    assert isinstance(image, C.Reject) and image.reason == C.NON_TEXT_CONTENT and "image_url" in image.detail


# ----------------------------------------------------------------------------------------------
# Encodings


@pytest.mark.parametrize(
    "codec, bom",
    [
        ("utf-8", codecs.BOM_UTF8),
        ("utf-16-le", codecs.BOM_UTF16_LE),
        ("utf-16-be", codecs.BOM_UTF16_BE),
        ("utf-16-le", b""),
        ("utf-16-be", b""),
        ("utf-32-le", codecs.BOM_UTF32_LE),
    ],
)
def test_encodings_and_byte_order_marks_read_every_record(tmp_path, codec, bom):
    lines = [json.dumps(r, ensure_ascii=False) for r in RECORDS]
    text = "\n".join([lines[0], "", *lines[1:]]) + "\n"
    (tmp_path / "c.jsonl").write_bytes(bom + text.encode(codec))
    corpus, records = read(tmp_path / "c.jsonl")
    assert [r.error for r in records] == [None] * 3, records
    assert [r.record for r in records] == RECORDS  # the first record too (a BOM used to cost it)
    assert [(r.position, r.source) for r in records] == [(0, "c.jsonl:1"), (2, "c.jsonl:3"), (3, "c.jsonl:4")]
    assert C.count_records(corpus) == 4


def test_a_bad_line_in_a_utf16_file_is_one_reject(tmp_path):
    good = json.dumps(RECORDS[0]).encode("utf-16-le")
    newline = "\n".encode("utf-16-le")
    (tmp_path / "c.jsonl").write_bytes(codecs.BOM_UTF16_LE + good + newline + b"\x00\xd8" + newline + good)
    corpus, records = read(tmp_path / "c.jsonl")
    assert [r.position for r in records] == [0, 1, 2]
    assert records[1].error[0] == C.INVALID_JSON and "UTF-16" in records[1].error[1]
    assert records[0].record == records[2].record == RECORDS[0]
    assert C.count_records(corpus) == 3


def test_compressed_utf16_is_read(tmp_path):
    import gzip

    with gzip.open(tmp_path / "c.jsonl.gz", "wb") as f:
        f.write(("\n".join(json.dumps(r) for r in RECORDS) + "\n").encode("utf-16"))  # Python writes a BOM
    corpus, records = read(tmp_path / "c.jsonl.gz")
    assert [r.record for r in records] == RECORDS and C.count_records(corpus) == 3


# ----------------------------------------------------------------------------------------------
# Files and formats


def write_parquet(path, records):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), str(path))


def test_a_directory_mixing_jsonl_and_parquet_reads_each_file_by_its_format(tmp_path):
    write_lines(tmp_path / "a.jsonl", [RECORDS[0], "", RECORDS[2]])
    write_parquet(tmp_path / "b.parquet", [RECORDS[0], RECORDS[1]])
    write_lines(tmp_path / "c.jsonl", [RECORDS[1]])
    corpus, records = read(tmp_path)
    assert corpus.format == "mixed" and corpus.kinds == ["jsonl", "parquet", "jsonl"]
    assert [(r.position, r.source) for r in records] == [
        (0, "a.jsonl:1"),
        (2, "a.jsonl:3"),
        (3, "b.parquet row 0"),
        (4, "b.parquet row 1"),
        (5, "c.jsonl:1"),
    ]
    assert [r.error for r in records] == [None] * 5
    assert records[2].record["messages"][1]["content"] == RECORDS[0]["messages"][1]["content"]
    assert C.count_records(corpus) == 6


def test_a_forced_format_never_reads_the_other_format_as_garbage(tmp_path):
    write_lines(tmp_path / "a.jsonl", [RECORDS[0]])
    write_parquet(tmp_path / "b.parquet", [RECORDS[0]])
    with pytest.raises(ValueError, match=r"b\.parquet' is a parquet file by its name; use corpus_format = auto"):
        C.find_corpus(str(tmp_path), "jsonl")
    with pytest.raises(ValueError, match=r"a\.jsonl' is a jsonl file by its name"):
        C.find_corpus(str(tmp_path), "parquet")
    (tmp_path / "notes.txt").write_text(
        json.dumps(RECORDS[2]) + "\n"
    )  # a name without a known suffix: forcing is what it is for
    _, records = read(tmp_path / "notes.txt", "jsonl")
    assert records[0].record == RECORDS[2]


def test_parquet_errors_name_the_file(tmp_path):
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.parquet' is not a readable Parquet file"):
        C.find_corpus(str(tmp_path))
    (tmp_path / "empty.parquet").write_text('{"text": "I am JSON"}\n')
    with pytest.raises(ValueError, match=r"empty\.parquet' is not a readable Parquet file"):
        C.find_corpus(str(tmp_path / "empty.parquet"))


def test_a_corpus_path_that_is_neither_file_nor_directory(tmp_path):
    import os

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="neither a file nor a directory"):
        C.find_corpus(str(fifo))


def test_every_example_record_in_docs_corpus_md_becomes_a_sample(tool_tokenizer):
    """docs/corpus.md shows one record of each accepted shape: each must extract as documented."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "corpus.md").read_text()
    examples = [json.loads(block) for block in re.findall(r"```json\n(.*?)```", text, re.S)]
    assert len(examples) == 5
    samples = build(tool_tokenizer, examples[:4])
    # (the token example's ids are Qwen's, beyond the test tokenizer's vocabulary: no vocabulary check for it)
    samples += C.SampleBuilder(tool_tokenizer, C.SamplePolicy(512, "truncate", 1, {})).build(
        [C.RawRecord(4, "doc:5", examples[4])]
    )
    assert all(isinstance(s, C.TokenizedSample) for s in samples), samples
    chat, sharegpt = samples[0], samples[1]
    loss = tool_tokenizer.decode(chat.input_ids[chat.loss_mask.astype(bool)])
    assert loss == (
        "I should look it "
        "up.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>18 C and sunny.<|im_end|>"
    )
    assert "18 C and sunny.<|im_end|>" in tool_tokenizer.decode(sharegpt.input_ids[sharegpt.loss_mask.astype(bool)])
    assert samples[4].input_ids.tolist() == [9707, 11, 1879, 0] and samples[4].loss_mask.tolist() == [0, 0, 1, 1]
    assert samples[3].loss_mask.all() and samples[2].loss_mask.sum() > 0
