"""`benchmarks/tier_variance.py` runs on a small lossless dataset and reports consistent rows: shares
kept grow with the rank and lie in [0, 1], kept channels are reconstructed exactly, the JSON and the
plot are written."""

from __future__ import annotations

import json

import numpy as np

from benchmarks import tier_variance
from benchmarks.shard_tiers import provenance_for
from benchmarks.synthetic import realistic_samples
from shards.writer import ShardWriter


def lossless(root, n_taps=2, hidden=128, n=12):
    with ShardWriter(root, provenance=provenance_for(n_taps, hidden, 8), hidden_width=n_taps * hidden, topk=8) as w:
        for sample in realistic_samples(n, 96, n_taps, hidden, topk=8, vocab=1000, seed=3):
            w.write(sample)
    return root


def test_benchmark_reports_consistent_curves_and_variants(tmp_path, capsys):
    data = lossless(tmp_path / "data")
    out = tmp_path / "out"
    assert (
        tier_variance.main(
            [
                f"--dataset={data}",
                "--synthetic-tokens=1024",
                "--synthetic-hidden=128",
                "--synthetic-taps=2",
                f"--out-dir={out}",
            ]
        )
        == 0
    )
    report = json.loads((out / "tier_variance.json").read_text())
    assert (out / "tier_variance.png").stat().st_size > 0
    real = report["sources"]["real"]
    for source in report["sources"].values():
        for row in source["curve"]:
            assert row["ranks"] == [2, 4, 8, 16, 32, 64]
            assert all(0 <= v <= 1 for v in row["kept"]) and np.all(np.diff(row["kept"]) >= -1e-9)
            assert np.all(np.array(row["kept_fit_sample"]) >= 0)
    for row in real["kept_channels"]:
        assert max(row["kept_kept_channels_rel_rms"]) < 1e-6  # kept exactly
    for row in real["per_tap_vs_concat"]:
        assert sum(row["concat_directions_by_tap"]) == row["total_rank"]
    targets = {r["target"]: r["rank_stored"] for r in real["variance_targets"]}
    assert targets[0.9] <= targets[0.99] <= targets[0.999] <= 128
    quantized = {r["tier"]: r for r in real["quantized"]}
    assert 0 < max(quantized["fp8"]["rel_rms_per_tap"]) < 0.05
    assert "variance kept (measured half) against rank" in capsys.readouterr().out
