"""Format benchmark (not a test): size and speed of the shard format against one-file-per-sample
storage, on synthetic samples shaped like the Qwen3.6-27B case (4 taps x 5120 bf16 + top-32).

    make bench-shards ARGS="--samples 8 --tokens 512"
    python -m benchmarks.shards [--samples N] [--tokens T] [--taps 4] [--hidden 5120] [--topk 32]
                           [--levels 1,3,6] [--splits 1,4] [--repeats 2] [--dir DIR] [--no-gzip]

For each zstd level, with and without byte planes, unsplit and in column pieces (`hidden_split`), it
writes the samples with `ShardWriter` and reads every sample back with `ShardDataset.torch` into a
preallocated batch buffer (hidden states are decoded straight into it; the other fields are copied),
as a trainer's collate does, with the per-sample checksums checked (the default) and, in alternating
passes, without them: the "per-sample check" column is the extra read time. The last lines time
xxh3-64 and xxh3-128 over the record-batch bytes alone. The same samples are also stored one file
per sample with `torch.save` (SpecForge; optionally gzip level 6, SpecForge's `--compress`) and with
safetensors (speculators), and read back the same way.

Honest numbers: everything runs on one thread (torch, pyarrow and the writer), and speeds are per
CPU-second of this process (`time.process_time`), so other load on a shared machine does not
inflate them. Reads come from the page cache (the files were just written): disk bandwidth is not
measured; on a disk-bound reader the bytes/token column is what matters.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import io as pyio
import os
import platform
import shutil
import tempfile
import time

import pyarrow as pa
import torch
from safetensors.torch import load_file, save_file

from benchmarks.synthetic import realistic_samples
from common.interrupts import run_main
from shards.describe import raw_bytes_per_token
from shards.manifest import read_index
from shards.reader import ShardDataset
from shards.sample_checksums import SampleRanges
from shards.schema import Sample
from shards.writer import ShardWriter


@dataclasses.dataclass
class Result:
    name: str
    stored_bytes: int
    files: int
    write_cpu_s: float
    read_cpu_s: float  # per pass over all samples (shards: per-sample checksums checked, the default)
    read_unchecked_cpu_s: float | None = None  # shards: the same pass with verify_samples=False


def _tensors(sample: Sample) -> dict[str, torch.Tensor]:
    """A sample as the torch tensors a one-file-per-sample store keeps (hidden in bf16)."""
    return {
        "input_ids": torch.from_numpy(sample.input_ids),
        "loss_mask": torch.from_numpy(sample.loss_mask),
        "hidden_states": torch.from_numpy(sample.hidden).view(torch.bfloat16),
        "topk_ids": torch.from_numpy(sample.topk_ids),
        "topk_logprobs": torch.from_numpy(sample.topk_logprobs),
    }


class Collate:
    """Preallocated buffers that every reader's tensors end up in, as in a trainer's batch."""

    def __init__(self, max_tokens: int, width: int, topk: int):
        self.hidden = torch.empty(max_tokens, width, dtype=torch.bfloat16)
        self.topk_ids = torch.empty(max_tokens, topk, dtype=torch.int32)
        self.topk_logprobs = torch.empty(max_tokens, topk, dtype=torch.float32)
        self.input_ids = torch.empty(max_tokens, dtype=torch.int32)
        self.loss_mask = torch.empty(max_tokens, dtype=torch.bool)

    def take(self, hidden, topk_ids, topk_logprobs, input_ids, loss_mask) -> int:
        T = hidden.shape[0]
        if hidden.data_ptr() != self.hidden.data_ptr():
            self.hidden[:T].copy_(hidden.reshape(T, -1))
        self.topk_ids[:T].copy_(topk_ids)
        self.topk_logprobs[:T].copy_(topk_logprobs)
        self.input_ids[:T].copy_(input_ids)
        self.loss_mask[:T].copy_(loss_mask)
        return T


def _dir_bytes(path: str) -> tuple[int, int]:
    names = [n for n in os.listdir(path) if not n.endswith(".json")]
    return sum(os.path.getsize(os.path.join(path, n)) for n in names), len(names)


def _cpu_time(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def bench_shards(samples, root, encoding, level, collate, repeats, split: int = 1) -> Result:
    width, topk = samples[0].hidden.shape[1], samples[0].topk_ids.shape[1]

    def write():
        with ShardWriter(
            root,
            provenance={},
            hidden_width=width,
            topk=topk,
            zstd_level=level,
            hidden_encoding=encoding,
            use_threads=False,
            shard_bytes=1 << 34,
            hidden_split=split,
        ) as w:
            for sample in samples:
                w.write(sample)

    def read(verify_samples: bool):
        ds = ShardDataset(root, verify_samples=verify_samples)
        for i in range(len(ds)):
            t = ds.torch(i, hidden_out=collate.hidden)  # decodes into the buffer: the copy below is a no-op
            collate.take(t["hidden"], t["topk_ids"], t["topk_logprobs"], t["input_ids"], t["loss_mask"])

    write_s = _cpu_time(write)
    # Alternating passes, so a change in machine load hits both alike; the fastest of each counts.
    checked, unchecked = [], []
    for _ in range(repeats):
        checked.append(_cpu_time(lambda: read(True)))
        unchecked.append(_cpu_time(lambda: read(False)))
    stored, files = _dir_bytes(root)
    name = f"shards zstd-{level} {encoding}" + (f", {split} pieces" if split > 1 else "")
    return Result(name, stored, files, write_s, min(checked), min(unchecked))


def hash_speeds(root: str, repeats: int) -> dict[str, float]:
    """GB per CPU-second of xxh3-64 and xxh3-128 over every sample's record-batch bytes (page cache)."""
    import xxhash

    ds = ShardDataset(root)
    buffers = []
    for entry in ds.shards:
        path = os.path.join(root, entry["file"])
        ranges = SampleRanges.from_index(read_index(ds.fs, ds.root, entry), entry["bytes"], entry["index_file"])
        source = pa.memory_map(path)
        buffers += [ranges.read(source, row, path) for row in range(entry["samples"])]
    total = sum(b.size for b in buffers)
    speeds = {}
    for name, fn in (("xxh3_64", xxhash.xxh3_64_intdigest), ("xxh3_128", xxhash.xxh3_128_intdigest)):
        seconds = min(_cpu_time(lambda fn=fn: [fn(b) for b in buffers]) for _ in range(max(3, repeats)))
        speeds[name] = total / 1e9 / seconds
    return speeds


