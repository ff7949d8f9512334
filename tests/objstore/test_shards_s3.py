"""Datasets on a real S3 server (moto_server on loopback): the writer's commit protocol for an
object store (every object written once under its final name, the manifest last), resume, the
lock object that refuses a second writer, and the readers (ShardDataset, verify, the CLI)."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest

from common import io
from common.locks import LockedError
from shards import ShardDataset, ShardWriter, verify_dataset
from tests.shards.synth import TOPK, WIDTH, assert_same, make_sample, provenance


def open_writer(uri, **kwargs):
    return ShardWriter(uri, provenance=provenance(), hidden_width=WIDTH, topk=TOPK, shard_bytes=6_000, **kwargs)


def names(uri) -> list[str]:
    fs, root = io.resolve(uri)
    return sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(root, recursive=True)))


def test_written_to_s3_reads_back_bit_exact_and_verifies(s3_uri):
    with open_writer(s3_uri) as w:
        for i in range(20):
            w.write(make_sample(i))
    ds = ShardDataset(s3_uri)
    assert len(ds) == 20 and len(ds.shards) > 2
    for i in range(20):
        assert_same(ds[i], make_sample(i))
    assert verify_dataset(s3_uri) == []
    files = names(s3_uri)
    assert not [f for f in files if f.endswith(".tmp")], files  # no temporary names on an object store
    assert ".manifest.json.lock" not in files  # released


def test_unlisted_objects_are_ignored_then_cleaned_and_resume_continues(s3_uri):
    fs, root = io.resolve(s3_uri)
    with open_writer(s3_uri) as w:
        for i in range(8):
            w.write(make_sample(i))
    committed = ShardDataset(s3_uri).manifest["shards"]
    # What a killed writer leaves: a complete shard object numbered past the manifest, an index, a
    # half-done multipart upload.
    n = len(committed)
    with fs.open_output_stream(f"{root}/shard-{n:05d}.arrow") as f:
        f.write(b"not listed")
    with fs.open_output_stream(f"{root}/shard-{n:05d}.index.arrow") as f:
        f.write(b"not listed")
    from common.objstore import s3_client

    bucket, key = root.split("/", 1)
    s3_client(fs).create_multipart_upload(Bucket=bucket, Key=f"{key}/shard-{n + 1:05d}.arrow")
    ds = ShardDataset(s3_uri)
    assert len(ds) == 8 and verify_dataset(s3_uri) == []  # readers use only what the manifest lists
    with open_writer(s3_uri) as w:
        assert len(w.committed_ids()) == 8
        for i in range(8, 14):
            w.write(make_sample(i))
    uploads = s3_client(fs).list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", [])
    assert uploads == []
    ds = ShardDataset(s3_uri)
    assert [s.sample_id for s in ds] == [make_sample(i).sample_id for i in range(14)]
    assert verify_dataset(s3_uri) == []


def test_second_writer_is_refused_and_the_first_keeps_writing(s3_uri):
    with open_writer(s3_uri) as w:
        w.write(make_sample(0))
        w.flush()
        # Another process (here: the lock object written by a live pid of another host) holds it.
        import json
        import socket

        from common.locks import ObjectLock

        lock = ObjectLock._held.copy()
        assert len(lock) == 1
        held = next(iter(lock.values()))
        body = json.loads(held.client.get_object(Bucket=held.bucket, Key=held.key)["Body"].read())
        assert body["pid"] and body["host"] == socket.gethostname()
        ObjectLock._held.clear()  # as if this were a second process
        try:
            with pytest.raises(LockedError, match="being written by another process"):
                open_writer(s3_uri)
        finally:
            ObjectLock._held.update(lock)
        w.write(make_sample(1))
    assert len(ShardDataset(s3_uri)) == 2


def test_lock_of_a_dead_process_is_taken_over_at_once(s3_uri):
    import json
    import socket

    from common.objstore import s3_client

    fs, root = io.resolve(s3_uri)
    bucket, key = root.split("/", 1)
    dead = {"pid": 2**22 + 12345, "host": socket.gethostname(), "token": "x", "lease_s": 60, "since": "then"}
    s3_client(fs).put_object(Bucket=bucket, Key=f"{key}/.manifest.json.lock", Body=json.dumps(dead).encode())
    with open_writer(s3_uri) as w:
        w.write(make_sample(0))
    assert len(ShardDataset(s3_uri)) == 1


def test_live_lock_of_another_host_refuses_until_its_lease_runs_out(s3_uri, monkeypatch):
    import json
    import time

    from common.objstore import s3_client

    fs, root = io.resolve(s3_uri)
    bucket, key = root.split("/", 1)
    other = {"pid": 1, "host": "another-host", "token": "x", "lease_s": 2, "since": "then"}
    s3_client(fs).put_object(Bucket=bucket, Key=f"{key}/.manifest.json.lock", Body=json.dumps(other).encode())
    with pytest.raises(LockedError, match="another-host"):
        open_writer(s3_uri)
    time.sleep(3.5)  # the holder stopped renewing: its lease (2 s, on the store's clock) ran out
    with open_writer(s3_uri) as w:
        w.write(make_sample(0))
    assert len(ShardDataset(s3_uri)) == 1


def test_the_shards_command_line_reads_and_merges_s3_datasets(s3_uri, capsys):
    from common.io import join_uri
    from shards.__main__ import main

    for rank in range(2):
        with ShardWriter(
            s3_uri,
            provenance=provenance(),
            hidden_width=WIDTH,
            topk=TOPK,
            shard_bytes=6_000,
            manifest_name=f"manifest.rank{rank:03d}.json",
            shard_prefix=f"r{rank:03d}-shard",
        ) as w:
            for i in range(rank, 12, 2):
                w.write(make_sample(i))
    assert main(["merge", s3_uri, "manifest.rank000.json", "manifest.rank001.json"]) == 0
    assert "merged 2 manifests" in capsys.readouterr().out
    assert main(["verify", s3_uri, "--no_progress"]) == 0
    assert capsys.readouterr().out.startswith("OK: 12 samples")
    assert main(["inspect", s3_uri]) == 0
    assert "12" in capsys.readouterr().out
    assert main(["show", s3_uri, "3"]) == 0
    assert make_sample(6).sample_id in capsys.readouterr().out  # rank 0's shards first: 0, 2, 4, 6, ...
    # A damaged object is named by verify, as on disk.
    fs, root = io.resolve(s3_uri)
    entry = ShardDataset(s3_uri).shards[0]
    data = bytearray(io.read_bytes(fs, f"{root}/{entry['file']}"))
    data[len(data) // 2] ^= 0xFF
    with fs.open_output_stream(f"{root}/{entry['file']}") as f:
        f.write(bytes(data))
    assert main(["verify", s3_uri, "--no_progress"]) == 1
    assert entry["file"] in capsys.readouterr().out
    assert io.exists_at(join_uri(s3_uri, "manifest.json"))


def test_transcode_from_and_to_s3(s3_uri):
    from common.io import join_uri
    from shards.transcode import TranscodeConfig, transcode

    src = join_uri(s3_uri, "src").replace("/data/src", "/src")
    with open_writer(src) as w:
        for i in range(10):
            w.write(make_sample(i))
    dst = src.replace("/src", "/fp8")
    result = transcode(src, dst, TranscodeConfig(encoding="fp8", progress=False))
    assert result["problems"] == [] and result["samples"] == 10
    again = transcode(src, dst, TranscodeConfig(encoding="fp8", progress=False))
    assert again["resumed_past"] == 10 and len(ShardDataset(dst)) == 10
