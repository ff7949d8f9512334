"""`python -m benchmarks.target_checks`: what the target checks of `make drafter`'s first step cost, and
the stored logits through the model's own forward against the old head-and-scalings copy.

    xxh3      xxh3-128 over 1 GiB in memory (`--gib` GiB), then `target.file_digests.file_digest` of a
              file of that size written here (read and hash; then again, from the cache)
    target    with `--target DIR`: its weights' content digest (`target.identity.weights_content_digest`,
              first and cached), loading it (`--dtype`, `--device`) and its self-check (`target.self_check`)
    head      `extract.capture.final_topk` of 2048 positions (chunks of 1024) on a random 2-layer Qwen3
              of `--head-shape HIDDEN,VOCAB`, through `target.head.OwnHead` (the model's own forward)
              and through its fallback (`lm_head` and the known scalings: what extraction ran before),
              alternated, medians of 12

    OMP_NUM_THREADS=1 python -m benchmarks.target_checks                 # this machine's hashing, seconds
    python -m benchmarks.target_checks --target /models/Qwen3.6-27B --device cuda --dtype bfloat16
    OMP_NUM_THREADS=1 python -m benchmarks.target_checks --gib 0 --head-shape 512,32768

Not a test: the numbers depend on the machine and its load; printed as one JSON line with the date,
command and machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

import xxhash

from common.interrupts import run_main


def hashing(gib: int) -> dict:
    from target import file_digests

    block = os.urandom(1 << 30)
    start = time.perf_counter()
    xxhash.xxh3_128(block).hexdigest()
    memory = 1 / (time.perf_counter() - start)
    with tempfile.TemporaryDirectory() as work:
        os.environ[file_digests.CACHE_ENV] = os.path.join(work, "cache")
        path = os.path.join(work, "weights.safetensors")
        with open(path, "wb") as f:
            for _ in range(gib):
                f.write(block)
        start = time.perf_counter()
        file_digests.file_digest(path)
        first = time.perf_counter() - start
        start = time.perf_counter()
        file_digests.file_digest(path)
        cached = time.perf_counter() - start
    return {
        "xxh3_memory_gib_s": round(memory, 2),
        "file_gib": gib,
        "file_first_s": round(first, 2),
        "file_gib_s": round(gib / first, 2),
        "file_cached_ms": round(cached * 1000, 2),
    }


def target_costs(path: str, dtype: str, device: str) -> dict:
    from target.identity import weights_content_digest
    from target.load import load_target
    from target.self_check import self_check

    timings = {}
    for label in ("digest_first_s", "digest_cached_s"):
        start = time.perf_counter()
        weights_content_digest(path)
        timings[label] = round(time.perf_counter() - start, 2)
    placement = {"device_map": "auto"} if device == "cuda" else {"device": device}
    start = time.perf_counter()
    target = load_target(path, dtype=dtype, attn_implementation="sdpa", **placement)
    timings["load_s"] = round(time.perf_counter() - start, 2)
    checked = self_check(target)
    timings["self_check_s"] = round(checked.seconds, 2)
    timings["self_check_passed"] = not checked.failed
    timings["checks"] = {c.name: c.value for c in checked.checks if c.value is not None}
    return timings


def head_costs(shape: str) -> dict:
    import statistics

    import torch
    import transformers

    from extract.capture import final_topk
    from target.head import FALLBACK, OWN
    from target.load import reach_text_parts

    hidden, vocab = (int(x) for x in shape.split(","))
    config = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
    )
    torch.manual_seed(0)
    target = reach_text_parts(transformers.AutoModelForCausalLM.from_config(config).eval())
    hidden_NH = torch.randn(2048, hidden)
    seconds: dict[str, list[float]] = {OWN: [], FALLBACK: []}
    for _ in range(12):
        for path in (OWN, FALLBACK):
            target.logits_fn.path = path
            start = time.perf_counter()
            final_topk(target, hidden_NH, 8, 1024)
            seconds[path].append(time.perf_counter() - start)
    own, fallback = statistics.median(seconds[OWN]), statistics.median(seconds[FALLBACK])
    return {
        "head_shape": shape,
        "own_forward_ms": round(own * 1000, 1),
        "lm_head_and_scalings_ms": round(fallback * 1000, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.target_checks", description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=4, help="size of the file hashed (GiB)")
    parser.add_argument("--target", default="", help="a target directory: its digest, load and self-check")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--head-shape", default="", help="HIDDEN,VOCAB: time the stored logits' two paths")
    args = parser.parse_args(argv)
    record = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m benchmarks.target_checks " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        **(hashing(args.gib) if args.gib else {}),
    }
    if args.target:
        record["target"] = {"path": args.target, "dtype": args.dtype, "device": args.device}
        record.update(target_costs(args.target, args.dtype, args.device))
    if args.head_shape:
        record.update(head_costs(args.head_shape))
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.target_checks", main))