def bench_torch_save(samples, root, collate, repeats, gzip_level=None) -> Result:
    os.makedirs(root)
    suffix = ".ckpt.gz" if gzip_level else ".ckpt"
    paths = [os.path.join(root, f"data_{i}{suffix}") for i in range(len(samples))]

    def write():
        for sample, path in zip(samples, paths, strict=True):
            if gzip_level:
                with gzip.open(path, "wb", compresslevel=gzip_level) as f:
                    torch.save(_tensors(sample), f)
            else:
                torch.save(_tensors(sample), path)

    def load(path):
        if gzip_level:
            with gzip.open(path, "rb") as f:
                return torch.load(pyio.BytesIO(f.read()), weights_only=True)
        return torch.load(path, mmap=True, weights_only=True)

    def read():
        for path in paths:
            t = load(path)
            collate.take(t["hidden_states"], t["topk_ids"], t["topk_logprobs"], t["input_ids"], t["loss_mask"])

    write_s = _cpu_time(write)
    read_s = min(_cpu_time(read) for _ in range(repeats))
    stored, files = _dir_bytes(root)
    return Result(
        f"torch.save per sample{f' + gzip-{gzip_level}' if gzip_level else ''}", stored, files, write_s, read_s
    )


def bench_safetensors(samples, root, collate, repeats) -> Result:
    os.makedirs(root)
    paths = [os.path.join(root, f"hs_{i}.safetensors") for i in range(len(samples))]

    def write():
        for sample, path in zip(samples, paths, strict=True):
            save_file(_tensors(sample), path)

    def read():
        for path in paths:
            t = load_file(path)
            collate.take(t["hidden_states"], t["topk_ids"], t["topk_logprobs"], t["input_ids"], t["loss_mask"])

    write_s = _cpu_time(write)
    read_s = min(_cpu_time(read) for _ in range(repeats))
    stored, files = _dir_bytes(root)
    return Result("safetensors per sample", stored, files, write_s, read_s)


def _warm_up(samples, root, collate) -> None:
    """One untimed pass of every code path, so lazy imports and first-call setup are not timed."""
    bench_shards(samples, os.path.join(root, "shards"), "planes", 1, collate, 1)
    bench_torch_save(samples, os.path.join(root, "torch"), collate, 1)
    bench_safetensors(samples, os.path.join(root, "safetensors"), collate, 1)


