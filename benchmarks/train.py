"""`make bench-train ARGS=...`: throughput of the drafter training step (not a test).

    python -m benchmarks.train                       # Qwen3.6-27B widths on CUDA (compiled flex + chunked CE)
    python -m benchmarks.train --shape tiny          # the same code path at toy widths, runs on CPU in seconds
    python -m benchmarks.train --shape 27b-zlab      # the published z-lab layout (configs/qwen3.6-27b-zlab.toml)
    python -m benchmarks.train --out bench.json --rows 2 --seq-len 3072 --anchors 512
    python -m benchmarks.train --phases stream --ddp 1      # plain trainer, then world size 1 under DDP, one table
    python -m benchmarks.train --phases stream --token-budget 12288 --max-blocks 2048 --accumulation 2 --ddp 2
                                                # 1 GPU (accumulation 2) against 2 GPUs, same tokens per optimizer step
    python -m benchmarks.train --phases stream --arch dflash2 --block-size 16
                                                # DFlash2 on the same batches as the DFlash stream phase

Two phases, one final table, JSON to `--out`:
- `fixed`: one synthetic batch (`--rows` sequences of `--seq-len` tokens, 10% prompt) reused every
  step, fresh anchors each step (`--anchors` per sequence): the compute ceiling of the step.
- `stream`: synthetic shards with a realistic length mix (log-normal around 30% of the max length,
  15% truncated at the max, prompts 10-40%) written with `shards.ShardWriter`, read through
  `train.data.DataStream` (token-budget batches, buckets, prefetch threads, pinned memory), with
  the batch block cap `--max-blocks`. Reports the fetch fraction (time blocked waiting for data).

FLOPs are counted per step from that step's real tokens and blocks (padding excluded), matmuls only:
    fc                     2 x (2 F D) per context token           forward + weight grad (input needs none)
    context k/v proj       3 x (2 D 2GE) x L per context token      forward + input grad + weight grad
    block layer matmuls    3 x 2 L (D HE + D 2GE + HE D + 3 D I) per block token
    attention              3 x 4 E H per (query, visible key) pair and layer; a block query sees anchor + K keys
                           (full_attention), at most the sliding window (sliding_attention)
    lm_head                2 x (2 D V) per loss row                forward + input grad (frozen: no weight grad)
DFlash2 (`--arch dflash2`) adds
    conv                   3 x 2 L x 2 (2 D 2TG) per block token    the coefficient projections of both sublayers
    selector               3 x 2 (D r + k r) + 2 k D per loss row  P(h), the k pair scores, the k head rows in backward
with T taps, G = D / group size, r selector rank, k candidates; D hidden, F = taps x target hidden, H/G heads,
E head dim, I intermediate, L layers, V vocab, K block size. Backward counts 2x forward (attention
recomputation in flash backward is not counted).
MFU = FLOPs / step time / peak, peak = 790 TFLOP/s (a plain bf16 8192^3 matmul on one H200).

Data parallel (`--ddp N`): after the in-process phases the same stream phase runs again under
`torchrun --standalone --nproc-per-node N` (this module with `--worker`), through
`train.distributed` (DDP, the global batch split by tokens over N x accumulation parts); the table
gets a `stream-ddpN` row (tokens/s and MFU of all ranks together, MFU against N x peak; fetch
fraction: the largest any rank waited; step time: rank 0's) and per-rank step times and peak memory,
and the ratios against the in-process `stream` row (of the same tier with `--tiers`).
`--accumulation` splits the in-process stream phase's global batch the same way on one GPU (for a
comparison at equal tokens per optimizer step); the workers use `--ddp-accumulation` (default
accumulation / N).

Storage tiers (`--tiers planes,fp8,nf4-g64`): the stream phase runs once per tier, the synthetic
shards transcoded to it once (`python -m shards transcode`, cached next to them), every tier
through the same compiled drafter; a `stream-TIER` row per tier with its bytes/token and fetch
fraction (the `--ddp` runs stream every tier too: `stream-ddpN-TIER`).

Object storage (`--s3-delays-ms 0,20,80`): after each tier's stream phase, the same phase again
with the tier's shards in an S3 server (`moto_server` on loopback, started here, or the one at
`--s3-port`), read as `s3://` through `benchmarks.s3_server.DelayProxy`, which holds every request
for the given latency: the trainer's own path (`ShardDataset` ranged reads, `data.fetch_threads`
concurrent reads per batch, `--fetch-threads`, auto 16 on S3), the same drafter and options; a
`stream-s3-Nms` row per latency, compared with the local `stream` row (step time, fetch fraction,
shard MB/s read), timing the same batches (the same warm-up). The shards are copied in once per
tier (one PutObject per file, its GB/s printed); then the server's own ranged-GET rate
(`benchmarks.s3_ceiling`, no trainer code, `--s3-ceiling-s` per row) is printed against what the
local row read, so a server-bound S3 row reads as such. moto_server keeps every object: with
`--shard-mb 32` at the 27B widths, `--samples 64` is 2.5 GB (the stream loops over epochs).

Hidden states in the synthetic shards are Gaussian bf16 slices of one random pool (writing ~8 GB of
fresh random numbers would dominate the run); their compression ratio is close to real features'.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from common.config import load_config
from common.interrupts import run_main
from train.attention import visible_pairs
from train.blocks import Blocks
from train.config import DistributedConfig, ModelConfig, TrainConfig
from train.data import Share
from train.dflash2 import build_drafter
from train.distributed import Dist
from train.drafter_config import DrafterConfig, dflash2_fields
from train.model import TargetHead
from train.prepare import Run, choose_run_kernels
from train.step import step_functions, train_step

PEAK_FLOPS = 790e12
FLOP_PARTS = ("fc", "context_kv", "block_matmuls", "attention", "lm_head")  # the keys of step_flops (DFlash)

SHAPES = {
    # Qwen3.6-27B: the drafter has the target's widths, 5 layers, 4 taps.
    "27b": dict(
        hidden_size=5120,
        intermediate_size=17408,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=248320,
        num_target_layers=64,
        target_layer_ids=[1, 16, 31, 46],
        rope_theta=1e7,
        partial_rotary_factor=1.0,
        max_position_embeddings=262144,
        seq_len=3072,
        anchors=512,
        rows=2,
        token_budget=6144,
        max_blocks=1024,
        samples=160,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1024,
        num_target_layers=8,
        target_layer_ids=[1, 3, 5, 6],
        rope_theta=1e6,
        partial_rotary_factor=1.0,
        max_position_embeddings=4096,
        seq_len=256,
        anchors=32,
        rows=2,
        token_budget=1024,
        max_blocks=64,
        samples=48,
    ),
}
# configs/qwen3.6-27b-zlab.toml: the published z-lab layout (5 taps, 32/8 heads of 128, 4 sliding + 1 full).
SHAPES["27b-zlab"] = dict(
    SHAPES["27b"],
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    target_layer_ids=[1, 16, 31, 46, 61],
    layer_types="sliding_then_full",
    sliding_window=2048,
    sliding_in_block="causal",
    seq_len=4096,
    token_budget=8192,
)
# The 27b-zlab layout at toy widths (a window shorter than the sequences): a CPU check of that path.
SHAPES["tiny-zlab"] = dict(
    SHAPES["tiny"],
    target_layer_ids=[1, 2, 3, 5, 6],
    layer_types="sliding_then_full",
    sliding_window=64,
    sliding_in_block="causal",
)


# ----------------------------------------------------------------------------------------------
# FLOPs


def step_flops(cfg: DrafterConfig, blocks: Blocks, context_tokens: int) -> dict[str, float]:
    """The step's useful matmul FLOPs by part (see the module docstring)."""
    D, I, L, V, F = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.feature_width
    H, G, E, K = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.block_size
    keep = blocks.keep_BN
    block_tokens = int(keep.sum()) * K
    # Visible (query, key) pairs summed over the layers: a sliding layer sees at most its window.
    rules = cfg.mask_rules
    pairs_by_type = {t: visible_pairs(blocks.anchors_BN, keep, K, rule) for t, rule in rules.items()}
    pair_layers = sum(pairs_by_type[t] for t in cfg.layer_types)
    per_block_token_fwd = 2 * L * (D * H * E + D * 2 * G * E + H * E * D + 3 * D * I)
    loss_rows = int(blocks.loss_rows_M.numel())
    flops = {
        "fc": 2 * 2 * F * D * context_tokens,
        "context_kv": 3 * 2 * D * 2 * G * E * L * context_tokens,
        "block_matmuls": 3 * per_block_token_fwd * block_tokens,
        "attention": 3 * 4 * E * H * pair_layers,
        "lm_head": 2 * 2 * D * V * loss_rows,
    }
    if cfg.arch == "dflash2":
        coefficients = 2 * cfg.conv_kernel_size * D // cfg.conv_group_size
        r, k = cfg.selector_rank, cfg.selector_top_k
        flops["conv"] = 3 * 2 * L * 2 * D * coefficients * block_tokens
        flops["selector"] = (3 * 2 * (D * r + k * r) + 2 * k * D) * loss_rows
    return flops


