"""Throughput of the training data stream with the GPU step stubbed out (a benchmark, not a test).

    python -m benchmarks.train_data                                  # scaled-down width, runs on a laptop
    python -m benchmarks.train_data --width 20480 --samples 300      # Qwen3.6-27B: 4 taps x 5120
    python -m benchmarks.train_data --threads 1,2,4,8 --step-ms 800  # simulate an 800 ms GPU step

Writes a synthetic dataset with `shards.ShardWriter` (the skewed length mix of the old runs, bf16
hidden states drawn from a normal distribution so their exponent bytes compress like real ones),
then, for each thread count, measures: time to first batch (opening the dataset, planning and the
first batch), batches/s, real and padded tokens/s, hidden-state GB/s, CPU seconds per batch (all
threads; a measure that other load on a shared machine barely moves) and, with `--step-ms`, the
fetch fraction (time blocked in `next()` / wall time), whose target is <= 2% of step time.
The dataset is read back right after writing, so reads hit the page cache (warm).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np
import torch

from common.hashing import sample_id as make_sample_id
from common.interrupts import run_main
from shards import TAP_MEANING, Sample, ShardDataset, ShardWriter
from train.data import DataConfig, DataStream
from train.stored_features import hidden_nbytes

HIDDEN_SIZE_PER_TAP = 5120  # Qwen3.6-27B; --width 20480 = its 4 taps
VOCAB = 248320


def skewed_lengths(n: int, seed: int, max_len: int) -> np.ndarray:
    """The old runs' mix: 60% <= 512, 15% <= 1024, 5% <= 2048, 20% long (scaled to max_len)."""
    rng = np.random.default_rng(seed)
    parts = [(0.60, 32, 512), (0.15, 513, 1024), (0.05, 1025, 2048), (0.20, 2049, 3072)]
    scale = max_len / 3072
    lengths = np.concatenate(
        [rng.integers(max(2, int(lo * scale)), int(hi * scale) + 1, int(round(s * n))) for s, lo, hi in parts]
    )
    return rng.permutation(lengths)