def format_table(results: list[Result], tokens: int, raw: dict[str, int]) -> list[str]:
    raw_total = tokens * raw["all"]
    lines = [
        "| format | bytes/token | vs raw bf16 hidden | vs raw all fields | write MB/s per core | read+decode "
        "tok/s per core "
        "| per-sample check | files |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        per_token = r.stored_bytes / tokens
        check = (
            "-"
            if r.read_unchecked_cpu_s is None
            else (
                f"+{(r.read_cpu_s - r.read_unchecked_cpu_s) / r.read_unchecked_cpu_s:.1%} "
                f"({(r.read_cpu_s - r.read_unchecked_cpu_s) / tokens * 1e6:.2f} us/token)"
            )
        )
        lines.append(
            f"| {r.name} | {per_token:,.0f} | {per_token / raw['hidden']:.3f} | {per_token / raw['all']:.3f} | "
            f"{raw_total / 1e6 / r.write_cpu_s:,.0f} | {tokens / r.read_cpu_s:,.0f} | {check} | {r.files} |"
        )
    return lines


def _parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.shards", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--samples", type=int, default=8, help="number of samples (default 8)")
    p.add_argument(
        "--tokens", type=int, default=512, help="mean tokens per sample; lengths span 0.5x-1.5x (default 512)"
    )
    p.add_argument("--taps", type=int, default=4)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--topk", type=int, default=32)
    p.add_argument(
        "--levels", default="1,3,6", help="zstd levels, comma separated (the first one's data also times the hashes)"
    )
    p.add_argument(
        "--splits",
        default=None,
        help="hidden_split values, comma separated (column pieces per hidden plane; default: 1 and one per tap)",
    )
    p.add_argument("--repeats", type=int, default=2, help="read passes; the fastest is reported")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed at the end)")
    p.add_argument("--no-gzip", action="store_true", help="skip the slow torch.save + gzip baseline")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    torch.set_num_threads(1)
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    levels = [int(level) for level in args.levels.split(",")]
    splits = [int(x) for x in args.splits.split(",")] if args.splits else sorted({1, args.taps})
    width = args.taps * args.hidden
    samples = realistic_samples(args.samples, args.tokens, args.taps, args.hidden, args.topk, seed=args.seed)
    tokens = sum(s.n_tokens for s in samples)
    collate = Collate(max(s.n_tokens for s in samples), width, args.topk)
    raw = raw_bytes_per_token(width, args.topk)
    scratch = args.dir or tempfile.mkdtemp(prefix="bench-shards-")
    started = time.time()
    results = []
    try:
        _warm_up(samples[:1], os.path.join(scratch, "warm-up"), collate)
        for level in levels:
            for encoding in ("plain", "planes"):
                for split in splits:
                    root = os.path.join(scratch, f"z{level}-{encoding}-s{split}")
                    results.append(bench_shards(samples, root, encoding, level, collate, args.repeats, split))
                    print(f"  done: {results[-1].name}", flush=True)
        speeds = hash_speeds(os.path.join(scratch, f"z{levels[0]}-planes-s{splits[0]}"), args.repeats)
        results.append(bench_torch_save(samples, os.path.join(scratch, "torch"), collate, args.repeats))
        if not args.no_gzip:
            results.append(
                bench_torch_save(samples, os.path.join(scratch, "torch-gz"), collate, args.repeats, gzip_level=6)
            )
        results.append(bench_safetensors(samples, os.path.join(scratch, "safetensors"), collate, args.repeats))
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    print()
    print(
        f"{args.samples} samples, {tokens} tokens ({args.tokens} mean), {args.taps} taps x {args.hidden} bf16 + "
        f"top-{args.topk}; "
        f"raw {raw['hidden']} B/token hidden, {raw['all']} B/token all fields"
    )
    print(
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} logical CPUs, pyarrow {pa.__version__}, torch {torch.__version__}; one thread; "
        f"speeds per CPU-second; {time.time() - started:.0f} s wall"
    )
    print("\n".join(format_table(results, tokens, raw)))
    print(
        f"per-sample checksum alone, over the zstd-{levels[0]} planes record batches from the page cache: "
        + ", ".join(f"{name} {gbps:.1f} GB/s" for name, gbps in speeds.items())
        + " per core"
    )


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.shards", main))