# ----------------------------------------------------------------------------------------------
# Synthetic data


def synthetic_batch(rows: int, seq_len: int, vocab: int, width: int, topk: int, seed: int = 0):
    from train.data import Batch

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab - 1, (rows, seq_len), generator=g)
    loss_mask = torch.zeros(rows, seq_len, dtype=torch.bool)
    loss_mask[:, seq_len // 10 :] = True
    hidden = (torch.randn(rows, seq_len, width, generator=g) * 0.8).to(torch.bfloat16)
    topk_ids = torch.randint(0, vocab - 1, (rows, seq_len, topk), generator=g)
    logprobs = torch.log_softmax(torch.randn(rows, seq_len, topk, generator=g), -1).sort(-1, descending=True).values
    if torch.cuda.is_available():
        hidden = hidden.pin_memory()
    return Batch(
        input_ids=input_ids,
        loss_mask=loss_mask,
        hidden=hidden,
        topk_ids=topk_ids,
        topk_logprobs=logprobs,
        lengths=torch.full((rows,), seq_len),
        sample_ids=[f"synthetic-{i}" for i in range(rows)],
        bucket=0,
        epoch=0,
        state={},
    )


def length_mix(n: int, max_len: int, rng: np.random.Generator) -> np.ndarray:
    """Log-normal lengths around 30% of max_len, 15% truncated at max_len: a few long samples, many short."""
    lengths = rng.lognormal(math.log(0.3 * max_len), 0.7, n)
    lengths[rng.random(n) < 0.15] = max_len
    return np.clip(lengths, 64 if max_len >= 256 else 8, max_len).astype(np.int64)


def write_synthetic_shards(
    root: str, shape: dict, n: int, max_len: int, topk: int = 32, seed: int = 0, shard_bytes: int | None = None
) -> dict:
    """Synthetic shards with the shape's provenance (reused when `root` already holds a complete set);
    `shard_bytes`: ShardWriter's default when None."""
    from common.hashing import sample_id
    from shards import Sample, ShardWriter

    H, taps = shape["hidden_size"], shape["target_layer_ids"]
    width = len(taps) * H
    provenance = {
        "target": {
            "name_or_path": "synthetic",
            "num_layers": shape["num_target_layers"],
            "hidden_size": H,
            "vocab_size": shape["vocab_size"],
        },
        "tokenizer": {"hash": "synthetic", "mask_token_id": shape["vocab_size"] - 1},
        "taps": {"layer_ids": list(taps), "meaning": "id i = output of decoder layer i = hidden_states[i+1]"},
        "dtype": "bfloat16",
        "topk": topk,
        "max_len": max_len,
    }
    manifest_path = os.path.join(root, "manifest.json")
    if os.path.exists(manifest_path):
        manifest = json.loads(Path(manifest_path).read_text())
        if (
            manifest.get("complete")
            and manifest.get("counts", {}).get("samples") == n
            and manifest.get("hidden_width") == width
        ):
            return manifest
    rng = np.random.default_rng(seed)
    lengths = length_mix(n, max_len, rng)
    pool = torch.randn(int(max_len * width * 1.5), generator=torch.Generator().manual_seed(seed)) * 0.8
    pool = pool.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    start = time.perf_counter()
    sizes = {} if shard_bytes is None else {"shard_bytes": shard_bytes}
    with ShardWriter(root, provenance=provenance, hidden_width=width, topk=topk, **sizes) as writer:
        for T in lengths.tolist():
            ids = rng.integers(0, shape["vocab_size"] - 1, T).astype(np.int32)
            lm = (np.arange(T) >= int(T * rng.uniform(0.1, 0.4))).astype(np.uint8)
            offset = int(rng.integers(0, pool.size - T * width))
            hidden = pool[offset : offset + T * width].reshape(T, width)
            topk_ids = rng.integers(0, shape["vocab_size"] - 1, (T, topk)).astype(np.int32)
            logprobs = -np.sort(rng.exponential(1.0, (T, topk)).astype(np.float32), 1)
            writer.write(Sample(sample_id(ids, lm), ids, lm, hidden, topk_ids, logprobs))
    print(
        f"wrote {n} synthetic samples ({int(lengths.sum())} tokens) to {root} in {time.perf_counter() - start:.1f}s",
        flush=True,
    )
    return json.load(open(manifest_path))


def synthetic_root(args) -> str:
    """Where the stream phase's synthetic shards are written (one folder per shape and shard size)."""
    return os.path.join(args.workdir, f"shards-{args.shape}" + (f"-{args.shard_mb}mb" if args.shard_mb else ""))


def tier_root(root: str, tier: str) -> str:
    """Where the synthetic shards in storage tier `tier` live (planes = the lossless shards themselves)."""
    return root if tier == "planes" else f"{root}-{tier}"


def tier_shards(root: str, tier: str) -> str:
    """The synthetic shards in storage tier `tier` (transcoded once, cached next to them)."""
    out = tier_root(root, tier)
    if out == root:
        return root
    from shards.transcode import TranscodeConfig, transcode

    manifest = os.path.join(out, "manifest.json")
    if not (os.path.exists(manifest) and json.loads(Path(manifest).read_text()).get("complete")):
        started = time.perf_counter()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        cfg = load_config(
            TranscodeConfig,
            None,
            [
                f"encoding={tier}",
                f"threads={max(2, (os.cpu_count() or 2) // 2)}",
                "verify=false",
                "progress=false",
                f"device={device}",
            ],
        )
        transcode(root, out, cfg)
        print(f"transcoded the synthetic shards to {tier} in {time.perf_counter() - started:.1f}s", flush=True)
    return out


def parse_tiers(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def tier_phase_name(name: str, tier: str) -> str:
    return name if tier == "planes" else f"{name}-{tier}"


# ----------------------------------------------------------------------------------------------
# Runner


def drafter_config(shape: dict, layers: int, model: ModelConfig | None = None) -> DrafterConfig:
    """The drafter of a benchmark shape (`SHAPES`) with `layers` layers, of the class and block size of a train
    config's `model` table (default: DFlash, block 16); a DFlash2 one's fields as training derives them."""
    model = model or load_config(ModelConfig, None, [])
    fields = {f.name for f in dataclasses.fields(DrafterConfig)}
    dflash2 = dflash2_fields(model, shape["hidden_size"])[0] if model.arch == "dflash2" else {}
    return DrafterConfig(
        num_hidden_layers=layers,
        mask_token_id=shape["vocab_size"] - 1,
        block_size=model.block_size,
        **{k: v for k, v in shape.items() if k in fields},
        **dflash2,
    )


def build_run(
    args, shape: dict, device: torch.device, stream=None, workdir: str = ".", dist: Dist | None = None
) -> Run:
    use_compile = args.compile if args.compile is not None else device.type == "cuda"
    overrides = [
        f"loss.num_anchors={args.anchors}",
        f"loss.chunk_rows={args.chunk_rows}",
        f"model.attention={args.attention}",
        f"model.arch={args.arch}",
        f"model.block_size={args.block_size or 'none'}",
        f"loss.max_blocks={args.max_blocks}",
        "optim.lr=1e-4",
        f"device={device.type}",
        f"compile={str(use_compile).lower()}",
    ]
    cfg = load_config(TrainConfig, None, overrides)
    drafter_cfg = drafter_config(shape, args.layers, cfg.model)
    dist = dist if dist is not None else Dist.single(args.accumulation)
    kernels = choose_run_kernels(cfg, drafter_cfg, dist)  # under --ddp: this rank's GPU
    device = kernels.device
    torch.manual_seed(0)
    with torch.device(device):
        drafter = build_drafter(drafter_cfg)
    dtype = kernels.autocast_dtype or torch.float32
    V, D = shape["vocab_size"], shape["hidden_size"]
    head = TargetHead(
        torch.randn(V, D, device=device, dtype=dtype) * 0.02, torch.randn(V, D, device=device, dtype=dtype) * 0.02
    )
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, weight_decay=0.0, fused=device.type == "cuda")
    forward, chunk_fn = step_functions(drafter, dist, kernels.compile, args.ddp_compile)
    return Run(
        cfg=cfg,
        run_dir=workdir,
        kernels=kernels,
        drafter_cfg=drafter_cfg,
        drafter=drafter,
        forward=forward,
        head=head,
        optimizer=optimizer,
        stream=stream,
        total_steps=10**9,
        warmup_steps=0,
        chunk_fn=chunk_fn,
        dist=dist,
    )


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_phase(name: str, run: Run, next_batch, steps: int, warmup: int, wait_of=lambda: 0.0) -> dict:
    """Time `steps` steps after `warmup` untimed ones (compilation, allocator warm-up). Tokens,
    blocks, FLOPs and the fetch wait are of the whole step (all ranks); times and memory per rank."""
    device, dist = run.device, run.dist
    times, waits, flops, ctx_tokens, block_tokens, losses = [], [], [], [], [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(1, warmup + steps + 1):
        _sync(device)
        start = time.perf_counter()
        batch = next_batch()
        result = train_step(run, batch, step, wait=wait_of())
        _sync(device)
        elapsed = time.perf_counter() - start
        if result.skipped:
            raise RuntimeError(f"{name}: step {step} was skipped ({result.skip_reason})")
        if step > warmup:
            times.append(elapsed)
            waits.append(result.wait)
            # this rank's micro-batches (summed over ranks below); result.blocks holds those that ran
            parts = [p for p in (batch.parts if isinstance(batch, Share) else [batch]) if p is not None]
            by_part = [step_flops(run.drafter_cfg, b, p.real_tokens) for p, b in zip(parts, result.blocks, strict=True)]
            flops.append({k: sum(f[k] for f in by_part) for k in by_part[0]})
            ctx_tokens.append(result.tokens)
            block_tokens.append(result.block_tokens)
            losses.append(result.loss)
        if dist.is_main:
            print(
                f"  {name} step {step}: {elapsed:.3f}s loss {result.loss:.3f} blocks "
                f"{result.block_tokens // run.drafter_cfg.block_size}"
                f"{' (warmup)' if step <= warmup else ''}",
                flush=True,
            )
    keys = list(flops[0])
    per_rank_flops = dist.sum([sum(f[k] for f in flops) for k in keys])  # every rank's parts together
    parts = {k: float(v) / steps for k, v in zip(keys, per_rank_flops, strict=True)}
    total_flops = float(per_rank_flops.sum())
    total_time = sum(times)
    peak = (
        torch.cuda.max_memory_allocated() / 2**30
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    )
    ranks = dist.gather([statistics.median(times), total_time / steps, peak])
    return {
        "phase": name,
        "world_size": dist.world_size,
        "accumulation": dist.accumulation,
        "steps": steps,
        "step_s_mean": total_time / steps,
        "step_s_median": statistics.median(times),
        "step_s_max": max(times),
        "context_tok_s": sum(ctx_tokens) / total_time,
        "block_tok_s": sum(block_tokens) / total_time,
        "tflop_per_step": sum(parts.values()) / 1e12,
        "tflop_s": total_flops / total_time / 1e12,
        "mfu": total_flops / total_time / (PEAK_FLOPS * dist.world_size),
        "fetch_frac": sum(waits) / total_time,
        "peak_mem_gib": float(ranks[:, 2].max()),
        "flops_by_part_per_step": parts,
        "mean_context_tokens": sum(ctx_tokens) / steps,
        "mean_block_tokens": sum(block_tokens) / steps,
        "last_loss": losses[-1],
        "per_rank": [
            {
                "rank": r,
                "step_s_median": float(ranks[r, 0]),
                "step_s_mean": float(ranks[r, 1]),
                "peak_mem_gib": float(ranks[r, 2]),
            }
            for r in range(dist.world_size)
        ],
    }


def print_table(results: list[dict], header: dict) -> None:
    print("\n" + " ".join(f"{k}={v}" for k, v in header.items()))
    cols = (
        "phase",
        "steps",
        "step_s_median",
        "step_s_max",
        "context_tok_s",
        "block_tok_s",
        "tflop_per_step",
        "tflop_s",
        "mfu",
        "fetch_frac",
        "peak_mem_gib",
    )
    for r in results:  # rows measured before the layout was recorded have none
        r.setdefault("world_size", 1)
        r.setdefault("accumulation", 1)
    print(" | ".join(f"{c:>14}" for c in cols))
    for r in results:
        if "error" in r:
            print(f"{r['phase']:>14} | error: {r['error']}")
            continue
        cells = []
        for c in cols:
            v = r[c]
            cells.append(
                f"{v:>14.3%}" if c in ("mfu", "fetch_frac") else f"{v:>14.4g}" if isinstance(v, float) else f"{v:>14}"
            )
        print(" | ".join(cells))
    for r in results:
        if "flops_by_part_per_step" in r:
            parts = ", ".join(f"{k} {v / 1e12:.4g}" for k, v in r["flops_by_part_per_step"].items())
            print(
                f"{r['phase']}: {r['world_size']} process(es) x {r['accumulation']} micro-step(s); TFLOP per step "
                f"by part: {parts} "
                f"(peak {PEAK_FLOPS / 1e12:.0f} TFLOP/s per GPU)"
            )
        for rank in r.get("per_rank", []) if r.get("world_size", 1) > 1 else []:
            print(
                f"  rank {rank['rank']}: step median {rank['step_s_median']:.4f} s, mean {rank['step_s_mean']:.4f} "
                f"s, peak mem {rank['peak_mem_gib']:.2f} GiB"
            )
    for line in compare(results):
        print(line)


def compare(results: list[dict]) -> list[str]:
    """The data-parallel and S3 rows against the in-process local-disk stream row of the same storage
    tier (same tokens per optimizer step)."""
    bases = {
        r.get("storage_tier", "planes"): r
        for r in results
        if r.get("phase") == tier_phase_name("stream", r.get("storage_tier", "planes")) and "error" not in r
    }
    lines = []
    for r in results:
        base = bases.get(r.get("storage_tier", "planes"))
        if base is None or not r.get("phase", "").startswith(("stream-ddp", "stream-s3")) or "error" in r:
            continue
        lines.append(
            f"{r['phase']} / {base['phase']}: step time (median) {r['step_s_median'] / base['step_s_median']:.4f}, "
            f"step time (mean) {r['step_s_mean'] / base['step_s_mean']:.4f}, context tok/s "
            f"{r['context_tok_s'] / base['context_tok_s']:.4f}, "
            f"peak mem (largest rank) {r['peak_mem_gib'] / base['peak_mem_gib']:.4f}, "
            f"fetch fraction {r['fetch_frac']:.3%} (local {base['fetch_frac']:.3%})"
            + (
                f", shards read at {read_rate_MB_s(r):,.0f} MB/s (local {read_rate_MB_s(base):,.0f})"
                if "tier" in r and "tier" in base
                else ""
            )
        )
        r["vs_stream"] = {
            "step_s_median": r["step_s_median"] / base["step_s_median"],
            "step_s_mean": r["step_s_mean"] / base["step_s_mean"],
            "context_tok_s": r["context_tok_s"] / base["context_tok_s"],
        }
    return lines


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="27b")
    p.add_argument("--phases", default="fixed,stream", help="comma list of: fixed, stream")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash", help="the drafter class (model.arch)")
    p.add_argument("--block-size", type=int, default=None, help="model.block_size (default: the class's, 16 or 8)")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--rows", type=int, help="sequences in the fixed batch")
    p.add_argument("--anchors", type=int, help="anchors per sequence (num_anchors)")
    p.add_argument("--max-blocks", type=int, help="block cap per batch in the stream phase")
    p.add_argument("--token-budget", type=int, help="data.token_budget of the stream phase")
    p.add_argument("--samples", type=int, help="synthetic samples written for the stream phase")
    p.add_argument("--steps", type=int, default=None, help="timed steps per phase")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per phase (compilation)")
    p.add_argument("--chunk-rows", type=int, default=2048)
    p.add_argument("--attention", choices=["auto", "flex", "sdpa"], default="auto")
    p.add_argument("--compile", dest="compile", action="store_true", default=None)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--prefetch-threads", type=int, default=8)
    p.add_argument("--fetch-threads", type=int, default=0, help="data.fetch_threads (0 = auto: 1 local, 16 S3)")
    p.add_argument(
        "--shard-mb",
        type=int,
        default=0,
        help="shard size of the synthetic shards (0 = the writer's default; moto_server reads a whole object to "
        "answer a range, so the S3 phases want small shards)",
    )
    p.add_argument(
        "--s3-delays-ms",
        default="",
        help="also stream each tier from an S3 server with these per-request latencies (comma list, e.g. 0,20,80)",
    )
    p.add_argument(
        "--s3-ceiling-s",
        type=float,
        default=1.0,
        help="with --s3-delays-ms: seconds per row of the S3 server's own GET ceiling (benchmarks.s3_ceiling), "
        "measured once before the S3 rows (0 = not measured)",
    )
    p.add_argument(
        "--s3-port",
        type=int,
        default=0,
        help="port of an S3 server already running on 127.0.0.1 (0 = start moto_server here)",
    )
    p.add_argument(
        "--tiers",
        default="planes",
        help="storage tiers of the stream phase, comma list (planes = lossless; fp8, int4-gG, nf4-gG: the "
        "synthetic shards "
        "transcoded, `python -m shards transcode`); every tier streams through the same compiled drafter",
    )
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "dflash-bench-train"))
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per step in the in-process stream phase")
    p.add_argument(
        "--ddp", default="", help="comma list of process counts: run the stream phase again under torchrun with each"
    )
    p.add_argument(
        "--ddp-accumulation",
        type=int,
        default=None,
        help="micro-batches per process in the --ddp runs (default accumulation / N)",
    )
    p.add_argument("--bucket-mb", type=int, default=DistributedConfig.bucket_mb, help="DDP gradient bucket size (MiB)")
    p.add_argument(
        "--ddp-compile",
        choices=["outer", "inner"],
        default=DistributedConfig.ddp_compile,
        help="compile around DDP (graph cut at buckets, all-reduce overlapped) or inside it (distributed.ddp_compile)",
    )
    p.add_argument(
        "--worker", action="store_true", help=argparse.SUPPRESS
    )  # one rank of a --ddp run (started by torchrun)
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    for key in ("seq_len", "rows", "anchors", "max_blocks", "token_budget", "samples"):
        if getattr(args, key) is None:
            setattr(args, key, shape[key])
    tiny = args.shape.startswith("tiny")
    args.steps = args.steps if args.steps is not None else (3 if tiny else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 4)
    return args, shape


