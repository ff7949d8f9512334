"""`make tiers` (train.choose_tier): the comparison table is assembled from the files the steps write
(dataset manifests, eval reports, speculative-decoding results): bytes per token, recorded error,
means over seeds and changes against lossless."""

from __future__ import annotations

import json

import pytest

from common.config import load_config
from shards.transcode import TranscodeConfig, transcode
from tests.shards.test_transcode import lossless
from train.choose_tier import ChooseTierConfig, collect, markdown, tier_name


def eval_report(lossless_tau: float, tier_tau: float) -> dict:
    def overall(tau):
        return {"tau": tau, "position_acceptance": [tau - 1.0], "ddtree_tau_32": tau + 0.5}

    return {"checkpoints": [{"overall": overall(lossless_tau)}, {"overall": overall(tier_tau)}]}


def test_table_has_lossless_first_means_over_seeds_and_changes(tmp_path):
    src = lossless(tmp_path / "src", 6)
    transcode(str(src), str(tmp_path / "fp8"), load_config(TranscodeConfig, None, ["encoding=fp8", "progress=false"]))
    cfg = load_config(ChooseTierConfig, None, [f"out_dir={tmp_path / 'out'}", 'tiers=["fp8"]', "seeds=[0, 1]"])
    (tmp_path / "out" / "eval").mkdir(parents=True)
    for seed, (a, b) in enumerate([(2.0, 1.9), (2.2, 2.2)]):
        (tmp_path / "out" / "eval" / f"fp8-s{seed}.json").write_text(json.dumps(eval_report(a, b)))
    runs = {
        (tier, seed): tmp_path / "out" / "runs" / f"{tier_name(tier)}-s{seed}"
        for tier in ("lossless", "fp8")
        for seed in (0, 1)
    }
    for (tier, seed), run in runs.items():
        run.mkdir(parents=True)
        (run / "specdecode.json").write_text(
            json.dumps({"summary": {"tau": 3.0 if tier == "lossless" else 2.7 + 0.1 * seed}})
        )
    rows = collect(cfg, {"lossless": str(src), "fp8": str(tmp_path / "fp8")}, runs)
    assert [r["tier"] for r in rows] == ["lossless", "fp8"]
    base, fp8 = rows
    assert base["chain_tau"] == pytest.approx(2.1) and fp8["chain_tau"] == pytest.approx(2.05)
    assert fp8["delta_chain_tau"] == pytest.approx(2.05 / 2.1 - 1) and fp8["online_tau"] == pytest.approx(2.75)
    assert fp8["ddtree_tau"] == pytest.approx(2.55) and fp8["acc1"] == pytest.approx(1.05)
    assert base["rel_rms_per_tap"] == [] and len(fp8["rel_rms_per_tap"]) == 2 and 0 < max(fp8["rel_rms_per_tap"]) < 0.05
    assert fp8["ratio_to_raw_bf16"] < base["ratio_to_raw_bf16"]
    table = "\n".join(markdown(rows, cfg))
    assert "| fp8 |" in table and "2.050 (-2.4%) [1.900 / 2.200]" in table and "0 (exact)" in table


def test_tier_names_are_directory_names():
    assert tier_name("fp8") == "fp8" and tier_name("nf4-g64@pca:rank=32") == "nf4-g64-pca-rank32"
    assert tier_name("fp8@/data/other/projection.safetensors") == "fp8-proj-projection"
