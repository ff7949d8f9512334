"""Holes an outside test found in reading a corpus (issue 28): files of a corpus directory skipped in
silence, a corpus that changes while it is read, damaged compressed files found only after the
target loaded (or not at all: a truncated .zst read as empty), file names that are not UTF-8, and
checks that waited for the target's weights (a second writer, a DatasetDict directory, an out_dir
under /proc)."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import zstandard

from extract import corpus as C
from extract import pipeline
from extract.corpus import windows
from extract.ranks import Ranks
from extract.summary import format_summary
from tests.extract.conftest import mixed_corpus, write_lines
from tests.extract.test_failures import make_config
from tests.paths import child_pythonpath


def chat(i: int) -> dict:
    return {"prompt": f"question number {i} about the fox", "response": f"answer {i}: the quick brown fox " * 3}


def cli(words: list[str]) -> tuple[int, str]:
    from extract.__main__ import main

    err = io.StringIO()
    with redirect_stderr(err):
        code = main(words)
    return code, err.getvalue()


# ----------------------------------------------------------------------------------------------
# 1. Every file of a corpus directory is read or listed as skipped, with its reason


def messy_directory(root) -> dict:
    """The outside test's directory: upper-case suffix, .json, .ndjson, a subdirectory, a dot-file."""
    root.mkdir()
    write_lines(root / "a.JSONL", [chat(i) for i in range(3)])
    write_lines(root / "b.json", [chat(i) for i in range(10, 14)])
    write_lines(root / "c.ndjson", [chat(i) for i in range(20, 25)])
    (root / "sub").mkdir()
    write_lines(root / "sub" / "d.jsonl", [chat(i) for i in range(30, 36)])
    write_lines(root / ".hidden.jsonl", [chat(i) for i in range(40, 42)])
    with gzip.open(root / "e.JSONL.GZ", "wt") as f:
        f.write("".join(json.dumps(chat(i)) + "\n" for i in range(50, 52)))
    return {"a.JSONL": 3, "b.json": 4, "c.ndjson": 5, "e.JSONL.GZ": 2}


def test_a_directory_reads_known_suffixes_in_any_case_and_lists_every_other_entry(tmp_path):
    messy_directory(tmp_path / "corpus")
    corpus = C.find_corpus(str(tmp_path / "corpus"))
    assert [os.path.basename(f) for f in corpus.files] == ["a.JSONL", "c.ndjson", "e.JSONL.GZ"]
    skipped = {s["name"]: s["reason"] for s in corpus.skipped}
    assert set(skipped) == {".hidden.jsonl", "b.json", "sub/"}
    assert "hidden" in skipped[".hidden.jsonl"] and "subdirectory" in skipped["sub/"]
    assert "corpus_format" in skipped["b.json"]
    assert sum(1 for _ in C.iter_records(corpus)) == 3 + 5 + 2  # the .gz upper-case suffix is decompressed


def test_corpus_format_jsonl_reads_every_file_of_the_directory(tmp_path):
    counts = messy_directory(tmp_path / "corpus")
    corpus = C.find_corpus(str(tmp_path / "corpus"), "jsonl")
    assert sorted(os.path.basename(f) for f in corpus.files) == sorted(counts)
    assert {s["name"] for s in corpus.skipped} == {".hidden.jsonl", "sub/"}
    assert sum(1 for _ in C.iter_records(corpus)) == sum(counts.values())


def test_a_recursive_glob_reads_the_subdirectory(tmp_path):
    messy_directory(tmp_path / "corpus")
    corpus = C.find_corpus(str(tmp_path / "corpus" / "**" / "*.jsonl"))
    assert [os.path.relpath(f, tmp_path / "corpus") for f in corpus.files] == ["sub/d.jsonl"]


def test_the_summary_and_the_provenance_list_the_skipped_files(tmp_path, loaded_target):
    messy_directory(tmp_path / "corpus")
    cfg = make_config(tmp_path / "out", tmp_path / "corpus", min_loss_tokens=1)
    summary = pipeline.run(cfg, target=loaded_target, ranks=Ranks())[None]
    assert summary["records"] == 10 and summary["input_lines"] == 10
    assert {s["name"] for s in summary["skipped_files"]} == {".hidden.jsonl", "b.json", "sub/"}
    text = format_summary(summary)
    assert "skipped   3 files" in text and "b.json" in text
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert {s["name"] for s in manifest["provenance"]["corpus"]["skipped"]} == {".hidden.jsonl", "b.json", "sub/"}


# ----------------------------------------------------------------------------------------------
# 2. A corpus that changes while it is read