def stream_phase(
    args,
    shape: dict,
    device: torch.device,
    dist: Dist,
    name: str,
    tier: str = "planes",
    run: Run | None = None,
    warmup: int | None = None,
    source: str | None = None,
) -> tuple[dict, Run]:
    """The stream phase: synthetic shards in storage tier `tier` through `DataStream` (this rank's
    share when split), from local disk or from `source` (the same shards' URI on an object store).
    Returns (result, run): pass `run` back for the next tier, so every tier streams through the
    same (compiled) drafter and only where the batches come from changes."""
    from train.data import DataConfig, DataStream

    root = synthetic_root(args)
    if dist.is_main:
        write_synthetic_shards(
            root, shape, args.samples, args.seq_len, shard_bytes=args.shard_mb << 20 if args.shard_mb else None
        )
        tier_shards(root, tier)
    dist.gather_objects(None)  # the other ranks wait for the shards
    data_cfg = DataConfig(
        shards=source or tier_root(root, tier),
        fetch_threads=args.fetch_threads,
        token_budget=args.token_budget,
        num_buckets=4,
        holdout_fraction=0.0,
        prefetch_threads=args.prefetch_threads,
        prefetch_depth=max(args.prefetch_threads, 8),
    )
    stream = DataStream(data_cfg, split=dist.split)
    if run is None:
        run = build_run(args, shape, device, stream=stream, workdir=args.workdir, dist=dist)
        if dist.is_main:
            print(run.kernels.describe(), flush=True)
    try:
        result = run_phase(
            name,
            run,
            lambda: next(stream),
            args.steps,
            args.warmup if warmup is None else warmup,
            lambda: stream.last_wait,
        )
    finally:
        stream.close()
    result["kernels"] = run.kernels.to_dict()
    result["data_plan"] = {k: v for k, v in stream.data_plan().items() if k != "buckets"}
    result["storage_tier"] = tier
    result["source"] = "s3" if source else "local disk"
    result["fetch_threads"] = stream._fetch_threads
    result["tier"] = {
        "encoding": stream.dataset.encoding,
        "shard_bytes_per_token": sum(e["bytes"] for e in stream.dataset.shards)
        / stream.dataset.manifest["counts"]["tokens"],
    }
    if dist.is_main:
        print(
            f"{name}: fetch fraction {result['fetch_frac']:.3%}, step median {result['step_s_median']:.3f} s, "
            f"{result['tier']['shard_bytes_per_token']:,.0f} B/token",
            flush=True,
        )
    return result, run


