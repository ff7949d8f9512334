"""How an extraction starts and ends: inputs are checked before the target is loaded, a
refused or failed start leaves nothing behind (and never blocks the corrected run), "rerun to
resume" is said only when something was committed, 0 samples is a non-zero exit with the reason,
and a second writer of the same dataset stops at once."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO
from pathlib import Path

import pytest

from common.locks import LockedError, exclusive_lock
from extract import pipeline
from extract.host_path import HostPath
from shards import verify_dataset
from tests.extract.conftest import chat_record, write_lines
from tests.extract.test_pipeline import make_config, run

REPO = Path(__file__).resolve().parents[2]


def main(*argv) -> tuple[int, str, str]:
    from extract.__main__ import main as extract_main

    out, err = StringIO(), StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = extract_main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def config_file(tmp_path, target, out, corpus, **extra) -> Path:
    table = {
        "target": str(target),
        "corpus": str(corpus),
        "out_dir": str(out),
        "layer_ids": [1, 2],
        "topk": 3,
        "max_len": 128,
        "tokens_per_batch": 256,
        "min_loss_tokens": 4,
        "dtype": "float32",
        "device": "cpu",
        "progress": False,
        **extra,
    }
    import tomli_w

    path = tmp_path / f"{out.name}.toml"
    path.write_text(tomli_w.dumps({"extract": table}))
    return path


def good_corpus(path, n=4, seed=0):
    import random

    rng = random.Random(seed)
    return write_lines(path, [chat_record(rng, 4, 25) for _ in range(n)])


@pytest.fixture
def no_target_loading(monkeypatch):
    """Loading the target (minutes for a 27B) must not happen before the inputs are checked."""

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the inputs were checked")

    monkeypatch.setattr(pipeline, "load_target", refuse)
    monkeypatch.setattr(pipeline, "read_text_config", refuse)


@pytest.mark.parametrize(
    "case",
    ["missing corpus", "out_dir is a file", "out_dir under a file", "unreadable parquet", "split corpus missing"],
)
def test_bad_inputs_are_found_before_the_target_loads_and_leave_nothing(tmp_path, no_target_loading, case):
    corpus = good_corpus(tmp_path / "c.jsonl")
    out = tmp_path / "out"
    extra, needle = {}, None
    if case == "missing corpus":
        corpus, needle = tmp_path / "nope.jsonl", "does not exist"
    elif case == "out_dir is a file":
        out.write_text("I am a file")
        needle = "'out_dir'"
    elif case == "out_dir under a file":
        (tmp_path / "f").write_text("x")
        out, needle = tmp_path / "f" / "out", "which is a file"
    elif case == "unreadable parquet":
        corpus = tmp_path / "bad.parquet"
        corpus.write_bytes(b"")
        needle = "bad.parquet' is not a readable Parquet file"
    else:
        extra, corpus, needle = (
            {"splits": {"train": str(corpus), "heldout": str(tmp_path / "none.jsonl")}},
            "",
            "splits.heldout",
        )
    before = sorted(os.listdir(tmp_path))
    code, _, err = main(config_file(tmp_path, tmp_path / "no-target", out, corpus, **extra))
    assert code == 2 and needle in err and "Traceback" not in err and "target was loaded" not in err, err
    assert sorted(os.listdir(tmp_path)) == sorted(before + [f"{out.name}.toml"])  # nothing created


def test_a_failed_start_leaves_nothing_and_the_corrected_run_works(tmp_path, loaded_target):
    """A chat corpus for a tokenizer without a chat template fails after the writer opened: nothing
    was committed, so nothing may stay (it used to leave a stub that refused the corrected run)."""
    corpus = good_corpus(tmp_path / "c.jsonl")
    out = tmp_path / "deep" / "out"
    template = loaded_target.tokenizer.chat_template
    loaded_target.tokenizer.chat_template = None
    try:
        with pytest.raises(ValueError, match="no chat_template"):
            run(make_config(out, corpus), loaded_target)
    finally:
        loaded_target.tokenizer.chat_template = template
    assert not (tmp_path / "deep").exists()
    other = good_corpus(tmp_path / "other.jsonl", seed=1)
    assert run(make_config(out, other), loaded_target)["samples"] == 4


def test_a_stub_from_a_killed_start_does_not_block_a_changed_corpus(tmp_path, loaded_target, monkeypatch):
    corpus = good_corpus(tmp_path / "c.jsonl")
    out = tmp_path / "out"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # stands in for SIGKILL: no clean-up runs

    monkeypatch.setattr(pipeline, "_extract_into", killed)
    monkeypatch.setattr(pipeline, "_discard_if_empty", lambda *a: None)
    with pytest.raises(KeyboardInterrupt):
        run(make_config(out, corpus), loaded_target)
    monkeypatch.undo()
    assert (out / "manifest.rank000.json").exists()  # the stub a kill leaves
    other = good_corpus(tmp_path / "other.jsonl", seed=1)
    summary = run(make_config(out, other), loaded_target)
    assert summary["complete"] and summary["samples"] == 4 and verify_dataset(str(out)) == []


def test_rerun_to_resume_is_said_only_when_something_was_committed(tmp_path, saved_target, monkeypatch):
    corpus = good_corpus(tmp_path / "c.jsonl", n=6)
    real_write = HostPath.store
    calls = {"n": 0}

    def full_disk_after(n_ok):
        def store(self, out):
            calls["n"] += 1
            if calls["n"] > n_ok:
                raise OSError(errno.ENOSPC, "No space left on device", "somewhere")
            real_write(self, out)
            self.writer.flush()  # commit what was stored so far

        return store

    monkeypatch.setattr(HostPath, "store", full_disk_after(0))
    code, _, err = main(config_file(tmp_path, saved_target, tmp_path / "first", corpus))
    assert code == 4 and "Nothing had been committed yet" in err and "rerun the same command to resume" not in err, err
    assert not (tmp_path / "first").exists()
    calls["n"] = 0
    monkeypatch.setattr(HostPath, "store", full_disk_after(1))
    code, _, err = main(config_file(tmp_path, saved_target, tmp_path / "second", corpus))
    assert code == 4 and "rerun the same command to resume" in err, err


@pytest.mark.parametrize(
    "lines, needle",
    [
        ([], "the corpus holds no records (it is empty)"),
        (["", "  ", ""], "the corpus holds no records (3 blank lines)"),
        (
            ['{"messages": [oops', {"messages": [{"role": "user", "content": "only a question"}]}],
            "every one of its 2 records was rejected (invalid_json 1, no_assistant_turn 1)",
        ),
    ],
)
def test_zero_samples_is_a_non_zero_exit_with_the_reason(tmp_path, saved_target, lines, needle):
    corpus = write_lines(tmp_path / "c.jsonl", lines)
    out = tmp_path / "out"
    code, stdout, err = main(config_file(tmp_path, saved_target, out, corpus))
    assert code == 3, (stdout, err)
    assert f"0 samples written to {out}" in err and needle in err
    assert "samples   none" in stdout  # the summary is still printed
    code, _, err = main(
        config_file(tmp_path, saved_target, out, corpus)
    )  # the rerun finds it complete, and still says so
    assert code == 3 and needle in err


# ----------------------------------------------------------------------------------------------
# One writer per dataset and rank


def hold_lock_in_a_child(path: Path) -> subprocess.Popen:
    """A separate process holding the lock file `path` until killed."""
    code = (
        f"import sys, time; sys.path.insert(0, {str(REPO)!r}); from common.locks import exclusive_lock; "
        f"exclusive_lock({str(path)!r}, what='x', hint='y'); print('held', flush=True); time.sleep(600)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_lock_is_exclusive_between_processes_and_freed_when_the_holder_dies(tmp_path):
    path = tmp_path / ".lock"
    child = hold_lock_in_a_child(path)
    try:
        with pytest.raises(
            LockedError, match=rf"another process \(pid {child.pid} on .*; lock file {path}\)\. do this"
        ):
            exclusive_lock(str(path), what="the thing", hint="do this")
        started = time.monotonic()
        with pytest.raises(LockedError):
            exclusive_lock(str(path), what="the thing", hint="do this", wait_seconds=0.5)
        assert time.monotonic() - started >= 0.5
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    with exclusive_lock(str(path), what="the thing", hint="") as lock:  # a killed holder leaves nothing stuck
        again = exclusive_lock(str(path), what="the thing", hint="")  # the same process: shared, counted
        again.release()
        assert path.exists()
    assert lock is not None and not path.exists()  # deleted on release


def test_a_second_extraction_into_the_same_dataset_stops_at_once(tmp_path, saved_target):
    corpus = good_corpus(tmp_path / "c.jsonl")
    out = tmp_path / "out"
    out.mkdir()
    child = hold_lock_in_a_child(out / ".manifest.rank000.json.lock")  # a writer of rank 0 is at work
    try:
        code, _, err = main(config_file(tmp_path, saved_target, out, corpus))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert code == 2 and "is being written by another process" in err and f"pid {child.pid}" in err, err
    assert sorted(os.listdir(out)) == [".manifest.rank000.json.lock"]  # it wrote nothing, deleted nothing
    code, _, err = main(config_file(tmp_path, saved_target, out, corpus))  # the holder died: the lock is free
    assert code == 0, err
    assert verify_dataset(str(out)) == [] and not (out / ".manifest.rank000.json.lock").exists()
