"""`benchmarks.s3_ceiling` against a real S3 server (moto_server on loopback): every row moves the bytes
it reports at a positive rate, leaves no object behind and restores what it changed; and
`benchmarks.object_store.copy_to_s3` copies a tree byte for byte (no timing is judged)."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pytest

from benchmarks import s3_ceiling
from benchmarks.object_store import copy_to_s3

MIB = 1 << 20


@pytest.fixture
def credentials(moto_server, monkeypatch):
    for key, value in moto_server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(s3_ceiling.CHECKSUM_ENV, raising=False)


def test_every_row_reports_the_bytes_it_moved_and_leaves_nothing_behind(moto_server, credentials):
    io_threads = pa.io_thread_count()
    lines = []
    result = s3_ceiling.measure(
        moto_server.port,
        object_mb=6,
        objects=2,
        threads=[1, 2],
        put_threads=[1, 2],
        range_mb=[0.5, 8],
        io_threads=[4],
        part_mb=[0, 5],
        seconds=0.05,
        log=lines.append,
    )
    rows = result["rows"]
    assert len(lines) == len(rows) and all("MB/s" in line for line in lines)
    assert all(r["MB_per_s"] > 0 and r["calls"] >= r["threads"] and r["seconds"] > 0 for r in rows)
    puts, gets = [r for r in rows if r["op"] == "put"], [r for r in rows if r["op"] == "get"]
    # A PUT row moves whole objects; a GET row whole ranges, capped at the object (8 MiB -> 6 MiB).
    assert all(r["bytes"] == r["calls"] * 6 * MIB for r in puts)
    assert sorted({r["range_mb"] for r in gets}) == [0.5, 6.0]
    assert all(r["bytes"] == r["calls"] * int(r["range_mb"] * MIB) for r in gets)
    # The writer's way at each stream count, then each variation at the fewest and most streams.
    writer = [r for r in puts if r["client"] == "pyarrow" and not r["variation"]]
    assert [r["threads"] for r in writer] == [1, 2]
    assert all(r["background_writes"] and r["allow_delayed_open"] and r["part_mib"] == 10 for r in writer)
    variations = sorted((r["variation"], r["threads"]) for r in puts if r["client"] == "pyarrow" and r["variation"])
    assert variations == [
        ("background_writes=False", 1),
        ("io threads 4", 1),
        ("io threads 4", 2),
        ("when_required", 1),
        ("when_required", 2),
    ]
    assert {r["io_threads"] for r in puts if r["variation"] == "io threads 4"} == {4}
    assert {r["checksums"] for r in puts if r["variation"] == "when_required"} == {"when_required"}
    assert sorted((r["part_mb"], r["threads"]) for r in puts if r["client"] == "botocore") == [
        (0, 1),
        (0, 2),
        (5, 1),
        (5, 2),
    ]
    assert sorted((r["via"], r["range_mb"], r["threads"]) for r in gets) == [
        (via, size, n) for via in ("direct", "proxy") for size in (0.5, 6.0) for n in (1, 2)
    ]
    # What the rows changed is back as it was, and the server holds none of their objects.
    assert pa.io_thread_count() == io_threads and s3_ceiling.CHECKSUM_ENV not in os.environ
    assert moto_server.client().list_objects_v2(Bucket=s3_ceiling.BUCKET).get("KeyCount") == 0
    best = s3_ceiling.summarize(result)
    assert best["put as the shard writer"] == max(r["MB_per_s"] for r in writer)
    assert set(best) >= {"put botocore PutObject", "put botocore multipart", "get 0.5 MiB ranges proxy"}


def test_the_command_writes_json_and_refuses_bad_counts(moto_server, credentials, tmp_path, capsys):
    out = tmp_path / "ceiling.json"
    argv = ["--port", str(moto_server.port), "--object-mb", "1", "--objects", "1", "--seconds", "0.05"]
    argv += ["--threads", "2", "--put-threads", "1", "--io-threads", "", "--part-mb", "", "--no-proxy"]
    assert s3_ceiling.main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    ops = sorted((r["op"], r.get("variation", "")) for r in result["rows"])
    assert ops == [("get", ""), ("put", ""), ("put", "background_writes=False"), ("put", "when_required")]
    assert result["best"]["get 1 MiB ranges direct"] > 0 and result["setup"]["object_mib"] == 1
    assert "S3 server ceiling (best of each group)" in capsys.readouterr().out
    for bad, said in (("--threads=0", "--threads: expected positive integers"), ("--part-mb=2", "under 5 MiB")):
        with pytest.raises(SystemExit) as refused:
            s3_ceiling.main([*argv, bad])
        assert refused.value.code == 2 and said in capsys.readouterr().err


def test_copy_to_s3_puts_every_file_of_the_tree_byte_for_byte(s3_uri, tmp_path):
    from common import io

    local = tmp_path / "tree"
    (local / "sub").mkdir(parents=True)
    files = {"manifest.json": b"{}", "shard-0.arrow": os.urandom(3 * MIB + 7), "sub/index.arrow": os.urandom(100)}
    for name, data in files.items():
        (local / name).write_bytes(data)
    copied = copy_to_s3(str(local), s3_uri, threads=2)
    assert copied["files"] == 3 and copied["bytes"] == sum(map(len, files.values())) and copied["MB_per_s"] > 0
    fs, root = io.resolve(s3_uri)
    assert {name: io.read_bytes(fs, f"{root}/{name}") for name in files} == files