def stream_tiers(args, shape: dict, device: torch.device, dist: Dist, name: str, on_result=None, s3=None) -> list[dict]:
    """The stream phase once per storage tier of `--tiers` through one drafter (one compilation),
    and with `s3` (an `S3Source`) once more per `--s3-delays-ms` latency from the S3 server;
    `on_result(results)` after every phase, so a time limit keeps what was measured."""
    results, run = [], None
    for i, tier in enumerate(parse_tiers(args.tiers)):
        sources = [(tier_phase_name(name, tier), None)]
        sources += [(tier_phase_name(f"{name}-s3-{d:g}ms", tier), d) for d in (s3.delays_ms if s3 else [])]
        # Every row of a tier has its local row's warm-up, so all of them time the same batches
        # (each row's stream starts at the plan's first batch); compilation is paid by the first.
        warmup = args.warmup if i == 0 else min(args.warmup, 2)
        local = None
        for phase, delay in sources:
            try:
                if delay is None:
                    result, run = stream_phase(args, shape, device, dist, phase, tier, run=run, warmup=warmup)
                    local = result
                else:
                    path = s3.upload(args, tier, local)
                    with s3.proxy(delay) as proxy:
                        result, run = stream_phase(
                            args, shape, device, dist, phase, tier, run=run, warmup=warmup, source=proxy.uri(path)
                        )
                        result["s3_delay_ms"] = delay
                        result["s3_requests_per_step"] = proxy.requests / max(1, args.steps + warmup)
                        result["s3_upload"] = s3.uploads[tier]
                results.append(result)
            except Exception as exc:  # noqa: BLE001 - report and go on to the next tier
                traceback.print_exc()
                results.append({"phase": phase, "storage_tier": tier, "error": f"{type(exc).__name__}: {exc}"})
            if on_result is not None:
                on_result(results)
    return results


