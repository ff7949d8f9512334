"""The GPU benchmark's CPU path (`--shape tiny`) runs end to end and reports consistent numbers:
both phases see every synthetic token, and the dataset written holds them all."""

from __future__ import annotations

import json

import numpy as np

from extract import bench


def test_length_mix_is_bounded_and_sums_to_the_budget():
    lengths = bench.length_mix(50_000, 500, 8000, np.random.default_rng(0))
    assert 50_000 <= sum(lengths) < 50_500 and min(lengths) >= 500 and max(lengths) <= 8000
    assert len(set(lengths)) > len(lengths) // 2  # a mix, not one length


def test_tiny_bench_runs_and_reports(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main(["--shape", "tiny", "--tokens", "3000", "--max-len", "200", "--workdir", str(tmp_path / "w"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    [rank] = report["per_rank"]
    assert rank["bare_tokens"] == rank["full_tokens"] == report["dataset"]["tokens"] >= 3000
    assert rank["bare_tok_s"] > 0 and rank["full_tok_s"] > 0 and rank["full_over_bare"] > 0
    assert report["parameters"] > 0 and report["kernels"]["fla_importable"] in (True, False)
    assert report["dataset"]["bytes"] > 0 and report["world_size"] == 1
    assert "(b)/(a)" in capsys.readouterr().out
    assert not (tmp_path / "w" / "shards").exists()  # cleaned up without --keep
