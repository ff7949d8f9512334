"""What the reliability suite found in extraction: a merge killed after manifest.json left the dataset
without rejects.jsonl / summary.json forever; merge temporaries were never cleaned; lone UTF-16
surrogates crashed the tokenizer; top-k above the vocabulary crashed mid-run; a target directory
without config.json got a confusing message; I/O errors reached the user as tracebacks and an fsync
error of the rejects file named no file."""

from __future__ import annotations

import errno
import io
import json
import os
from contextlib import redirect_stderr

import pytest

from common import io as common_io
from common.config import ConfigError, load_config
from extract import corpus as C
from extract import pipeline, sink
from extract.config import ExtractConfig
from extract.ranks import Ranks
from target.load import read_text_config
from tests.extract.conftest import mixed_corpus
from tests.reliability.faults import ModuleProxy


def make_config(out_dir, corpus, **overrides):
    words = [
        "target=unused",
        f"corpus={corpus}",
        f"out_dir={out_dir}",
        "layer_ids=[0, 2]",
        "topk=4",
        "max_len=256",
        "tokens_per_batch=512",
        "min_loss_tokens=4",
        "dtype=float32",
        "device=cpu",
        "shard_bytes=40000",
        "progress=false",
        "writer_threads=1",
    ] + [f"{k}={v}" for k, v in overrides.items()]
    return load_config(ExtractConfig, None, words)


def test_a_merge_that_fails_at_manifest_json_leaves_rejects_written_and_the_rerun_finishes(
    tmp_path, loaded_target, monkeypatch
):
    corpus, _ = mixed_corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "out"
    cfg = make_config(out, corpus)
    real_commit = common_io.commit

    def fail_at_merged_manifest(fs, tmp, final):
        if os.path.basename(final) == "manifest.json":
            raise OSError(errno.ENOSPC, "No space left on device", final)
        real_commit(fs, tmp, final)

    monkeypatch.setattr(common_io, "commit", fail_at_merged_manifest)
    with pytest.raises(OSError):
        pipeline.run(cfg, target=loaded_target, ranks=Ranks())
    monkeypatch.undo()
    # rejects.jsonl is written before manifest.json: once manifest.json exists, a rerun does nothing more.
    assert (out / "rejects.jsonl").exists() and not (out / "manifest.json").exists()
    # The failed write removed its own temporary (a kill leaves one, which the rerun removes: tests/reliability).
    assert not [p.name for p in out.iterdir() if p.name.startswith("manifest.json.")]
    pipeline.run(cfg, target=loaded_target, ranks=Ranks())
    assert (out / "manifest.json").exists() and (out / "summary.json").exists()
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_a_run_killed_between_manifest_json_and_summary_json_is_finished_by_the_rerun(tmp_path, loaded_target):
    corpus, _ = mixed_corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "out"
    cfg = make_config(out, corpus)
    pipeline.run(cfg, target=loaded_target, ranks=Ranks())
    summary = json.loads((out / "summary.json").read_text())
    (out / "summary.json").unlink()
    (out / "summary.json.deadbeef.tmp").write_text("{")
    pipeline.run(cfg, target=loaded_target, ranks=Ranks())
    assert json.loads((out / "summary.json").read_text()) == summary
    assert not (out / "summary.json.deadbeef.tmp").exists()


def test_lone_surrogates_are_rejected_as_invalid_text():
    raw = C.parse_json_line(b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 3, "c.jsonl:4")
    assert raw.error is not None and raw.error[0] == C.INVALID_TEXT and "\\ud800" in raw.error[1]
    pair = C.parse_json_line(b'{"text": "smile \\ud83d\\ude00"}', 0, "c.jsonl:1")  # a proper pair is text
    assert pair.error is None and pair.record["text"] == "smile \U0001f600"
    escaped = C.parse_json_line(b'{"text": "not an escape: \\\\ud800"}', 0, "c.jsonl:1")
    assert escaped.error is None


def test_topk_above_the_vocabulary_is_refused_before_any_work(tmp_path, loaded_target):
    corpus, _ = mixed_corpus(tmp_path / "corpus.jsonl")
    cfg = make_config(tmp_path / "out", corpus, topk=loaded_target.vocab_size + 1)
    with pytest.raises(ConfigError, match="'topk'.*vocabulary"):
        pipeline.run(cfg, target=loaded_target, ranks=Ranks())
    assert not (tmp_path / "out").exists()


def test_a_target_directory_without_config_json_is_named(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        read_text_config(str(tmp_path))


def test_an_io_error_stops_the_cli_with_one_line_and_status_4(tmp_path, monkeypatch):
    from extract.__main__ import main

    def full_disk(cfg, ranks=None):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "r000-shard-00003.arrow"))

    monkeypatch.setattr(pipeline, "run", full_disk)
    monkeypatch.setattr(Ranks, "from_env", classmethod(lambda cls: cls()))
    err = io.StringIO()
    corpus, _ = mixed_corpus(tmp_path / "corpus.jsonl")
    with redirect_stderr(err):
        code = main([f"target={tmp_path}", f"corpus={corpus}", f"out_dir={tmp_path / 'out'}"])
    assert code == 4
    assert err.getvalue().startswith("extract: I/O error") and "r000-shard-00003.arrow" in err.getvalue()
    assert "Traceback" not in err.getvalue()


def test_a_failed_fsync_of_the_rejects_file_names_it(tmp_path, monkeypatch):
    log = sink.RejectLog(str(tmp_path / "rejects.rank000.jsonl"), 0)
    log.add(C.Reject(0, "c.jsonl:1", C.INVALID_JSON, "broken"))

    def failing_fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(sink, "os", ModuleProxy(os, fsync=failing_fsync))
    with pytest.raises(OSError) as err:
        log.sync()
    assert err.value.errno == errno.EIO and err.value.filename == str(tmp_path / "rejects.rank000.jsonl")


@pytest.mark.parametrize("name", ["x\x00y", "s" * 200])
def test_split_names_that_cannot_be_directory_names_are_config_errors(tmp_path, name):
    with pytest.raises(ConfigError, match="split names become directory names|at most 128 bytes"):
        load_config(
            ExtractConfig, None, ["target=t", f"out_dir={tmp_path}", f'splits={{{json.dumps(name)} = "c.jsonl"}}']
        )