class S3Source:
    """The S3 server the `--s3-delays-ms` phases read from: moto_server on a free loopback port
    (or the server at `--s3-port`), each tier's shards uploaded once to `s3://bench/<tier>`; after
    the first upload, the server's own GET ceiling (`benchmarks.s3_ceiling`, `--s3-ceiling-s`
    per row) at the stream's object and sample sizes, so a slow S3 row can be told apart: the
    server (its ceiling is below what the local row read) or the trainer's read path."""

    def __init__(self, args):
        from benchmarks.s3_server import MotoServer

        self.delays_ms = [float(d) for d in args.s3_delays_ms.split(",") if d.strip()]
        os.environ.update({k: os.environ.get(k) or v for k, v in MotoServer.env().items()})
        self.server = MotoServer() if not args.s3_port else None
        self.port = args.s3_port or self.server.port
        self.ceiling_s = args.s3_ceiling_s
        self.uploaded: dict[str, str] = {}
        self.uploads: dict[str, dict] = {}
        self.ceiling: dict | None = None
        self._client().create_bucket(Bucket="bench")

    def _client(self):
        import botocore.session

        return botocore.session.get_session().create_client(
            "s3", endpoint_url=f"http://127.0.0.1:{self.port}", region_name=os.environ["AWS_DEFAULT_REGION"]
        )

    def upload(self, args, tier: str, local_result: dict | None = None) -> str:
        """The bucket path of `tier`'s shards on the server (copied there the first time; the
        first time of all, the server's ceiling measured after the copy, against `local_result`)."""
        if tier not in self.uploaded:
            from benchmarks.object_store import copy_to_s3
            from benchmarks.s3_server import uri_for

            local = tier_root(synthetic_root(args), tier)
            copied = copy_to_s3(local, uri_for(self.port, f"bench/{tier}"))
            print(
                f"copied the {tier} shards to the S3 server: {copied['bytes'] / 1e9:.2f} GB in {copied['files']} "
                f"files in {copied['seconds']:.1f} s ({copied['MB_per_s']:,.0f} MB/s, PutObject, 8 at a time)",
                flush=True,
            )
            self.uploaded[tier], self.uploads[tier] = f"bench/{tier}", copied
            if self.ceiling is None and self.ceiling_s > 0:
                self.ceiling = self.measure_ceiling(local)
            if self.ceiling is not None and local_result is not None and "error" not in local_result:
                print(ceiling_against_need(self.ceiling, local_result), flush=True)
        return self.uploaded[tier]

    def measure_ceiling(self, local: str) -> dict:
        """The server's ranged-GET rates (direct and through DelayProxy at 0 ms; 1, 4 and 16
        readers: the stream's `fetch_threads` on S3) with objects of the dataset's mean shard
        size and ranges of its mean sample size (a sample is one ranged read)."""
        from benchmarks import s3_ceiling

        manifest = json.loads(Path(local, "manifest.json").read_text())
        shard_bytes = sum(e["bytes"] for e in manifest["shards"])
        object_mib = min(64.0, max(1.0, shard_bytes / len(manifest["shards"]) / 2**20))
        sample_mib = min(object_mib, shard_bytes / manifest["counts"]["samples"] / 2**20)
        print(
            f"S3 server ceiling (benchmarks.s3_ceiling, no trainer code): {object_mib:.1f} MiB objects, "
            f"{sample_mib:.2f} MiB ranges",
            flush=True,
        )
        result = s3_ceiling.measure(
            self.port,
            object_mb=object_mib,
            objects=8,
            threads=[1, 4, 16],
            range_mb=[sample_mib],
            seconds=self.ceiling_s,
            puts=False,
            log=lambda line: print(line, flush=True),
        )
        result["best"] = s3_ceiling.summarize(result)
        return result

    def proxy(self, delay_ms: float):
        from benchmarks.s3_server import DelayProxy

        return DelayProxy(self.port, delay_s=delay_ms / 1000)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


