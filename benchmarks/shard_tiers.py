"""Storage-tier benchmark (not a test): bytes per token and reconstruction error of every tier, on
synthetic features shaped like Qwen3.6-27B (4 taps x 5120 bf16 + top-32, with the massive-activation
channels of `benchmarks/synthetic.py`) or on the samples of an existing lossless dataset.

    python -m benchmarks.shard_tiers [--samples 8] [--tokens 512] [--taps 4] [--hidden 5120]
                                 [--tiers planes,fp8,nf4-g64,...] [--dataset DIR] [--max-samples N] [--out JSON]

A tier is `ENCODING` or `ENCODING@pca:rank=R` / `ENCODING@pca:variance=V` (projected first; the
projection is fitted on the first half of the samples and applied to all). For each tier the samples
are encoded (`shards.tiers.encode_features`) and written with `ShardWriter` (zstd level 1); what zstd
buys is measured against the raw size of the stored arrays; reported: bytes/token of the shard files, the ratio to raw
bf16 of the full features, the
zstd saving, relative RMS error per tap and its worst channel, the error of the massive-activation
channels and of the channels that share a 4-bit group with one, and CPU time per token on one
thread to encode, to read dequantized to bf16 (`ShardDataset.torch`) and to read compact
(`ShardDataset.compact`, what the trainer's loader does for a quantized dataset).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import tempfile
import time

import numpy as np
import pyarrow as pa
import torch

from benchmarks.synthetic import realistic_samples
from common.interrupts import run_main
from shards.describe import raw_bytes_per_token
from shards.projection import SecondMoments, fit_projection, parse_projection_spec, save_projection
from shards.quant import ErrorSums, QuantizedHidden, parse_encoding
from shards.reader import ShardDataset
from shards.tiers import encode_features
from shards.writer import ShardWriter

DEFAULT_TIERS = (
    "planes,fp8,int4-g32,int4-g64,int4-g128,nf4-g16,nf4-g32,nf4-g64,nf4-g128,nf4-g256,"
    "planes@pca:rank={q},fp8@pca:rank={q},nf4-g64@pca:rank={q},fp8@pca:rank={e}"
)


def parse_tier(text: str) -> tuple[str, str | None]:
    encoding, _, projection = text.partition("@")
    return encoding, projection or None


def provenance_for(n_taps: int, hidden: int, topk: int) -> dict:
    return {
        "target": {"name_or_path": "synthetic", "hidden_size": hidden, "vocab_size": 248_320},
        "taps": {"layer_ids": list(range(n_taps)), "meaning": "id i = output of decoder layer i = hidden_states[i+1]"},
        "dtype": "bfloat16",
        "topk": topk,
    }


_MOMENTS: dict = {}  # the calibration sums (and their eigendecomposition) are shared by every projected tier


def fit(samples, spec_text: str, n_taps: int, hidden: int, multiple: int):
    if id(samples) not in _MOMENTS:
        moments = SecondMoments(n_taps, hidden)
        for sample in samples[: max(1, len(samples) // 2)]:
            moments.add(torch.from_numpy(sample.hidden).view(torch.bfloat16))
        _MOMENTS[id(samples)] = moments
    return fit_projection(_MOMENTS[id(samples)], parse_projection_spec(spec_text), multiple=multiple)


def massive_channels(samples, n_taps: int, hidden: int, per_tap: int = 4) -> list[np.ndarray]:
    """Per tap, the `per_tap` channels of largest mean |x| (the massive activations)."""
    total = np.zeros(n_taps * hidden)
    for sample in samples:
        total += np.abs(torch.from_numpy(sample.hidden).view(torch.bfloat16).float().numpy()).sum(0)
    return [np.argsort(-block)[:per_tap] for block in np.split(total, n_taps)]


def stored_raw_bytes(hidden) -> int:
    return hidden.nbytes if isinstance(hidden, QuantizedHidden) else int(hidden.nbytes)


def bench_tier(samples, tier: str, root: str, n_taps: int, hidden: int, topk: int, massive) -> dict:
    encoding, projection_text = parse_tier(tier)
    spec = parse_encoding(encoding)
    multiple = spec.group_size if spec is not None and spec.four_bit else 1
    projection = fit(samples, projection_text, n_taps, hidden, multiple) if projection_text else None
    width = projection.out_width if projection else n_taps * hidden
    entry = save_projection(root, projection) if projection else None
    error = ErrorSums.zeros(n_taps * hidden)
    encode_s, raw_stored, tokens = 0.0, 0, 0
    encoded = []
    for sample in samples:
        start = time.process_time()
        stored, sums = encode_features(
            torch.from_numpy(sample.hidden).view(torch.bfloat16), encoding, n_taps, projection
        )
        encode_s += time.process_time() - start
        if sums is not None:
            error.add(sums)
        raw_stored += stored_raw_bytes(stored)
        tokens += sample.n_tokens
        encoded.append((sample, stored))
    with ShardWriter(
        root,
        provenance=provenance_for(n_taps, hidden, topk),
        hidden_width=width,
        topk=topk,
        hidden_encoding=encoding,
        use_threads=False,
        shard_bytes=1 << 34,
        projection=entry,
    ) as writer:
        for sample, stored in encoded:
            writer.write(dataclass_replace(sample, stored), hidden_known_finite=True)
    ds = ShardDataset(root)
    shard_bytes = sum(e["bytes"] + e["index_bytes"] for e in ds.shards)
    start = time.process_time()
    for i in range(len(ds)):
        ds.torch(i)  # dequantized to bf16 on the CPU (eval, inspect)
    read_s = time.process_time() - start
    start = time.process_time()
    for i in range(len(ds)):
        ds.compact(i)  # as the trainer's loader reads a quantized dataset (dequantized later, on the device)
    compact_s = time.process_time() - start
    raw = raw_bytes_per_token(n_taps * hidden, topk)
    other = (raw["all"] - raw["hidden"]) * tokens  # ids, mask and top-k stored alongside, before zstd
    result = {
        "tier": tier,
        "encoding": encoding,
        "projection": projection_text,
        "width": width,
        "tokens": tokens,
        "bytes_per_token": shard_bytes / tokens,
        "ratio_to_raw_bf16": shard_bytes / tokens / raw["hidden"],
        "unzstd_bytes_per_token": (raw_stored + other) / tokens,
        "zstd_saving": 1 - shard_bytes / (raw_stored + other),
        "encode_us_per_token": encode_s / tokens * 1e6,
        "read_us_per_token": read_s / tokens * 1e6,
        "read_compact_us_per_token": compact_s / tokens * 1e6,
        "explained": projection.info["explained"] if projection else None,
    }
    if error.tokens:
        result["taps"] = error.summary(n_taps)
        rel_c = np.sqrt(error.err2 / np.maximum(error.sq, 1e-300))
        massive_idx = np.concatenate([m + t * hidden for t, m in enumerate(massive)])
        result["massive_channels_rel_rms"] = float(np.sqrt(error.err2[massive_idx].sum() / error.sq[massive_idx].sum()))
        if spec is not None and spec.four_bit and projection is None:
            G = spec.group_size
            neighbours = np.unique(np.concatenate([np.arange(c // G * G, c // G * G + G) for c in massive_idx]))
            neighbours = np.setdiff1d(neighbours, massive_idx)
            result["massive_group_neighbours_median_rel_rms"] = (
                float(np.median(rel_c[neighbours])) if neighbours.size else None
            )
            others = np.setdiff1d(np.arange(n_taps * hidden), np.concatenate([neighbours, massive_idx]))
            result["other_channels_median_rel_rms"] = (
                float(np.median(rel_c[others])) if others.size else None
            )  # every group holds one
    return result


def dataclass_replace(sample, hidden):
    import dataclasses

    return dataclasses.replace(sample, hidden=hidden)


def load_dataset_samples(path: str, limit: int | None):
    ds = ShardDataset(path)
    if ds.quant is not None or ds.projection is not None:
        raise SystemExit(f"--dataset {path}: needs a lossless, unprojected dataset (it is {ds.encoding})")
    n = len(ds) if limit is None else min(limit, len(ds))
    taps = ds.provenance.taps.layer_ids or [0]
    return [ds[i] for i in range(n)], len(taps), ds.hidden_width // len(taps), ds.topk


def format_table(results: list[dict]) -> list[str]:
    lines = [
        "| tier | bytes/token | vs raw bf16 | without zstd | zstd saves | rel. RMS per tap | worst channel rel. RMS "
        "| massive ch. | their 4-bit group (median) | other ch. (median) | encode µs/tok | read bf16 µs/tok | "
        "read compact µs/tok |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        taps = r.get("taps")
        rel = " / ".join(f"{t['rel_rms']:.4f}" for t in taps) if taps else "0 (exact)"
        worst = max((t["worst_channel_rel_rms"] for t in taps or []), default=0.0)

        def opt(key):  # called in this iteration: its r is this row
            return f"{r[key]:.3f}" if r.get(key) is not None else "-"  # noqa: B023

        lines.append(
            f"| {r['tier']} | {r['bytes_per_token']:,.0f} | {r['ratio_to_raw_bf16']:.3f} | "
            f"{r['unzstd_bytes_per_token']:,.0f} | "
            f"{r['zstd_saving']:.1%} | {rel} | {worst:.3f} | {opt('massive_channels_rel_rms')} | "
            f"{opt('massive_group_neighbours_median_rel_rms')} | {opt('other_channels_median_rel_rms')} | "
            f"{r['encode_us_per_token']:.1f} | {r['read_us_per_token']:.1f} | {r['read_compact_us_per_token']:.1f} |"
        )
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.shard_tiers", description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=512, help="mean tokens per synthetic sample")
    p.add_argument("--taps", type=int, default=4)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--topk", type=int, default=32)
    p.add_argument(
        "--tiers",
        default=None,
        help="comma list (default: lossless, fp8, 4-bit group sizes, projections to H/4 and H/8)",
    )
    p.add_argument("--dataset", default=None, help="use the samples of this lossless dataset instead of synthetic ones")
    p.add_argument("--max-samples", type=int, default=None, help="with --dataset: at most this many samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    pa.set_cpu_count(1)
    if args.dataset:
        samples, n_taps, hidden, topk = load_dataset_samples(args.dataset, args.max_samples)
        source = f"dataset {args.dataset}"
    else:
        n_taps, hidden, topk = args.taps, args.hidden, args.topk
        samples = realistic_samples(args.samples, args.tokens, n_taps, hidden, topk, seed=args.seed)
        source = f"synthetic features (benchmarks/synthetic.py, seed {args.seed})"
    tiers = (args.tiers or DEFAULT_TIERS.format(q=hidden // 4, e=hidden // 8)).split(",")
    massive = massive_channels(samples, n_taps, hidden)
    scratch = tempfile.mkdtemp(prefix="bench-tiers-")
    started = time.time()
    results = []
    try:
        for i, tier in enumerate(tiers):
            results.append(bench_tier(samples, tier, os.path.join(scratch, f"t{i}"), n_taps, hidden, topk, massive))
            print(f"  done: {tier}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tokens = sum(s.n_tokens for s in samples)
    raw = raw_bytes_per_token(n_taps * hidden, topk)
    print(
        f"\n{len(samples)} samples, {tokens} tokens of {source}; {n_taps} taps x {hidden} + top-{topk}; raw bf16 "
        "hidden "
        f"{raw['hidden']} B/token; zstd level 1; one thread, CPU-seconds; "
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, pyarrow {pa.__version__}, {time.time() - started:.0f} s wall"
    )
    print("\n".join(format_table(results)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"source": source, "tokens": tokens, "n_taps": n_taps, "hidden": hidden, "results": results},
                f,
                indent=1,
            )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.shard_tiers", main))
