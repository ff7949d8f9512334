"""`python -m benchmarks.regenerate local` and `ops`: smoke runs on the CPU write their numbers."""

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


def test_ops_counts_the_calls_of_one_decoding_step(tmp_path):
    out = tmp_path / "ops.json"
    assert (
        bench.main(
            [
                "ops",
                "--narrow",
                "--device",
                "cpu",
                "--batch",
                "2",
                "--prompt-len",
                "8",
                "--steps",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    # every one of the 64 layers runs at least a norm, a projection and a residual add per step
    assert report["aten_calls_per_step"] >= report["top_level_aten_calls_per_step"] >= 3 * 64
    assert isinstance(report["seconds_per_step"], float)


def test_smollm2_shape_is_the_real_targets_and_runs_in_float32():
    target, params = bench.random_target("smollm2", "cpu", bench.pick_dtype("auto", "smollm2", "cpu"))
    config = target.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert 130e6 < params < 140e6 and next(target.model.parameters()).dtype.is_floating_point
    assert str(bench.pick_dtype("auto", "smollm2", "cuda")) == "torch.float32"
    assert str(bench.pick_dtype("auto", "qwen3.6-27b", "cuda")) == "torch.bfloat16"
    assert str(bench.pick_dtype("bfloat16", "smollm2", "cpu")) == "torch.bfloat16"