def test_lines_appended_during_the_run_are_not_read_and_the_fingerprint_describes_what_was(
    tmp_path, loaded_target, monkeypatch
):
    path, _ = mixed_corpus(tmp_path / "corpus.jsonl")
    size, lines = os.path.getsize(path), len(Path(path).read_text().splitlines())
    real_windows = windows.read_windows

    def appending(*args, **kwargs):  # another process appends once the run has started reading
        with open(path, "a", encoding="utf-8") as write_more:
            write_more.write("".join(json.dumps(chat(i)) + "\n" for i in range(100)))
        yield from real_windows(*args, **kwargs)

    monkeypatch.setattr(windows, "read_windows", appending)
    summary = pipeline.run(make_config(tmp_path / "out", path), target=loaded_target, ranks=Ranks())[None]
    assert summary["input_lines"] == lines and summary["records"] == lines - 1  # mixed_corpus has one blank line
    assert "-" not in format_summary(summary).splitlines()[1]
    corpus = json.loads((tmp_path / "out" / "manifest.json").read_text())["provenance"]["corpus"]
    assert corpus["files"][0]["bytes"] == size and corpus["records"] == lines


@pytest.mark.parametrize("change", ["rewritten", "truncated"])
def test_a_file_changed_while_it_is_read_stops_the_run_naming_it(tmp_path, loaded_target, monkeypatch, change):
    path, _ = mixed_corpus(tmp_path / "corpus.jsonl")
    real_windows = windows.read_windows

    def changing(*args, **kwargs):
        data = Path(path).read_bytes()
        # rewritten: same size, other bytes
        data = data.replace(b"fox", b"cat") if change == "rewritten" else data[: len(data) // 2]
        Path(path).write_bytes(data)
        yield from real_windows(*args, **kwargs)

    monkeypatch.setattr(windows, "read_windows", changing)
    with pytest.raises(C.CorpusError, match=r"corpus\.jsonl' changed while it was read"):
        pipeline.run(make_config(tmp_path / "out", path), target=loaded_target, ranks=Ranks())
    assert not (tmp_path / "out" / "manifest.json").exists()  # never marked complete


# ----------------------------------------------------------------------------------------------
# 4. Damaged compressed files, named with how far they were read, before the target loads


def compressed(kind: str, data: bytes) -> bytes:
    return {"gz": gzip.compress, "bz2": bz2.compress, "zst": zstandard.ZstdCompressor().compress}[kind](data)


def damage(blob: bytes, how: str, kind: str) -> bytes:
    if how == "truncated":
        return blob[: len(blob) // 2]
    if how == "garbage":
        return blob + b"trailing garbage!"
    # a flipped byte in the last quarter: inside the deflate data / block / frame, or gzip's CRC
    i = len(blob) - 6 if kind == "gz" else len(blob) * 3 // 4
    return blob[:i] + bytes([blob[i] ^ 0x5A]) + blob[i + 1 :]


CASES = [
    (k, h) for k in ("gz", "bz2", "zst") for h in ("truncated", "garbage", "flipped") if (k, h) != ("bz2", "garbage")
]


@pytest.mark.parametrize("kind,how", CASES)
def test_a_damaged_compressed_corpus_is_named_with_how_far_it_was_read_before_the_target(tmp_path, kind, how):
    data = "".join(json.dumps(chat(i)) + "\n" for i in range(400)).encode()
    path = tmp_path / f"corpus.jsonl.{kind}"
    path.write_bytes(damage(compressed(kind, data), how, kind))
    code, err = cli([f"target={tmp_path / 'no-such-target'}", f"corpus={path}", f"out_dir={tmp_path / 'out'}"])
    assert code == 2, err
    line = err.strip().splitlines()[-1]
    assert str(path) in line and "is damaged" in line and "lines" in line and "bytes" in line, line
    assert "Traceback" not in err and "no-such-target" not in err  # found before the target is touched
    assert not (tmp_path / "out").exists()


def test_bz2_trailing_garbage_is_not_data_and_the_whole_stream_is_read(tmp_path):
    data = "".join(json.dumps(chat(i)) + "\n" for i in range(50)).encode()
    path = tmp_path / "corpus.jsonl.bz2"
    path.write_bytes(bz2.compress(data) + b"trailing garbage!")
    assert sum(1 for _ in C.iter_records(C.find_corpus(str(path)))) == 50


def test_a_file_name_that_is_not_utf8_is_named_before_the_target(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    write_lines(root / "good.jsonl", [chat(0)])
    write_lines(os.fsdecode(os.fsencode(str(root)) + b"/caf\xe9.jsonl"), [chat(1)])
    code, err = cli([f"target={tmp_path / 'no-such-target'}", f"corpus={root}", f"out_dir={tmp_path / 'out'}"])
    assert code == 2 and "caf\\xe9.jsonl" in err and "not valid UTF-8" in err, err
    assert "Traceback" not in err and "no-such-target" not in err


# ----------------------------------------------------------------------------------------------
# 9. Checks that need no weights come before the weights


def test_a_datasetdict_directory_is_refused_before_the_target(tmp_path):
    import datasets

    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([chat(0)]), "test": datasets.Dataset.from_list([chat(1)])}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    code, err = cli([f"target={tmp_path / 'no-such-target'}", f"corpus={tmp_path / 'dd'}", f"out_dir={tmp_path / 'o'}"])
    assert code == 2 and "DatasetDict" in err and "train" in err and "no-such-target" not in err, err


def test_an_out_dir_under_proc_is_refused_before_the_target(tmp_path):
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc on this system")
    path, _ = mixed_corpus(tmp_path / "corpus.jsonl")
    code, err = cli([f"target={tmp_path / 'no-such-target'}", f"corpus={path}", "out_dir=/proc/dflash-out"])
    assert code == 2 and "out_dir" in err and "/proc" in err and "no-such-target" not in err, err


def test_a_second_writer_is_refused_before_the_target(tmp_path):
    path, _ = mixed_corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from shards.manifest import lock_manifest\n"
            "from common.io import resolve\n"
            f"lock = lock_manifest(resolve({str(out)!r})[0], {str(out)!r}, 'manifest.rank000.json')\n"
            "print('held', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": child_pythonpath()},
    )
    try:
        assert holder.stdout.readline().strip() == b"held"
        code, err = cli([f"target={tmp_path / 'no-such-target'}", f"corpus={path}", f"out_dir={out}"])
        assert code == 2 and "being written by another process" in err and "no-such-target" not in err, err
    finally:
        holder.kill()
        holder.wait()


