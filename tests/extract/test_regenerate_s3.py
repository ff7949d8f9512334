"""Regeneration into a real S3 server (moto_server on loopback): the journal as objects written once
under their final names, the corpus files in place, regenerate.json last; SIGKILLs at random
moments leave nothing that looks complete and the rerun gives the uninterrupted local run's bytes;
a live writer elsewhere is refused through the lock object."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import time

import pytest

from common import io
from common.config import load_config
from common.locks import LockedError
from extract.regenerate import run as R
from extract.regenerate import store
from extract.regenerate.config import RegenerateConfig
from tests.extract.regen_fixtures import (
    answered_baseline,
    run_crashing_before_provenance,
    start_regenerate_child,
)

SETTINGS = [
    "max_new_tokens=10",
    "batch_size=2",
    "window_records=4",
    "dtype=float32",
    "device=cpu",
    "progress=false",
    "fsync_every_s=0",  # a journal object per finished record: a kill can land between any two
]
RECORDS = 26  # 24 chats and 2 broken lines (rejected)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, chat_tokenizer):
    return answered_baseline(tmp_path_factory.mktemp("regen-s3"), chat_tokenizer, 24, SETTINGS, "local")


def words(setup, out: str) -> list[str]:
    return [f"target={setup['target']}", f"corpus={setup['corpus']}", f"out={out}", *SETTINGS]


def read_object(uri: str, name: str) -> bytes:
    fs, root = io.resolve(uri)
    return io.read_bytes(fs, io.join(root, name))


def assert_same_as_local(setup, uri: str) -> None:
    for name in (store.DATA_FILE, store.REJECTS_FILE):
        assert read_object(uri, name) == (setup["local"] / name).read_bytes(), name
    provenance = json.loads(read_object(uri, store.PROVENANCE_FILE))
    assert provenance["complete"] and provenance["counts"]["records"] == RECORDS
    assert provenance["counts"]["journal_duplicates"] == 0
    left = io.list_names(uri)
    assert not store.journal_files(uri) and ".rank000.lock" not in left, left  # journals deleted, lock released
    fs, root = io.resolve(uri)
    bucket, key = root.split("/", 1)
    from common.objstore import s3_client

    assert s3_client(fs).list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", []) == []


def test_regenerated_into_s3_equals_the_local_run_and_a_rerun_does_nothing(setup, s3_uri, chat_tokenizer):
    cfg = load_config(RegenerateConfig, None, words(setup, s3_uri))
    summary = R.run(cfg, model=setup["model"], tokenizer=chat_tokenizer)
    assert summary["complete"] and summary["counts"]["stored"] + summary["counts"]["rejected"] == RECORDS
    assert_same_as_local(setup, s3_uri)
    assert json.loads(read_object(s3_uri, store.SUMMARY_FILE))["complete"]
    again = R.run(cfg, model=setup["model"], tokenizer=chat_tokenizer)
    assert again["already_complete"]


def test_a_crash_inside_the_commit_on_s3_leaves_nothing_complete_and_the_rerun_finishes(
    setup, s3_uri, chat_tokenizer, monkeypatch
):
    cfg = load_config(RegenerateConfig, None, words(setup, s3_uri))
    run_crashing_before_provenance(monkeypatch, cfg, model=setup["model"], tokenizer=chat_tokenizer)
    assert store.DATA_FILE in io.list_names(s3_uri) and store.journal_files(s3_uri)
    assert store.is_complete(s3_uri) is None
    summary = R.run(cfg, model=setup["model"], tokenizer=chat_tokenizer)
    assert summary["complete"] and summary["counts"]["already_done"] == RECORDS and summary["counts"]["stored"] == 0
    assert_same_as_local(setup, s3_uri)


def start_child(setup, out) -> subprocess.Popen:
    return start_regenerate_child(words(setup, out))


def kill_after(process: subprocess.Popen, uri: str, segments: int, timeout: float = 120) -> int:
    """SIGKILL `process` once `segments` journal objects exist (plus 0-30 ms); the objects seen then."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and len(store.journal_files(uri)) < segments:
        assert time.monotonic() < deadline, "the child wrote nothing in time"
        time.sleep(0.02)
    time.sleep(random.uniform(0, 0.03))
    process.send_signal(signal.SIGKILL)
    process.wait()
    return len(store.journal_files(uri))


@pytest.mark.slow
def test_sigkills_into_s3_then_a_rerun_gives_every_record_once(setup, s3_uri, chat_tokenizer):
    random.seed(27)
    kills = []
    for segments in (1, random.randint(4, 12)):
        process = start_child(setup, s3_uri)
        kills.append(kill_after(process, s3_uri, segments))
        assert process.returncode == -signal.SIGKILL, process.stderr.read()[-2000:]
        assert store.is_complete(s3_uri) is None and store.PROVENANCE_FILE not in io.list_names(s3_uri)
    assert kills[0] < kills[-1], kills  # the second run resumed and added to the journal
    cfg = load_config(RegenerateConfig, None, words(setup, s3_uri))
    summary = R.run(cfg, model=setup["model"], tokenizer=chat_tokenizer)
    assert summary["complete"] and 0 < summary["counts"]["already_done"] < RECORDS
    assert_same_as_local(setup, s3_uri)


def test_a_live_writer_on_another_host_is_refused(setup, s3_uri, chat_tokenizer):
    from common.objstore import s3_client

    fs, root = io.resolve(s3_uri)
    bucket, key = root.split("/", 1)
    other = {"pid": 1, "host": "another-host", "token": "x", "lease_s": 60, "since": "then"}
    s3_client(fs).put_object(Bucket=bucket, Key=f"{key}/.rank000.lock", Body=json.dumps(other).encode())
    assert socket.gethostname() != "another-host"
    cfg = load_config(RegenerateConfig, None, words(setup, s3_uri))
    with pytest.raises(LockedError, match="another-host"):
        R.run(cfg, model=setup["model"], tokenizer=chat_tokenizer)
    assert not store.journal_files(s3_uri)
