"""The host-path benchmark runs end to end on small shapes and reports every stage of both paths;
both paths store every synthetic token (the runs assert it)."""

from __future__ import annotations

import json
import math

from benchmarks import extract_host as bench_host


def test_host_bench_runs_and_reports_both_paths(tmp_path, capsys):
    out = tmp_path / "host.json"
    args = [
        "--tokens",
        "3000",
        "--min-len",
        "100",
        "--max-len",
        "900",
        "--tokens-per-batch",
        "2048",
        "--taps",
        "2",
        "--hidden",
        "64",
        "--repeats",
        "1",
        "--dir",
        str(tmp_path),
        "--out",
        str(out),
    ]
    assert bench_host.main(args) == 0
    report = json.loads(out.read_text())
    assert report["width"] == 128 and report["tokens"] >= 3000
    for path in ("current", "legacy"):
        serial = report["paths"][path]["serial"]
        assert serial["tokens"] == report["tokens"] and serial["cpu_us_per_token"] > 0
        assert {"validate", "file write", "zstd + IPC framing", "unpack (cut sample out of the buffer)"} <= serial[
            "stages"
        ].keys()
        assert math.isfinite(serial["write_thread_serial_us_per_token"])
        assert report["paths"][path]["pipelined"]["tokens"] == report["tokens"]
    assert "in series on the write thread" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [out]  # shards deleted
