"""Training from an object store: the data stream's fetch fraction with S3 request latency (a
benchmark, not a test).

    python -m benchmarks.object_store                                   # small width, CPU, a few minutes
    python -m benchmarks.object_store --width 20480 --samples 300 --step-ms 800 --delays-ms 0,20,80   # 27B widths

Writes a synthetic dataset (`benchmarks.train_data.write_synthetic`: the old runs' length mix,
Gaussian bf16 hidden states) on local disk, copies it into a `moto_server` on loopback, and reads
it through `train.data.DataStream` from local disk, then from S3 through `DelayProxy` (a TCP proxy
that holds every request for the given latency before forwarding it) for each `--delays-ms`. The
GPU step is stubbed with a sleep of `--step-ms` (it releases the GIL as a CUDA step does). Per
source: fetch fraction (time blocked in `next()` / wall time; goal <= 2%), the mean step time
(sleep + wait) against local disk, batches/s, hidden GB/s and S3 requests per batch.

moto keeps objects in the server's memory: keep the dataset within a few GB.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from benchmarks.s3_server import DelayProxy, MotoServer
from benchmarks.train_data import measure, skewed_lengths, synthetic_sample, write_synthetic
from common.interrupts import run_main


def write_dataset(root: str, *, samples: int, width: int, topk: int, max_len: int, shard_bytes: int) -> float:
    """`write_synthetic`'s dataset with `shard_bytes` shards (moto reads a whole object to serve a
    range, so shards much larger than a batch make moto, not the network, the bottleneck)."""
    import numpy as np

    from shards import ShardWriter

    staging = root + ".staging"
    write_synthetic(staging, samples=2, width=width, topk=topk, max_len=64, seed=0)  # for the provenance only
    from shards import ShardDataset

    provenance = ShardDataset(staging).manifest["provenance"]  # the record as stored
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    with ShardWriter(root, provenance=provenance, hidden_width=width, topk=topk, shard_bytes=shard_bytes) as writer:
        for n, T in enumerate(skewed_lengths(samples, 0, max_len)):
            writer.write(synthetic_sample(n, int(T), width, topk, rng))
    return time.perf_counter() - start


def copy_to_s3(local: str, uri: str, threads: int = 8) -> dict:
    """Copy the directory tree `local` to `uri`, one PutObject per file (botocore), `threads` at a
    time; returns {"files", "bytes", "seconds", "MB_per_s"}.

    Not `pyarrow.fs.copy_files`: its multipart uploads send aws-chunked bodies, which moto_server
    decodes in Python at a few tens of MB/s (`benchmarks.s3_ceiling`: 6.2 GB of shards did not fit
    in 300 s on the H200 host); a PutObject body is stored as it comes. The objects hold the same
    bytes either way, and this copy is setup, not what a benchmark measures."""
    from concurrent.futures import ThreadPoolExecutor

    from common import io
    from common.objstore import s3_client

    fs, path = io.resolve(uri)
    client = s3_client(fs)
    bucket, _, prefix = path.partition("/")
    files = sorted(os.path.join(d, name) for d, _, names in os.walk(local) for name in names)

    def put(file: str) -> int:
        key = "/".join(p for p in (prefix, os.path.relpath(file, local).replace(os.sep, "/")) if p)
        with open(file, "rb") as body:
            client.put_object(Bucket=bucket, Key=key, Body=body)
        return os.path.getsize(file)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="copy-to-s3") as pool:
        moved = sum(pool.map(put, files))
    seconds = time.perf_counter() - started
    return {
        "files": len(files),
        "bytes": moved,
        "seconds": round(seconds, 3),
        "MB_per_s": round(moved / seconds / 1e6, 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2048, help="hidden width (27B: 20480 = 4 taps x 5120)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--max-len", type=int, default=3072)
    p.add_argument("--budget", type=int, default=16384, help="token budget per batch")
    p.add_argument("--batches", type=int, default=30, help="batches measured per source, after the first")
    p.add_argument("--step-ms", type=float, default=200.0, help="the stubbed GPU step")
    p.add_argument(
        "--warmup", type=int, default=0, help="untimed steps after the first batch (each shard's first read included)"
    )
    p.add_argument("--delays-ms", default="0,20,80", help="S3 request latencies to inject (comma list)")
    p.add_argument("--threads", type=int, default=4, help="data.prefetch_threads")
    p.add_argument("--depth", type=int, default=8, help="data.prefetch_depth")
    p.add_argument("--fetch-threads", type=int, default=0, help="data.fetch_threads (0 = auto: 1 local, 16 S3)")
    p.add_argument("--shard-mb", type=int, default=32, help="shard size (moto serves a range by reading the object)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    delays = [float(d) for d in args.delays_ms.split(",") if d.strip()]
    os.environ.update(MotoServer.env())
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-objstore-") as tmp, MotoServer() as server:
        local = os.path.join(tmp, "ds")
        seconds = write_dataset(
            local,
            samples=args.samples,
            width=args.width,
            topk=args.topk,
            max_len=args.max_len,
            shard_bytes=args.shard_mb << 20,
        )
        server.create_bucket("bench")
        copied = copy_to_s3(local, server.uri("bench/ds"))
        print(
            f"wrote the dataset in {seconds:.1f} s, copied it to moto_server in {copied['seconds']:.1f} s "
            f"({copied['bytes'] / 1e9:.2f} GB, {copied['MB_per_s']:,.0f} MB/s)"
        )
        kw = dict(
            budget=args.budget,
            batches=args.batches,
            step_s=args.step_ms / 1000,
            threads=args.threads,
            depth=args.depth,
            fetch=args.fetch_threads,
            warmup=args.warmup,
        )
        rows.append({"source": "local disk", **measure(local, **kw)})
        print(rows[-1], flush=True)
        for delay in delays:
            with DelayProxy(server.port, delay_s=delay / 1000) as proxy:
                row = measure(proxy.uri("bench/ds"), **kw)
                row["requests_per_batch"] = round(proxy.requests / (args.batches + 1 + args.warmup), 1)
            rows.append({"source": f"S3, {delay:g} ms per request", **row})
            print(rows[-1], flush=True)
    local_step = rows[0]["step_s_mean"]
    print(f"\nwidth {args.width}, {args.samples} samples, budget {args.budget}, step {args.step_ms:g} ms (stubbed)")
    print("| source | fetch fraction | step vs local | batches/s | hidden GB/s | requests/batch | first batch s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['source']} | {r['fetch_frac']:.2%} | {r['step_s_mean'] / local_step:.3f} | {r['batches_per_s']} | "
            f"{r['hidden_GB_per_s']} | {r.get('requests_per_batch', '-')} | {r['time_to_first_batch_s']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.object_store", main))
