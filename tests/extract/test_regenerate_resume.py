"""Exactly once, whatever happens: `python -m extract.regenerate` killed with SIGKILL at several
moments (and a torn last journal line, and a crash inside the commit) finishes on rerun with every
record once, byte-identical to an uninterrupted run; one writer at a time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from common.config import load_config
from extract.corpus.files import find_corpus
from extract.regenerate import run as R
from extract.regenerate import store
from extract.regenerate.config import RegenerateConfig
from tests.extract.regen_fixtures import (
    answered_baseline,
    read_jsonl,
    regenerate_cli,
    run_crashing_before_provenance,
    start_regenerate_child,
)
from tests.paths import REPO, child_pythonpath

SETTINGS = [
    "max_new_tokens=12",
    "batch_size=2",
    "window_records=4",
    "dtype=float32",
    "device=cpu",
    "progress=false",
    "fsync_every_s=0",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, chat_tokenizer):
    return answered_baseline(tmp_path_factory.mktemp("resume"), chat_tokenizer, 40, SETTINGS, "baseline")


def words(setup, out) -> list[str]:
    return [f"target={setup['target']}", f"corpus={setup['corpus']}", f"out={out}", *SETTINGS]


def journal_lines(out) -> int:
    path = os.path.join(out, store.journal_name(0))
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def start_child(setup, out) -> subprocess.Popen:
    return start_regenerate_child(words(setup, out))


def kill_when(process: subprocess.Popen, out, lines: int, timeout: float = 120) -> int:
    """SIGKILL `process` once its journal has `lines` lines; returns the lines seen at the kill."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and journal_lines(out) < lines:
        assert time.monotonic() < deadline, "the child wrote nothing in time"
        time.sleep(0.005)
    seen = journal_lines(out)
    process.send_signal(signal.SIGKILL)
    process.wait()
    return seen


def assert_same_as_baseline(setup, out):
    for name in (store.DATA_FILE, store.REJECTS_FILE):
        assert (out / name).read_bytes() == (setup["baseline"] / name).read_bytes(), name
    rejects = read_jsonl(out / store.REJECTS_FILE)
    provenance = json.loads((out / store.PROVENANCE_FILE).read_text())
    counts = provenance["counts"]
    assert counts["records"] == 42 and counts["stored"] == len(read_jsonl(out / store.DATA_FILE)) == 42 - len(rejects)
    assert counts["journal_duplicates"] == 0 and not store.journal_files(str(out))


@pytest.mark.slow
def test_sigkill_at_several_moments_then_rerun_gives_every_record_once(setup):
    out = setup["root"] / "killed"
    kills = []
    for lines in (1, 9, 25):  # at the header, after a few windows, late in the run
        process = start_child(setup, out)
        kills.append(kill_when(process, out, lines))
        assert process.returncode == -signal.SIGKILL
        assert not (out / store.DATA_FILE).exists()
    assert kills[0] < kills[-1] < 2 + 42, kills  # the kills landed at different points of an unfinished run
    with pytest.raises(ValueError, match="has not finished"):  # extraction refuses the unfinished corpus
        find_corpus(str(out))
    # A kill in the middle of a write leaves a torn last line: the next run cuts it off.
    with open(out / store.journal_name(0), "ab") as f:
        f.write(b'{"id": "torn", "position": 3, "sta')
    done = regenerate_cli(*words(setup, out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "discarded" in done.stdout and "torn" in done.stdout
    assert_same_as_baseline(setup, out)
    again = regenerate_cli(*words(setup, out))
    assert again.returncode == 0 and "already complete" in again.stdout


def test_a_crash_inside_the_commit_is_finished_by_the_rerun(setup, chat_tokenizer, monkeypatch):
    out = setup["root"] / "commit-crash"
    cfg = load_config(RegenerateConfig, None, words(setup, out))
    run_crashing_before_provenance(monkeypatch, cfg, model=setup["model"], tokenizer=chat_tokenizer)
    assert (out / store.DATA_FILE).exists() and store.journal_files(str(out)) and store.is_complete(str(out)) is None
    summary = R.run(cfg, model=setup["model"], tokenizer=chat_tokenizer)
    assert summary["complete"] and summary["counts"]["already_done"] == 42 and summary["counts"]["stored"] == 0
    assert_same_as_baseline(setup, out)


def test_a_second_writer_is_refused_and_a_dead_one_blocks_nothing(setup, tmp_path):
    out = tmp_path / "locked"
    os.makedirs(out)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from extract.regenerate import store; lock = store.lock_rank(sys.argv[1], 0); "
            "print('locked', flush=True); time.sleep(120)",
            str(out),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": child_pythonpath()},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        refused = regenerate_cli(*words(setup, out))
        assert (
            refused.returncode == 2
            and "being written by another process" in refused.stderr
            and f"pid {holder.pid}" in refused.stderr
        )
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    done = regenerate_cli(*words(setup, out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_as_baseline(setup, out)
