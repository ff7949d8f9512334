"""`python -m benchmarks.regenerate` (`make bench-regenerate ARGS=...`): regeneration throughput.

    server  the real `python -m extract.regenerate` run with backend=server against `transformers
            serve` (started here on localhost, CPU, or `--url` of a running endpoint), once per number
            of requests in flight: requests/s and generated tokens/s (a warm-up run first).
            python -m benchmarks.regenerate server --target artifacts/tiny/target \\
                --corpus artifacts/tiny/corpus/heldout.jsonl --in-flight 1,2,4,8
    local   `extract.regenerate.local.generate_batch` on a random-weight target of the exact
            Qwen3.6-27B text shape (built on the GPU in bf16, nothing downloaded; `benchmarks.extract`
            builds it), once per batch size: generated tokens/s (prefill included, and decode alone),
            peak GPU memory. Every row generates exactly --new-tokens (no stop token).
            python -m benchmarks.regenerate local --batch-sizes 16,64,128,256 --out local.json
            python -m benchmarks.regenerate local --shape tiny --device cpu     # CPU smoke run
            --shape smollm2: SmolLM2-135M-Instruct's shape (Llama, 30 layers, hidden 576), float32
            as the real-target pipeline runs it (--dtype to change):
            python -m benchmarks.regenerate local --shape smollm2 --batch-sizes 256,1024 --prompt-len 96
    ops     why `local` decodes the 27B at about 10 steps/s: aten op calls per decoding step of
            `generate_batch` (torch.profiler) and the wall time per step, on the 27B's layout (64
            layers, 3 Gated DeltaNet to 1 attention) at full widths or, with --narrow, at hidden 64
            (the op count does not depend on the widths; on a CPU the time is then almost all
            dispatch); --shape smollm2 for the real target's shape. On CUDA it also prints the
            kernels that take the GPU's time per step and how busy the GPU is (kernel time / wall).
            python -m benchmarks.regenerate ops --narrow --device cpu
            python -m benchmarks.regenerate ops --shape smollm2 --batch 1024 --prompt-len 96 --steps 8

Not a test: numbers depend on the machine. Prints a table and, with --out, JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

from common.interrupts import run_main

SHAPES = ["qwen3.6-27b", "tiny", "smollm2"]
DTYPE_HELP = "auto: float32 for smollm2 (as its pipeline runs), bfloat16 on CUDA otherwise, float32 on a CPU"


CACHE_HELP = "the decoding's KV cache (extract.regenerate.local.batch_decoder; static = CUDA graphs on CUDA)"
TF32_HELP = "float32 matrix products on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32)"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.regenerate", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("server", help="backend=server against transformers serve")
    s.add_argument(
        "--target", default="artifacts/tiny/target", help="checkpoint directory served and used for the tokenizer"
    )
    s.add_argument("--corpus", default="artifacts/tiny/corpus/heldout.jsonl", help="prompts to answer")
    s.add_argument("--records", type=int, default=48, help="records per measurement")
    s.add_argument("--in-flight", default="1,2,4,8", help="requests in flight, comma-separated")
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--url", default=None, help="an endpoint already running (default: start transformers serve here)")
    s.add_argument(
        "--serve-args", default="", help="extra `transformers serve` arguments, e.g. '--continuous-batching'"
    )
    s.add_argument("--out", default=None)
    g = sub.add_parser("local", help="backend=local on a random-weight target")
    g.add_argument("--shape", choices=SHAPES, default="qwen3.6-27b")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help=DTYPE_HELP)
    g.add_argument(
        "--batch-sizes", default="16,64,128,256", help="comma-separated; the sweep stops at the first out-of-memory"
    )
    g.add_argument("--prompt-len", type=int, default=256)
    g.add_argument("--new-tokens", type=int, default=256)
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--caches", default="dynamic,static", help=CACHE_HELP + " (comma-separated: one sweep each)")
    g.add_argument("--tf32", action="store_true", help=TF32_HELP)
    g.add_argument("--out", default=None)
    o = sub.add_parser("ops", help="aten op calls, time and (on CUDA) kernels per decoding step")
    o.add_argument("--shape", choices=["qwen3.6-27b", "smollm2"], default="qwen3.6-27b")
    o.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help=DTYPE_HELP)
    o.add_argument("--narrow", action="store_true", help="the 27B's layers at hidden 64 (for a CPU)")
    o.add_argument("--kernels", type=int, default=12, help="CUDA kernels listed by time per step (CUDA only)")
    o.add_argument("--batch", type=int, default=16)
    o.add_argument("--prompt-len", type=int, default=64)
    o.add_argument("--steps", type=int, default=10, help="decoding steps measured (after 2 that are subtracted)")
    o.add_argument("--device", default="auto", help="auto | cpu | cuda")
    o.add_argument("--cache", default="dynamic", choices=["dynamic", "static"], help=CACHE_HELP)
    o.add_argument("--tf32", action="store_true", help=TF32_HELP)
    o.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.mode == "ops":
        return args
    if args.mode == "server":
        args.in_flight = [int(x) for x in args.in_flight.split(",")]
    else:
        args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
        args.caches = [c for c in args.caches.split(",") if c]
    return args


def set_tf32(on: bool) -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def machine() -> dict:
    import torch
    import transformers

    info = {
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


# ----------------------------------------------------------------------------------------------
# server


def start_serve(target: str, extra: str) -> tuple[subprocess.Popen, str]:
    import socket

    cli = shutil.which("transformers", path=os.path.dirname(sys.executable)) or shutil.which("transformers")
    if cli is None:
        raise SystemExit("bench: the `transformers` command is not installed (pip install 'transformers[serving]')")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Spinning OpenMP threads starve the client (and everything else) on a small shared CPU machine.
    env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
    process = subprocess.Popen(
        [cli, "serve", target, "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), *extra.split()],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None:
            raise SystemExit(f"bench: transformers serve exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return process, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if time.monotonic() > deadline:
                process.kill()
                raise SystemExit("bench: transformers serve did not start in 300 s") from None
            time.sleep(0.5)


def run_server(args) -> dict:
    from common.config import load_config
    from extract.regenerate import run as R
    from extract.regenerate.config import RegenerateConfig

    process, url = (None, args.url) if args.url else start_serve(args.target, args.serve_args)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as work:

            def measure(in_flight: int, records: int, name: str) -> dict:
                words = [
                    f"target={args.target}",
                    f"corpus={args.corpus}",
                    f"out={os.path.join(work, name)}",
                    "backend=server",
                    f"urls={json.dumps([url])}",
                    f"max_new_tokens={args.max_new_tokens}",
                    f"max_in_flight={in_flight}",
                    f"max_records={records}",
                    "progress=false",
                ]
                summary = R.run(load_config(RegenerateConfig, None, words))
                if summary.get("stopped"):
                    raise SystemExit(f"bench: the run stopped: {summary['stopped']}")
                counts = summary["counts"]
                seconds = summary["seconds"]
                requests = summary["requests"] - 1  # the first request of a run checks the endpoint
                return {
                    "in_flight": in_flight,
                    "records": counts["stored"] + counts["rejected"],
                    "requests": requests,
                    "answer_tokens": counts["answer_tokens"],
                    "seconds": seconds,
                    "requests_per_s": requests / seconds,
                    "tokens_per_s": counts["answer_tokens"] / seconds,
                    "answers_at_cap": counts["answers_at_cap"],
                }

            measure(2, min(4, args.records), "warmup")
            for in_flight in args.in_flight:
                rows.append(measure(in_flight, args.records, f"run-{in_flight}"))
                print(format_server_row(rows[-1]), flush=True)
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    return {
        "mode": "server",
        "url": args.url or "transformers serve (started here, CPU)",
        "serve_args": args.serve_args,
        "target": args.target,
        "corpus": args.corpus,
        "max_new_tokens": args.max_new_tokens,
        "rows": rows,
        "machine": machine(),
    }


def format_server_row(row: dict) -> str:
    return (
        f"in flight {row['in_flight']:>3}: {row['requests']:>4} requests, {row['answer_tokens']:>6} tokens in "
        f"{row['seconds']:6.1f} s = "
        f"{row['requests_per_s']:6.2f} requests/s, {row['tokens_per_s']:7.1f} tok/s"
    )


# ----------------------------------------------------------------------------------------------
# local


def run_local(args) -> dict:
    import torch

    from benchmarks.extract import kernel_report
    from extract.regenerate.local import generate_batch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = pick_dtype(args.dtype, args.shape, device)
    started = time.perf_counter()
    target, n_params = random_target(args.shape, device, dtype)
    model = target.model
    build_seconds = time.perf_counter() - started
    vocab = target.vocab_size
    generator = torch.Generator().manual_seed(args.seed)

    def prompts(batch: int) -> list[list[int]]:
        return torch.randint(0, vocab, (batch, args.prompt_len), generator=generator).tolist()

    def timed(batch_prompts, new_tokens: int, cache: str) -> float:
        sync(device)
        t0 = time.perf_counter()
        out = generate_batch(model, batch_prompts, new_tokens, set(), 0, cache=cache)
        sync(device)
        assert all(len(tokens) == new_tokens for tokens, _ in out)
        return time.perf_counter() - t0

    set_tf32(args.tf32)
    rows, caches = [], []
    for cache in args.caches:
        try:
            timed(prompts(2), 4, cache)  # warm-up: kernels for these shapes (Triton autotuning with fla)
        except ValueError as exc:
            print(f"{cache:>7}: {exc}", flush=True)
            continue
        caches.append(cache)
        rows += sweep_local(args, device, cache, prompts, timed)
    same = same_answers(model, prompts(min(args.batch_sizes)), 32) if {"dynamic", "static"} <= set(caches) else None
    if same is not None:
        print(f"static vs dynamic cache, 32 greedy tokens: {same[0]} of {same[1]} rows the same", flush=True)
    best = max((r for r in rows if not r.get("oom")), key=lambda r: r["generated_tokens_per_s"], default=None)
    return {
        "mode": "local",
        "shape": args.shape,
        "device": device,
        "dtype": str(dtype),
        "tf32": args.tf32,
        "static_rows_same_as_dynamic": same,
        "parameters": n_params,
        "build_seconds": build_seconds,
        "rows": rows,
        "best": best,
        "kernels": kernel_report(),
        "machine": machine(),
    }


def same_answers(model, prompts: list[list[int]], new_tokens: int) -> tuple[int, int]:
    """(rows whose greedy answers are the same on both caches, rows)."""
    from extract.regenerate.local import generate_batch

    dynamic, static = (generate_batch(model, prompts, new_tokens, set(), 0, cache=c) for c in ("dynamic", "static"))
    return sum(a == b for a, b in zip(dynamic, static, strict=True)), len(prompts)


def sweep_local(args, device: str, cache: str, prompts, timed) -> list[dict]:
    """One row per batch size with this cache; stops at the first out-of-memory."""
    import torch

    rows = []
    for batch in args.batch_sizes:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        batch_prompts = prompts(batch)
        try:
            prefill = timed(batch_prompts, 1, cache)
            total = timed(batch_prompts, args.new_tokens, cache)
        except torch.OutOfMemoryError:
            rows.append({"cache": cache, "batch": batch, "oom": True})
            print(f"{cache:>7} batch {batch:>4}: out of memory; the sweep stops here", flush=True)
            break
        generated = batch * args.new_tokens
        row = {
            "cache": cache,
            "batch": batch,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "seconds": total,
            "prefill_seconds": prefill,
            "generated_tokens_per_s": generated / total,
            "decode_tokens_per_s": batch * (args.new_tokens - 1) / max(total - prefill, 1e-9),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None,
        }
        rows.append(row)
        print(format_local_row(row), flush=True)
    return rows


# The 27B's layer layout with every width cut down: what `ops --narrow` runs on a CPU.
NARROW = dict(
    hidden_size=64,
    intermediate_size=128,
    head_dim=32,
    num_attention_heads=2,
    num_key_value_heads=1,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    vocab_size=1000,
)


def run_ops(args) -> dict:
    """Aten op calls and wall time per decoding step: the difference between decoding 2 + steps
    and 2 new tokens, divided by steps (the prefill and the first step cancel out)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.extract import kernel_report
    from extract.regenerate.local import generate_batch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = pick_dtype(args.dtype, args.shape, device)
    target, n_params = random_target(args.shape, device, dtype, narrow=args.narrow)
    layers = target.model.config.num_hidden_layers
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, target.vocab_size, (args.batch, args.prompt_len), generator=generator).tolist()

    set_tf32(args.tf32)

    def decode(new_tokens: int) -> None:
        generate_batch(target.model, prompts, new_tokens, set(), 0, cache=args.cache)
        sync(device)

    def op_calls(new_tokens: int) -> tuple[int, int]:
        """(every aten op call, the calls made from Python: those not inside another aten op)."""
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decode(new_tokens)
        aten = [e for e in prof.events() if e.name.startswith("aten::")]
        return len(aten), sum(1 for e in aten if not inside_aten_op(e))

    def seconds(new_tokens: int) -> float:
        # The fastest of three: a step's cost is a difference of two timings, which one slow run (a busy
        # host) can turn negative.
        times = []
        for _ in range(3):
            started = time.perf_counter()
            decode(new_tokens)
            times.append(time.perf_counter() - started)
        return min(times)

    decode(4)  # warm-up (Triton autotuning with fla)
    (many_all, many_top), (few_all, few_top) = op_calls(2 + args.steps), op_calls(2)
    calls, top_calls = (many_all - few_all) / args.steps, (many_top - few_top) / args.steps
    step_s = (seconds(2 + args.steps) - seconds(2)) / args.steps
    if step_s <= 0:
        raise SystemExit(
            f"benchmarks.regenerate ops: {args.steps} more steps did not take measurably longer on this busy host; "
            "rerun with more --steps"
        )
    kernels = cuda_kernels_per_step(decode, args.steps, args.kernels) if device.startswith("cuda") else None
    print(
        f"{calls:,.0f} aten op calls per decoding step ({calls / layers:,.0f} per layer of {layers}), of which "
        f"{top_calls:,.0f} made from Python ({top_calls / layers:,.0f} per layer); "
        f"{step_s * 1e3:.1f} ms per step = {1 / step_s:.1f} steps/s at batch {args.batch} "
        f"({device}, {args.shape}, {'narrow' if args.narrow else 'full'} widths, {n_params / 1e6:,.1f} M "
        f"parameters, {dtype}{', TF32' if args.tf32 else ''}, {args.cache} cache)"
    )
    if kernels is not None:
        busy = kernels["kernel_ms_per_step"] / (step_s * 1e3)
        print(f"GPU kernel time {kernels['kernel_ms_per_step']:.2f} ms per step: the GPU is busy {busy:.0%} of a step")
        for row in kernels["top"]:
            print(f"  {row['ms_per_step']:8.3f} ms/step  {row['calls_per_step']:6.1f} calls  {row['name'][:100]}")
    return {
        "mode": "ops",
        "shape": args.shape,
        "dtype": str(dtype),
        "cuda_kernels": kernels,
        "narrow": args.narrow,
        "device": device,
        "batch": args.batch,
        "cache": args.cache,
        "tf32": args.tf32,
        "prompt_len": args.prompt_len,
        "parameters": n_params,
        "aten_calls_per_step": calls,
        "top_level_aten_calls_per_step": top_calls,
        "seconds_per_step": step_s,
        "kernels": kernel_report(),
        "machine": machine(),
    }


