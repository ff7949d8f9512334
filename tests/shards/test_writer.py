"""The writer: clear errors on bad input with nothing written for that sample, rollover at the
size limit, resume after reopening, refusal to resume with different settings, temporary and
uncommitted files cleaned up, and any pyarrow filesystem (not only local paths)."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import threading
import time

import numpy as np
import pyarrow.fs as pafs
import pytest

from common import io
from shards import ShardDataset, ShardWriter, verify_dataset
from tests.shards.synth import TOPK, VOCAB, WIDTH, assert_same, make_sample, provenance


def open_writer(root, **kwargs):
    settings = dict(provenance=provenance(), hidden_width=WIDTH, topk=TOPK)
    settings.update(kwargs)
    return ShardWriter(root, **settings)


def _nan_hidden(s):
    hidden = s.hidden.copy()
    hidden[1, 3] = 0x7FC0  # bf16 quiet NaN
    return dataclasses.replace(s, hidden=hidden)


def _inf_logprob(s):
    lp = s.topk_logprobs.copy()
    lp[0, -1] = -np.inf
    return dataclasses.replace(s, topk_logprobs=lp)


BAD_INPUTS = {
    "wrong hidden width": (lambda s: dataclasses.replace(s, hidden=s.hidden[:, :-1].copy()), "hidden", "width"),
    "loss_mask shorter": (
        lambda s: dataclasses.replace(s, loss_mask=s.loss_mask[:-1].copy()),
        "loss_mask",
        "positions",
    ),
    "topk rows shorter": (lambda s: dataclasses.replace(s, topk_ids=s.topk_ids[:-2].copy()), "topk_ids", "positions"),
    "hidden rows longer": (
        lambda s: dataclasses.replace(s, hidden=np.vstack([s.hidden, s.hidden[:1]])),
        "hidden",
        "positions",
    ),
    "empty sequence": (
        lambda s: dataclasses.replace(
            s,
            input_ids=s.input_ids[:0],
            loss_mask=s.loss_mask[:0],
            hidden=s.hidden[:0],
            topk_ids=s.topk_ids[:0],
            topk_logprobs=s.topk_logprobs[:0],
        ),
        "input_ids",
        "empty",
    ),
    "int64 input ids": (
        lambda s: dataclasses.replace(s, input_ids=s.input_ids.astype(np.int64)),
        "input_ids",
        "dtype int32",
    ),
    "float hidden": (lambda s: dataclasses.replace(s, hidden=s.hidden.astype(np.float32)), "hidden", "dtype uint16"),
    "bool loss mask": (
        lambda s: dataclasses.replace(s, loss_mask=s.loss_mask.astype(bool)),
        "loss_mask",
        "dtype uint8",
    ),
    "list instead of array": (
        lambda s: dataclasses.replace(s, input_ids=s.input_ids.tolist()),
        "input_ids",
        "numpy array",
    ),
    "wrong topk": (
        lambda s: dataclasses.replace(s, topk_logprobs=s.topk_logprobs[:, :2].copy()),
        "topk_logprobs",
        "topk",
    ),
    "NaN in hidden": (_nan_hidden, "hidden", "NaN"),
    "Inf in logprobs": (_inf_logprob, "topk_logprobs", "NaN/Inf"),
    "unsorted logprobs": (
        lambda s: dataclasses.replace(s, topk_logprobs=s.topk_logprobs[:, ::-1].copy()),
        "topk_logprobs",
        "descending",
    ),
    "logits not logprobs": (
        lambda s: dataclasses.replace(s, topk_logprobs=s.topk_logprobs + 50),
        "topk_logprobs",
        "<= 0",
    ),
    "token id past vocab": (lambda s: dataclasses.replace(s, topk_ids=s.topk_ids + VOCAB), "topk_ids", "[0, 1000)"),
    "loss mask of 2": (lambda s: dataclasses.replace(s, loss_mask=s.loss_mask * 2), "loss_mask", "0 or 1"),
    "empty sample id": (lambda s: dataclasses.replace(s, sample_id=""), "sample_id", "non-empty"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_naming_sample_and_field_and_writes_nothing(tmp_path, case):
    mutate, field, words = BAD_INPUTS[case]
    good_before, bad, good_after = make_sample(0), mutate(make_sample(1, n_tokens=9)), make_sample(2)
    with open_writer(tmp_path / "ds") as w:
        w.write(good_before)
        with pytest.raises(ValueError) as err:
            w.write(bad)
        w.write(good_after)
    message = str(err.value)
    assert f"'{field}'" in message and words in message, message
    if bad.sample_id:
        assert bad.sample_id in message
    ds = ShardDataset(str(tmp_path / "ds"))
    assert [s.sample_id for s in ds] == [good_before.sample_id, good_after.sample_id]
    assert ds.manifest["counts"]["samples"] == 2
    assert verify_dataset(str(tmp_path / "ds")) == []


def test_duplicate_sample_id_is_refused_across_shards_and_sessions(tmp_path):
    with open_writer(tmp_path / "ds", shard_bytes=1) as w:
        w.write(make_sample(0))
        w.write(make_sample(1))
        with pytest.raises(ValueError, match="'sample_id'.*duplicate"):
            w.write(make_sample(0))
    with open_writer(tmp_path / "ds") as w, pytest.raises(ValueError, match=make_sample(1).sample_id):
        w.write(make_sample(1))
    assert len(ShardDataset(str(tmp_path / "ds"))) == 2


def test_local_shards_are_written_back_while_being_written(tmp_path, monkeypatch):
    from shards import shard_file

    synced = []
    real_fdatasync = os.fdatasync

    def counting_fdatasync(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), threading.current_thread()))
        real_fdatasync(fd)

    monkeypatch.setattr(shard_file.os, "fdatasync", counting_fdatasync)
    # One sync runs at a time (a slow disk is not asked again before the last one ends): on a loaded
    # machine a sync can outlast many writes, so the writes leave the sync thread time to run.
    samples = [make_sample(i) for i in range(40)]
    with open_writer(tmp_path / "ds", write_behind_bytes=1024) as w:
        for s in samples:
            w.write(s)
            time.sleep(0.005)
    assert w.write_behind_syncs == len(synced) >= 2
    # Each sync was of an open shard's temporary file, and off the writing thread.
    assert all(path.endswith(io.TMP_SUFFIX) and "shard" in os.path.basename(path) for path, _ in synced), synced
    assert all(thread is not threading.main_thread() for _, thread in synced)
    assert verify_dataset(str(tmp_path / "ds")) == []
    ds = ShardDataset(str(tmp_path / "ds"))
    for i, s in enumerate(samples):
        assert_same(ds[i], s)

    with pytest.raises(ValueError, match="write_behind_bytes"):
        open_writer(tmp_path / "ds3", write_behind_bytes=0)
    with pytest.raises(ValueError, match="write_behind_bytes"):
        open_writer(tmp_path / "ds3", write_behind_bytes=True)


def test_a_failed_early_write_back_fails_the_shard_not_just_a_log_line(tmp_path, monkeypatch):
    # Linux reports a write-back error to one fsync only: the commit's fsync would not see it again.
    from shards import shard_file

    def failing_fdatasync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(shard_file.os, "fdatasync", failing_fdatasync)
    w = open_writer(tmp_path / "ds", write_behind_bytes=1024)
    with pytest.raises(OSError, match="writing .*shard.* back to disk failed") as caught:
        for i in range(8):
            w.write(make_sample(i))
        w.flush()
    assert caught.value.errno == errno.EIO
    assert len(ShardDataset(str(tmp_path / "ds"))) == 0  # the failed shard was never committed

    # A file system that cannot fdatasync (EINVAL) just goes without early write-back.
    def unsupported(fd):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(shard_file.os, "fdatasync", unsupported)
    with open_writer(tmp_path / "ds2", write_behind_bytes=1024) as w2:
        for i in range(8):
            w2.write(make_sample(i))
    assert w2.write_behind_syncs == 0 and len(ShardDataset(str(tmp_path / "ds2"))) == 8


def test_commit_time_is_counted_per_committed_shard(tmp_path):
    w = open_writer(tmp_path / "ds", shard_bytes=1)
    w.write(make_sample(0))
    assert w.commit_seconds == 0.0  # nothing committed yet: the shard is still open
    w.write(make_sample(1))  # the first shard is full: committed before this sample goes in
    after_one = w.commit_seconds
    assert after_one > 0.0
    w.close()
    assert w.commit_seconds > after_one


def test_nonfinite_values_are_stored_when_rejecting_is_off(tmp_path):
    bad = _nan_hidden(make_sample(3))
    with open_writer(tmp_path / "ds", reject_nonfinite=False) as w:
        w.write(bad)
    assert_same(ShardDataset(str(tmp_path / "ds"))[0], bad)


def test_a_not_a_sample_object_is_refused(tmp_path):
    with open_writer(tmp_path / "ds") as w, pytest.raises(ValueError, match="shards.Sample"):
        w.write({"input_ids": [1, 2]})


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"hidden_width": WIDTH + 1}, "hidden_width"),
        ({"topk": TOPK + 1}, "topk"),
        ({"hidden_encoding": "fp6"}, "hidden_encoding"),  # fp8 is a storage tier since format version 4
        ({"zstd_level": 0}, "zstd_level"),
        ({"shard_bytes": 0}, "shard_bytes"),
        ({"shard_prefix": "a/b"}, "shard_prefix"),
        ({"manifest_name": "../m.json"}, "manifest_name"),
        ({"provenance": {"x": object()}}, "provenance"),
    ],
)
def test_bad_writer_settings_name_the_setting(tmp_path, kwargs, words):
    with pytest.raises(ValueError, match=words):
        open_writer(tmp_path / "ds", **kwargs)


def one_sample_bytes(tmp_path, n_tokens):
    """Bytes one record batch of a sample of this length takes (from the index of a scratch dataset)."""
    with open_writer(tmp_path / "probe") as w:
        for i in range(3):
            w.write(make_sample(100 + i, n_tokens=n_tokens))
    ds = ShardDataset(str(tmp_path / "probe"))
    from shards.manifest import read_index

    sizes = read_index(ds.fs, ds.root, ds.shards[0]).column("nbytes").to_pylist()
    header_bytes = sizes[0] - sizes[1]  # row 0 also carries the file header (magic + schema)
    sizes = sizes[1:]
    assert max(sizes) - min(sizes) < 0.02 * min(sizes), "samples of one length should compress alike"
    assert header_bytes < 0.4 * min(sizes), "the test below needs a header well under half a sample"
    return max(sizes)


def test_rollover_gives_the_shard_count_the_size_limit_implies(tmp_path):
    sample_bytes = one_sample_bytes(tmp_path, n_tokens=200)
    # A shard closes once it reaches the limit: with the limit at 3.5 samples (the file header is far
    # smaller than half a sample) each shard takes 4 samples, so 10 samples make shards of 4, 4, 2.
    limit = int(3.5 * sample_bytes)
    with open_writer(tmp_path / "ds", shard_bytes=limit) as w:
        for i in range(10):
            w.write(make_sample(i, n_tokens=200))
    shards = ShardDataset(str(tmp_path / "ds")).shards
    assert [e["samples"] for e in shards] == [4, 4, 2]
    assert w.bytes_written == sum(e["bytes"] + e["index_bytes"] for e in shards)
    assert all(e["bytes"] >= limit for e in shards[:-1])
    assert [e["file"] for e in shards] == ["shard-00000.arrow", "shard-00001.arrow", "shard-00002.arrow"]


def test_rollover_extremes(tmp_path):
    with open_writer(tmp_path / "one", shard_bytes=1) as w:
        for i in range(5):
            w.write(make_sample(i))
    assert [e["samples"] for e in ShardDataset(str(tmp_path / "one")).shards] == [1] * 5
    with open_writer(tmp_path / "all", shard_bytes=1 << 40) as w:
        for i in range(5):
            w.write(make_sample(i))
    assert [e["samples"] for e in ShardDataset(str(tmp_path / "all")).shards] == [5]


def test_resume_keeps_shards_continues_numbering_and_restores_state(tmp_path):
    root = tmp_path / "ds"
    with open_writer(root, shard_bytes=1) as w:
        for i in range(3):
            w.write(make_sample(i))
            w.stage_state["next"] = i + 1
        w.extra_counts["rejected"] += 2
    first_files = {p.name: p.read_bytes() for p in root.glob("shard-*")}
    with open_writer(root, shard_bytes=1) as w:
        assert w.committed_ids() == {make_sample(i).sample_id for i in range(3)}
        assert w.stage_state == {"next": 3} and w.extra_counts["rejected"] == 2
        for i in range(3, 5):
            w.write(make_sample(i))
        w.extra_counts["rejected"] += 1
        w.extra_counts["too_long"] += 1
    ds = ShardDataset(str(root))
    assert [s.sample_id for s in ds] == [make_sample(i).sample_id for i in range(5)]
    assert [e["file"] for e in ds.shards] == [f"shard-{n:05d}.arrow" for n in range(5)]
    assert all((root / name).read_bytes() == data for name, data in first_files.items()), (
        "committed shards were rewritten"
    )
    assert ds.manifest["counts"] == {
        "samples": 5,
        "tokens": sum(make_sample(i).n_tokens for i in range(5)),
        "loss_tokens": sum(make_sample(i).n_loss_tokens for i in range(5)),
        "rejected": 3,
        "too_long": 1,
    }
    assert ds.manifest["complete"] is True
    assert verify_dataset(str(root)) == []


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"provenance": provenance(taps={"layer_ids": [1, 3], "meaning": "x"})}, "provenance.taps"),
        ({"provenance": provenance(tokenizer={"hash": "other"})}, "provenance.tokenizer.hash"),
        ({"hidden_encoding": "plain"}, "encoding"),
        (
            {"hidden_width": WIDTH * 2, "provenance": provenance(target={"hidden_size": 16, "vocab_size": VOCAB})},
            "hidden_width",
        ),
        ({"topk": 2, "provenance": provenance(topk=2)}, "topk"),
    ],
)
def test_resume_with_different_settings_is_refused_naming_the_field(tmp_path, kwargs, field):
    with open_writer(tmp_path / "ds") as w:
        w.write(make_sample(0))
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        open_writer(tmp_path / "ds", **kwargs)
    assert len(ShardDataset(str(tmp_path / "ds"))) == 1


def test_code_version_changes_do_not_block_resume(tmp_path):
    with open_writer(tmp_path / "ds", provenance=provenance(git_sha="aaa", tool_version="0.1")) as w:
        w.write(make_sample(0))
    with open_writer(tmp_path / "ds", provenance=provenance(git_sha="bbb", tool_version="0.2")) as w:
        w.write(make_sample(1))
    assert ShardDataset(str(tmp_path / "ds")).provenance.git_sha == "aaa"


def test_leftovers_of_a_killed_writer_are_ignored_then_cleaned(tmp_path):
    root = tmp_path / "ds"
    with open_writer(root, shard_bytes=1) as w:
        w.write(make_sample(0))
    # What a kill leaves: a half-written shard, a renamed-but-unlisted shard, a temporary manifest,
    # and another rank's temporary file that must survive our cleanup.
    (root / "shard-00001.arrow.1234abcd.tmp").write_bytes(b"partial")
    (root / "shard-00001.arrow").write_bytes(b"never listed")
    (root / "shard-00001.index.arrow").write_bytes(b"never listed")
    (root / "manifest.json.5678abcd.tmp").write_text("{")
    (root / "r1-00000.arrow.9abc0000.tmp").write_bytes(b"other rank")
    assert len(ShardDataset(str(root))) == 1
    assert verify_dataset(str(root)) == []
    with open_writer(root, shard_bytes=1) as w:
        w.write(make_sample(1))
    names = sorted(p.name for p in root.iterdir())
    assert "r1-00000.arrow.9abc0000.tmp" in names
    assert not any(n.endswith(".tmp") and not n.startswith("r1-") for n in names)
    ds = ShardDataset(str(root))
    assert_same(ds[1], make_sample(1))
    assert verify_dataset(str(root)) == []


def test_exception_inside_the_block_keeps_written_samples_and_marks_incomplete(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), open_writer(tmp_path / "ds") as w:
        w.write(make_sample(0))
        w.stage_state["next"] = 1
        raise RuntimeError("boom")
    ds = ShardDataset(str(tmp_path / "ds"))
    assert len(ds) == 1 and ds.manifest["complete"] is False and ds.manifest["stage_state"] == {"next": 1}


def test_state_saved_with_a_commit_describes_the_committed_samples(tmp_path):
    root = tmp_path / "ds"
    with open_writer(root, shard_bytes=1) as w:
        for i in range(3):
            w.write(make_sample(i))
            w.stage_state["next"] = i + 1
            manifest = io.read_json(pafs.LocalFileSystem(), str(root / "manifest.json"))
            # After write(i) the committed samples are 0..i-1, and the saved state says so.
            assert manifest["counts"]["samples"] == i
            assert manifest["stage_state"].get("next", 0) == i


def test_writer_and_reader_work_through_a_non_local_filesystem(tmp_path, monkeypatch):
    """A pyarrow filesystem that is not LocalFileSystem takes the remote code paths (no memory map,
    `fs.move` commit); a SubTreeFileSystem over a temp dir stands in for s3:// or gs://."""
    subtree = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    monkeypatch.setattr(io, "resolve", lambda uri: (subtree, str(uri).removeprefix("remote://")))
    with open_writer("remote://ds", shard_bytes=3000) as w:
        for i in range(6):
            w.write(make_sample(i))
    ds = ShardDataset("remote://ds", verify_checksums=True)
    assert not io.is_local(ds.fs)
    for i in range(6):
        assert_same(ds[i], make_sample(i))
    assert verify_dataset("remote://ds") == []
    assert json.loads((tmp_path / "ds" / "manifest.json").read_text())["counts"]["samples"] == 6