def read_rate_MB_s(result: dict) -> float:
    """The shard bytes a stream row read per second: stored bytes per token x real tokens per step / step time."""
    return result["tier"]["shard_bytes_per_token"] * result["mean_context_tokens"] / result["step_s_mean"] / 1e6


def ceiling_against_need(ceiling: dict, local_result: dict) -> str:
    """One line: what the local row read against the most the S3 server served (GET, through the
    proxy as the S3 rows read): below 1, the server, not the trainer, caps the S3 rows."""
    need = read_rate_MB_s(local_result)
    served = max((r["MB_per_s"] for r in ceiling["rows"] if r["op"] == "get" and r.get("via") == "proxy"), default=0)
    return (
        f"{local_result['phase']} read {need:,.0f} MB/s of shards; the S3 server's best GET through the proxy: "
        f"{served:,.0f} MB/s ({served / need if need else float('nan'):.2f}x what the local row read)"
    )


def s3_facts(s3: S3Source | None) -> dict:
    """The S3 server's ceiling and the uploads, for the JSON (nothing without --s3-delays-ms)."""
    return {} if s3 is None else {"s3_ceiling": s3.ceiling, "s3_uploads": s3.uploads}


def ddp_phase(args, nproc: int) -> list[dict]:
    """The stream phase (every tier of `--tiers`) under `torchrun --standalone --nproc-per-node nproc`
    (this module, --worker)."""
    name = f"stream-ddp{nproc}"
    accumulation = args.ddp_accumulation or max(1, args.accumulation // nproc)
    out = os.path.join(args.workdir, f"{name}.json")
    forwarded = [
        "--shape",
        args.shape,
        "--layers",
        args.layers,
        "--arch",
        args.arch,
        "--block-size",
        args.block_size or 0,
        "--seq-len",
        args.seq_len,
        "--anchors",
        args.anchors,
        "--max-blocks",
        args.max_blocks,
        "--token-budget",
        args.token_budget,
        "--samples",
        args.samples,
        "--steps",
        args.steps,
        "--warmup",
        args.warmup,
        "--chunk-rows",
        args.chunk_rows,
        "--attention",
        args.attention,
        "--prefetch-threads",
        args.prefetch_threads,
        "--fetch-threads",
        args.fetch_threads,
        "--shard-mb",
        args.shard_mb,
        "--workdir",
        args.workdir,
        "--accumulation",
        accumulation,
        "--bucket-mb",
        args.bucket_mb,
        "--ddp-compile",
        args.ddp_compile,
        "--tiers",
        args.tiers,
        "--out",
        out,
        "--worker",
    ]
    if args.compile is not None:
        forwarded.append("--compile" if args.compile else "--no-compile")
    env = dict(os.environ)
    # torchrun sets 1 thread per process when it starts several; give each its share of the cores instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "benchmarks.train",
        *map(str, forwarded),
    ]
    print(f"\n{' '.join(cmd)}  (OMP_NUM_THREADS={env['OMP_NUM_THREADS']})", flush=True)
    if os.path.exists(out):
        os.remove(out)
    done = subprocess.run(cmd, env=env)
    if done.returncode != 0 or not os.path.exists(out):
        return [{"phase": name, "error": f"torchrun exited with status {done.returncode}"}]
    with open(out) as f:
        return json.load(f)