# ----------------------------------------------------------------------------------------------
# 6. Values that were silently reinterpreted: booleans as token ids, per-turn training switches


def build(tokenizer, records):
    builder = C.SampleBuilder(tokenizer, C.SamplePolicy(512, "truncate", 1, {}, vocab_size=len(tokenizer)))
    return builder.build([C.RawRecord(i, f"test:{i + 1}", r) for i, r in enumerate(records)])


@pytest.mark.parametrize("ids", [[True, False, 1, 4], [1, 2, True], [True, True]])
def test_booleans_are_never_token_ids(chat_tokenizer, ids):
    [result] = build(chat_tokenizer, [{"input_ids": ids}])
    assert isinstance(result, C.Reject) and result.reason == C.BAD_TOKENS, result


def two_answers(first: dict, second: dict | None = None) -> dict:
    return {
        "messages": [
            {"role": "user", "content": "the fox?"},
            {"role": "assistant", "content": "the quick brown fox", **first},
            {"role": "user", "content": "and the dog?"},
            {"role": "assistant", "content": "a lazy dog sleeps", **(second or {})},
        ]
    }


def loss_text(tokenizer, sample) -> str:
    return tokenizer.decode([i for i, m in zip(sample.input_ids.tolist(), sample.loss_mask, strict=True) if m])


@pytest.mark.parametrize("switch", [{"weight": 0}, {"train": False}, {"weight": 0.0, "train": False}])
def test_an_assistant_turn_marked_weight_0_or_train_false_carries_no_loss(chat_tokenizer, switch):
    from recipes.tiny import IM_END

    [plain, marked, unmarked] = build(
        chat_tokenizer, [two_answers({}), two_answers(switch), two_answers({"weight": 1}, {"train": True})]
    )
    assert loss_text(chat_tokenizer, plain) == f"the quick brown fox{IM_END}a lazy dog sleeps{IM_END}"
    assert loss_text(chat_tokenizer, marked) == f"a lazy dog sleeps{IM_END}"  # the first answer is context only
    assert marked.input_ids.tolist() == plain.input_ids.tolist()  # the switch is not rendered into the text
    assert unmarked.loss_mask.tolist() == plain.loss_mask.tolist()


def test_sharegpt_turn_weights_are_read_too(chat_tokenizer):
    from recipes.tiny import IM_END

    record = {
        "conversations": [
            {"from": "human", "value": "the fox?", "weight": 0},
            {"from": "gpt", "value": "the quick brown fox", "weight": 0},
            {"from": "human", "value": "and the dog?", "weight": 0},
            {"from": "gpt", "value": "a lazy dog sleeps", "weight": 1},
        ]
    }
    [sample] = build(chat_tokenizer, [record])
    assert loss_text(chat_tokenizer, sample) == f"a lazy dog sleeps{IM_END}"


@pytest.mark.parametrize(
    "record",
    [
        two_answers({"weight": 0.5}),
        two_answers({"weight": True}),
        two_answers({"train": "no"}),
        two_answers({"weight": 1, "train": False}),
        {"messages": [{"role": "user", "content": "hi", "train": True}, {"role": "assistant", "content": "yo"}]},
    ],
)
def test_a_switch_that_cannot_be_honoured_is_a_counted_reject(chat_tokenizer, record):
    [result] = build(chat_tokenizer, [record])
    assert isinstance(result, C.Reject) and result.reason == C.BAD_TURN_WEIGHT, result


def test_every_turn_marked_untrained_leaves_too_few_loss_tokens(chat_tokenizer):
    [result] = build(chat_tokenizer, [two_answers({"weight": 0}, {"weight": 0})])
    assert isinstance(result, C.Reject) and result.reason == C.TOO_FEW_LOSS_TOKENS, result
