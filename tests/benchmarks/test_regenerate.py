"""`python -m benchmarks.regenerate local`: a smoke run on the CPU writes its rows."""

from __future__ import annotations

import json

from benchmarks import regenerate as bench


def test_local_benchmark_smoke_run(tmp_path):
    out = tmp_path / "bench.json"
    assert (
        bench.main(
            [
                "local",
                "--shape",
                "tiny",
                "--device",
                "cpu",
                "--batch-sizes",
                "1,4",
                "--prompt-len",
                "8",
                "--new-tokens",
                "4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 4] and report["best"]["generated_tokens_per_s"] > 0