def pick_dtype(name: str, shape: str, device: str):
    import torch

    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if device.startswith("cuda") and shape != "smollm2" else torch.float32


def random_target(shape: str, device: str, dtype, narrow: bool = False):
    """(the target's text parts, parameter count) with random weights of `shape`."""
    from benchmarks.extract import QWEN36_27B_TEXT, TINY_TEXT, build_random_target

    if shape == "smollm2":
        from benchmarks.small_decode import random_target as smollm2_target

        if narrow:
            raise SystemExit("--narrow is for the 27B layout only")
        target = smollm2_target(dtype, device)
        return target, sum(p.numel() for p in target.model.parameters())
    text = {"qwen3.6-27b": QWEN36_27B_TEXT, "tiny": TINY_TEXT}[shape]
    return build_random_target({**text, **NARROW} if narrow else text, device, dtype)


def cuda_kernels_per_step(decode, steps: int, top: int) -> dict:
    """CUDA kernel time per decoding step (decoding 2 + steps tokens minus decoding 2, over steps), in
    all and for the `top` kernels that take most of it: which kernels the step's time goes to."""
    from torch.profiler import ProfilerActivity, profile

    def kernel_times(new_tokens: int) -> dict[str, tuple[float, int]]:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            decode(new_tokens)
        out: dict[str, tuple[float, int]] = {}
        for event in prof.key_averages():
            us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
            if us and getattr(event, "device_type", None) is not None and "CUDA" in str(event.device_type):
                out[event.key] = (us, event.count)
        return out

    many, few = kernel_times(2 + steps), kernel_times(2)
    rows = []
    for name, (us, count) in many.items():
        us0, count0 = few.get(name, (0.0, 0))
        rows.append({"name": name, "ms_per_step": (us - us0) / steps / 1e3, "calls_per_step": (count - count0) / steps})
    rows.sort(key=lambda r: -r["ms_per_step"])
    return {"kernel_ms_per_step": sum(r["ms_per_step"] for r in rows), "top": rows[:top]}


def inside_aten_op(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def format_local_row(row: dict) -> str:
    peak = f", peak {row['peak_gib']:.1f} GiB" if row.get("peak_gib") is not None else ""
    return (
        f"{row['cache']:>7} batch {row['batch']:>4}: {row['batch'] * row['new_tokens']:>7} tokens in "
        f"{row['seconds']:7.1f} s = "
        f"{row['generated_tokens_per_s']:8.1f} generated tok/s (prefill {row['prefill_seconds']:.1f} s; decode alone "
        f"{row['decode_tokens_per_s']:8.1f} tok/s){peak}"
    )


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    report = {"server": run_server, "local": run_local, "ops": run_ops}[args.mode](args)
    if report["mode"] == "local" and report["best"] is not None:
        best = report["best"]
        print(
            f"best: batch {best['batch']}: {best['generated_tokens_per_s']:,.0f} generated tok/s "
            f"({report['parameters'] / 1e9:.2f} B parameters, {report['device']}, {report['dtype']}; fla "
            f"{report['kernels']})"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.regenerate", main))