def synthetic_sample(n: int, T: int, width: int, topk: int, rng: np.random.Generator) -> Sample:
    input_ids = rng.integers(0, VOCAB, T).astype(np.int32)
    input_ids[0] = n % VOCAB
    loss_mask = (np.arange(T) >= T // 4).astype(np.uint8)
    hidden_f32 = rng.standard_normal((T, width), dtype=np.float32)
    hidden_bf16 = torch.from_numpy(hidden_f32).to(torch.bfloat16).view(torch.uint16).numpy()
    logprobs = -np.sort(rng.exponential(2.0, (T, topk)).astype(np.float32), axis=1)  # <= 0, descending
    return Sample(
        make_sample_id(input_ids, loss_mask),
        input_ids,
        loss_mask,
        hidden_bf16,
        rng.integers(0, VOCAB, (T, topk)).astype(np.int32),
        np.ascontiguousarray(logprobs),
    )


def write_synthetic(root: str, *, samples: int, width: int, topk: int, max_len: int, seed: int) -> float:
    """Write the dataset; returns seconds taken."""
    n_taps = max(1, width // HIDDEN_SIZE_PER_TAP) if width % HIDDEN_SIZE_PER_TAP == 0 else 1
    provenance = {
        "target": {
            "name_or_path": "synthetic",
            "revision": None,
            "config_hash": "synthetic",
            "architecture": "synthetic",
            "model_type": "synthetic",
            "num_layers": 64,
            "hidden_size": width // n_taps,
            "vocab_size": VOCAB,
        },
        "tokenizer": {
            "hash": "synthetic",
            "chat_template_hash": None,
            "mask_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
        },
        "taps": {"layer_ids": list(range(1, 1 + n_taps)), "meaning": TAP_MEANING},
        "dtype": "bfloat16",
        "topk": topk,
        "max_len": max_len,
    }
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    with ShardWriter(root, provenance=provenance, hidden_width=width, topk=topk) as writer:
        for n, T in enumerate(skewed_lengths(samples, seed, max_len)):
            writer.write(synthetic_sample(n, int(T), width, topk, rng))
    return time.perf_counter() - start


def measure(
    root: str, *, threads: int, depth: int, budget: int, batches: int, step_s: float, fetch: int = 0, warmup: int = 0
) -> dict:
    """The data stream over `batches` batches with a stubbed step of `step_s` seconds (`fetch`: the
    stream's fetch_threads, 0 = auto; `benchmarks.object_store` measures object stores with it),
    after the first batch and `warmup` more untimed steps (a trainer's warmup steps: on an object
    store, the first reads of each shard also fetch its size and footer)."""
    cfg = DataConfig(
        shards=root,
        holdout_fraction=0.0,
        boundaries=[512, 1024, 2048],
        token_budget=budget,
        prefetch_threads=threads,
        prefetch_depth=max(depth, threads),
        fetch_threads=fetch,
    )
    start = time.perf_counter()
    stream = DataStream(cfg)
    first = next(stream)
    time_to_first = time.perf_counter() - start
    for _ in range(warmup):
        next(stream)
        if step_s:
            time.sleep(step_s)
    real = padded = hidden_bytes = samples = 0
    stream.total_wait = 0.0
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(batches):
        batch = next(stream)
        real += batch.real_tokens
        padded += batch.padded_tokens
        samples += len(batch.sample_ids)
        hidden_bytes += hidden_nbytes(batch.hidden)  # compact bytes for a quantized dataset
        if step_s:
            time.sleep(step_s)  # the GPU step, stubbed; sleeping releases the GIL as a CUDA step would
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start  # all threads; unlike wall time, barely moved by other load
    stream.close()
    del first
    return {
        "threads": threads,
        "depth": max(depth, threads),
        "time_to_first_batch_s": round(time_to_first, 3),
        "batches_per_s": round(batches / wall, 3),
        "step_s_mean": round(wall / batches, 4),
        "samples_per_batch": round(samples / batches, 2),
        "real_tokens_per_s": round(real / wall),
        "padded_tokens_per_s": round(padded / wall),
        "hidden_GB_per_s": round(hidden_bytes / wall / 1e9, 3),
        "fetch_frac": round(stream.total_wait / wall, 4),
        "cpu_s_per_batch": round(cpu / batches, 3),
        "real_tokens_per_cpu_s": round(real / cpu),
        "steps_per_epoch": stream.steps_per_epoch,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--width", type=int, default=1024, help="hidden width n_taps x H (default scaled down; 20480 = Qwen3.6-27B)"
    )
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--samples", type=int, default=400, help="samples in the synthetic dataset")
    parser.add_argument("--max-len", type=int, default=3072, help="longest sample; the length mix is scaled to it")
    parser.add_argument("--budget", type=int, default=49152, help="token budget per batch")
    parser.add_argument("--threads", default="1,2,4", help="comma-separated prefetch thread counts")
    parser.add_argument("--depth", type=int, default=4, help="prefetch depth (raised to the thread count if lower)")
    parser.add_argument("--batches", type=int, default=40, help="batches measured per thread count, after the first")
    parser.add_argument(
        "--step-ms", type=float, default=0.0, help="simulated GPU step per batch; 0 = raw stream throughput"
    )
    parser.add_argument(
        "--root", default=None, help="dataset directory (reused if it holds a manifest); default: a temp dir"
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)

    root = args.root or tempfile.mkdtemp(prefix="bench_data_")
    try:
        if not os.path.exists(os.path.join(root, "manifest.json")):
            seconds = write_synthetic(
                root, samples=args.samples, width=args.width, topk=args.topk, max_len=args.max_len, seed=0
            )
            print(f"wrote {args.samples} samples, width {args.width}, in {seconds:.1f}s to {root}")
        ds = ShardDataset(root)
        on_disk = sum(e["bytes"] for e in ds.manifest["shards"])
        tokens = int(ds.n_tokens.sum())
        print(
            f"dataset: {len(ds)} samples, {tokens} tokens, width {ds.hidden_width}, {on_disk / 1e9:.2f} GB on disk "
            f"({on_disk / tokens:.0f} B/token); torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}"
        )
        results = []
        for threads in [int(t) for t in args.threads.split(",")]:
            row = measure(
                root,
                threads=threads,
                depth=args.depth,
                budget=args.budget,
                batches=args.batches,
                step_s=args.step_ms / 1000,
            )
            results.append(row)
            print(json.dumps(row))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {"args": vars(args), "bytes_on_disk": on_disk, "tokens": tokens, "results": results}, f, indent=2
                )
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.train_data", main))