def test_invalid_counters_or_state_are_refused_before_anything_is_committed(tmp_path):
    root = tmp_path / "ds"
    with open_writer(root, shard_bytes=1) as w:
        w.write(make_sample(0))
        w.extra_counts["samples"] += 1  # reserved name
        with pytest.raises(ValueError, match="extra_counts.*'samples'"):
            w.write(make_sample(1))
        del w.extra_counts["samples"]
        w.stage_state["when"] = object()
        with pytest.raises(ValueError, match="stage_state"):
            w.flush()
        w.stage_state["when"] = "now"
        w.write(make_sample(1))
    ds = ShardDataset(str(root))
    assert [s.sample_id for s in ds] == [make_sample(0).sample_id, make_sample(1).sample_id]
    assert verify_dataset(str(root)) == []


def test_a_prefix_used_by_another_manifest_is_refused(tmp_path):
    with open_writer(tmp_path, shard_bytes=1) as w:
        for i in range(2):
            w.write(make_sample(i))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=r"shard_prefix.*manifest\.json"):
        open_writer(tmp_path, manifest_name="other.json")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before, "a refused writer changed files"
    with open_writer(tmp_path, manifest_name="other.json", shard_prefix="other") as w:
        w.write(make_sample(5))
    assert verify_dataset(str(tmp_path)) == [] and verify_dataset(str(tmp_path), "other.json") == []


def test_a_disk_that_fills_inside_a_shard_leaves_no_temporary_and_no_traceback(tmp_path, monkeypatch, caplog):
    """The write fails with ENOSPC and so does the close's flush of the buffered bytes (issue 45):
    the shard's temporary file still goes, with one log line and no traceback."""
    from shards import shard_file

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "Error writing bytes to file")

    w = open_writer(tmp_path, shard_bytes=1 << 30)
    for i in range(3):
        w.write(make_sample(i))
    w.flush()
    w.write(make_sample(3))  # a new shard is open, with a temporary file
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    monkeypatch.setattr(shard_file.HashingStream, "write", full)
    monkeypatch.setattr(shard_file.HashingStream, "close", full)
    caplog.set_level("DEBUG", logger="shards")
    with pytest.raises(OSError, match="No space left on device") as err:
        w.write(make_sample(4))
    assert str(tmp_path) in str(err.value)
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    monkeypatch.undo()
    w.close(complete=False)
    assert [s.sample_id for s in ShardDataset(str(tmp_path))] == [make_sample(i).sample_id for i in range(3)]
