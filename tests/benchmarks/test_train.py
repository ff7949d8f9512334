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


def test_dflash2_flops_count_its_projections_and_the_shape27b_part_compares_mfu(tmp_path):
    """The DFlash2 parts of `step_flops` from the parameters of the built drafter: 3 x 2 x (weights of every
    coefficient projection) per block token, 3 x 2 x (P's weights + k r) + 2 k D per loss row; DFlash counts
    neither. The shape27b part `train-dflash2` reports its MFU over the DFlash stream's (same batches)."""
    from types import SimpleNamespace

    from benchmarks.suites.shape27b import parts
    from benchmarks.train import SHAPES, drafter_config, step_flops, synthetic_batch
    from common.config import load_config
    from train.blocks import BlockSpec, make_blocks, step_generator
    from train.config import ModelConfig
    from train.dflash2 import build_drafter

    shape = SHAPES["tiny"]
    model = load_config(ModelConfig, None, ["arch=dflash2"])
    cfg = drafter_config(shape, 2, model)
    assert cfg.arch == "dflash2" and cfg.block_size == 8 and cfg.selector_rank == shape["hidden_size"]
    batch = synthetic_batch(1, 64, shape["vocab_size"], cfg.feature_width, 4)
    blocks = make_blocks(
        batch.input_ids,
        batch.loss_mask,
        batch.lengths,
        batch.topk_ids,
        BlockSpec(block_size=8, mask_token_id=cfg.mask_token_id, num_anchors=5, gamma=4.0),
        generator=step_generator(0, 1),
    )
    drafter = build_drafter(cfg)
    projections = sum(
        m.kernel_projection.weight.numel() for layer in drafter.layers for m in (layer.attention_conv, layer.mlp_conv)
    )
    rows, k, r, D = blocks.loss_rows_M.numel(), cfg.selector_top_k, cfg.selector_rank, cfg.hidden_size
    flops = step_flops(cfg, blocks, 64)
    assert flops["conv"] == 3 * 2 * projections * blocks.num_blocks * 8
    hidden_projection = drafter.candidate_selector.hidden_projection.weight.numel()
    assert flops["selector"] == (3 * 2 * (hidden_projection + k * r) + 2 * k * D) * rows
    assert "conv" not in step_flops(drafter_config(shape, 2), blocks, 64)
    part = next(p for p in parts("smoke", {}) if p.name == "train-dflash2")
    ctx = SimpleNamespace(scale="smoke", path=lambda name: str(tmp_path / name))
    argv = part.stages(ctx, 3)[0][0][1]
    assert argv[argv.index("--arch") + 1] == "dflash2" and argv[argv.index("--block-size") + 1] == "16"
    for name, mfu in (("train-stream", 0.5), ("train-dflash2", 0.45)):
        row = {
            "phase": "stream",
            "step_s_median": 1.0,
            "mfu": mfu,
            "tflop_s": 1.0,
            "fetch_frac": 0.0,
            "peak_mem_gib": 1.0,
            "block_tok_s": 1.0,
            "steps": 3,
        }
        (tmp_path / f"{name}.json").write_text(json.dumps({"results": [row]}))
    figures, _ = part.collect(ctx, 3)
    assert figures["shape27b.train_dflash2.mfu_vs_dflash"] == pytest.approx(0.9)
