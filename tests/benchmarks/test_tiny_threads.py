"""`benchmarks.tiny_threads` runs and reports one row per thread count asked for (no timing is judged)."""

from __future__ import annotations

import json

from benchmarks import tiny_threads


def test_thread_benchmark_runs_and_reports_every_count(tmp_path, capsys):
    out = tmp_path / "threads.json"
    assert tiny_threads.main(["--threads", "1", "--rounds", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [row["threads"] for row in result["rows"]] == [1]
    assert all(row["train_min_s"] > 0 and row["decode_min_s"] > 0 for row in result["rows"])
    assert result["precision"] in ("fp32", "bf16") and "usable cores" in capsys.readouterr().out