def worker(args, shape: dict) -> int:
    """One rank of a --ddp run: the stream phase (each tier) through train.distributed; rank 0 writes --out (a list)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    cfg = DistributedConfig(accumulation=args.accumulation, bucket_mb=args.bucket_mb)
    dist = Dist.from_env(cfg, device)
    results = stream_tiers(args, shape, dist.device or device, dist, f"stream-ddp{dist.world_size}")
    if dist.is_main:
        for result in results:
            result["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args, shape = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker(args, shape)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.shape.startswith("tiny"):
        print("note: no CUDA device; the 27b shapes on CPU would take hours. Use --shape tiny here.", file=sys.stderr)
        return 2
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    width = len(shape["target_layer_ids"]) * shape["hidden_size"]
    header = {
        "shape": args.shape,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "seq_len": args.seq_len,
        "rows": args.rows,
        "anchors": args.anchors,
        "layers": args.layers,
        "arch": args.arch,
        "block_size": args.block_size,
        "attention": args.attention,
        "compile": args.compile if args.compile is not None else device.type == "cuda",
        "chunk_rows": args.chunk_rows,
        "taps": len(shape["target_layer_ids"]),
        "layer_types": shape.get("layer_types", "full"),
        "sliding_window": shape.get("sliding_window"),
        "heads": f"{shape['num_attention_heads']}/{shape['num_key_value_heads']}x{shape['head_dim']}",
        "token_budget": args.token_budget,
        "max_blocks": args.max_blocks,
        "accumulation": args.accumulation,
        "ddp": args.ddp,
        "bucket_mb": args.bucket_mb,
        "ddp_compile": args.ddp_compile,
    }
    print(json.dumps(header), flush=True)
    results = []
    s3 = None
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if "fixed" in phases:
        try:
            run = build_run(args, shape, device, workdir=args.workdir, dist=Dist.single())
            print(run.kernels.describe(), flush=True)
            batch = synthetic_batch(args.rows, args.seq_len, shape["vocab_size"], width, 32)
            results.append(
                run_phase("fixed", run, lambda: batch, args.steps, args.warmup) | {"kernels": run.kernels.to_dict()}
            )
            print(f"drafter parameters: {run.drafter.num_parameters() / 1e9:.3f} B", flush=True)
            del run
        except Exception as exc:  # noqa: BLE001 - report and go on to the next phase
            traceback.print_exc()
            results.append({"phase": "fixed", "error": f"{type(exc).__name__}: {exc}"})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "stream" in phases:

        def save(tier_results: list[dict]) -> None:  # after every tier, so a time limit keeps what was measured
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"header": header, "results": results + tier_results, **s3_facts(s3)}, f, indent=2)

        s3 = S3Source(args) if args.s3_delays_ms.strip() else None
        try:
            results += stream_tiers(
                args, shape, device, Dist.single(args.accumulation), "stream", on_result=save, s3=s3
            )
        finally:
            if s3 is not None:
                s3.close()
        if device.type == "cuda":  # the --ddp workers need this GPU's memory: drop compiled graphs holding the drafter
            import gc

            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
    for nproc in [int(n) for n in args.ddp.split(",") if n.strip()]:
        if device.type == "cuda" and nproc > torch.cuda.device_count():
            results.append(
                {"phase": f"stream-ddp{nproc}", "error": f"{nproc} processes but {torch.cuda.device_count()} GPU(s)"}
            )
            continue
        results += ddp_phase(args, nproc)
    print_table(results, header)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"header": header, "results": results, **s3_facts(s3)}, f, indent=2)
        print(f"wrote {args.out}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.train", main))
