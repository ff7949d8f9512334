"""`python -m benchmarks.train`: the step benchmark runs on the CPU, in process and under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO, child_pythonpath


def test_bench_times_the_same_work_in_process_and_under_torchrun(tmp_path):
    """`benchmarks.train --ddp 2 --tiers planes,fp8` (the GPU measurements of data parallelism and storage
    tiers) runs on CPU: both rows of a tier train the same global batches (same tokens and FLOPs per step), the
    torchrun rows report each rank; with moto, the in-process rows are streamed again from an S3 server
    (`--s3-delays-ms`, issue 27's training-from-S3 measurement) and train the same batches."""
    from benchmarks.s3_server import moto_server_command

    s3 = ["--s3-delays-ms", "5", "--s3-ceiling-s", "0.05"] if moto_server_command() is not None else []
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.train",
            "--shape",
            "tiny",
            "--phases",
            "stream",
            "--ddp",
            "2",
            "--layers",
            "1",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--prefetch-threads",
            "1",
            "--tiers",
            "planes,fp8",
            "--workdir",
            str(tmp_path),
            "--out",
            str(out),
            *s3,
        ],
        # CPU processes also on a GPU host (the bench takes the GPU when it sees one)
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=child_pythonpath(), CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["phase"]: r for r in json.loads(out.read_text())["results"]}
    plain, ddp = rows["stream"], rows["stream-ddp2"]
    assert (plain["world_size"], ddp["world_size"]) == (1, 2) and [r["rank"] for r in ddp["per_rank"]] == [0, 1]
    assert (
        ddp["mean_context_tokens"] == plain["mean_context_tokens"]
        and ddp["mean_block_tokens"] == plain["mean_block_tokens"]
    )
    assert ddp["tflop_per_step"] == pytest.approx(plain["tflop_per_step"], rel=1e-12)
    assert set(ddp["vs_stream"]) == {"step_s_median", "step_s_mean", "context_tok_s"}
    assert "stream-ddp2 / stream: step time" in done.stdout
    # Storage tiers (--tiers): every tier in both, each torchrun row against the in-process row of its tier.
    plain8, ddp8 = rows["stream-fp8"], rows["stream-ddp2-fp8"]
    assert plain8["tier"]["encoding"] == ddp8["tier"]["encoding"] == "fp8" and plain["tier"]["encoding"] == "planes"
    assert plain8["tier"]["shard_bytes_per_token"] < plain["tier"]["shard_bytes_per_token"]
    assert ddp8["tflop_per_step"] == pytest.approx(plain8["tflop_per_step"], rel=1e-12) and set(
        ddp8["vs_stream"]
    ) == set(ddp["vs_stream"])
    assert "stream-ddp2-fp8 / stream-fp8: step time" in done.stdout
    # Both rows ran on the one kernel choice, printed once per row (rank 0 speaks for the torchrun row).
    assert plain["kernels"] == ddp["kernels"] and plain["kernels"]["attention"] == "sdpa"
    assert done.stdout.count("kernels: device cpu, fp32, attention sdpa") == 2, done.stdout[-3000:]
    if s3:  # the same batches read as s3:// through the trainer's path, with concurrent fetches
        for tier in ("", "-fp8"):
            local, remote = rows[f"stream{tier}"], rows[f"stream-s3-5ms{tier}"]
            assert (local["source"], remote["source"], remote["fetch_threads"]) == ("local disk", "s3", 16)
            assert remote["mean_context_tokens"] == local["mean_context_tokens"] and remote["s3_requests_per_step"] > 1
            assert f"stream-s3-5ms{tier} / stream{tier}: step time" in done.stdout
            assert remote["s3_upload"]["bytes"] > 0 and remote["s3_upload"]["files"] >= 3  # manifest, shard, index
        # The server's own GET rates, measured once before the first S3 row, direct and through the proxy.
        ceiling = json.loads(out.read_text())["s3_ceiling"]
        assert sorted((r["via"], r["threads"]) for r in ceiling["rows"]) == [
            (via, n) for via in ("direct", "proxy") for n in (1, 4, 16)
        ]
        assert all(r["op"] == "get" and r["MB_per_s"] > 0 and r["bytes"] > 0 for r in ceiling["rows"])
        assert done.stdout.count("the S3 server's best GET through the proxy") == 2  # once per tier
