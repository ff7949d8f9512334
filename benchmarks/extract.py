"""`python -m benchmarks.extract` (`make bench-extract ARGS=...`): extraction throughput on random weights.

Builds a random-weight target of the exact Qwen3.6-27B text shape (`Qwen3_5TextConfig` from the
checkpoint's `text_config`: 64 layers, 48 Gated DeltaNet + 16 gated attention, hidden 5120,
vocab 248320) directly on the GPU in bf16, writes a synthetic corpus of token sequences with a
realistic length mix, and measures in one run on the same micro-batches:

  (a) bare:  the target forward with the tap hooks and the chunked final-logit top-k, nothing else
  (b) full:  the real extraction (`extract.pipeline.run`): corpus read, batching, device-to-host
             copies, unpacking, zstd, finished shards on local disk, manifest commits

and prints tok/s, TFLOP/s (2 * N FLOPs per token, N = all parameters of the causal LM), (b)/(a),
peak GPU memory, host RSS and bytes written, as a table and as JSON (`--out`).

    python -m benchmarks.extract --out bench.json                       # one GPU
    torchrun --nproc-per-node 2 -m benchmarks.extract --out bench.json  # per-GPU and total
    python -m benchmarks.extract --shape tiny                           # CPU smoke run, seconds

Not a test: numbers depend on the machine. Whether the `fla` Triton kernels for the Gated DeltaNet
layers are importable is reported (without them transformers runs a slow PyTorch fallback).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import shutil
import sys
import threading
import time

import numpy as np
import torch

from common.interrupts import run_main

# Qwen/Qwen3.6-27B config.json `text_config` (docs: qwen3.6-27b.md section 1.2).
QWEN36_27B_TEXT = dict(
    attention_bias=False,
    attention_dropout=0.0,
    attn_output_gate=True,
    bos_token_id=248044,
    eos_token_id=248044,
    pad_token_id=None,
    full_attention_interval=4,
    head_dim=256,
    hidden_act="silu",
    hidden_size=5120,
    initializer_range=0.02,
    intermediate_size=17408,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_num_key_heads=16,
    linear_value_head_dim=128,
    linear_num_value_heads=48,
    max_position_embeddings=262144,
    mtp_num_hidden_layers=1,
    mtp_use_dedicated_embeddings=False,
    num_attention_heads=24,
    num_key_value_heads=4,
    num_hidden_layers=64,
    partial_rotary_factor=0.25,
    rms_norm_eps=1e-6,
    rope_parameters=dict(
        mrope_interleaved=True,
        mrope_section=[11, 11, 10],
        partial_rotary_factor=0.25,
        rope_theta=10000000,
        rope_type="default",
    ),
    tie_word_embeddings=False,
    use_cache=True,
    vocab_size=248320,
)
# The same architecture (hybrid layers, gated attention, partial rope), small enough for a CPU.
TINY_TEXT = dict(
    QWEN36_27B_TEXT,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_key_head_dim=16,
    linear_num_key_heads=2,
    linear_value_head_dim=16,
    linear_num_value_heads=4,
    vocab_size=4096,
    bos_token_id=1,
    eos_token_id=1,
    max_position_embeddings=4096,
)
SHAPES = {
    "qwen3.6-27b": dict(
        text=QWEN36_27B_TEXT, layer_ids=[1, 16, 31, 46], tokens=1_000_000, min_len=500, max_len=8000, budget=16384
    ),
    "tiny": dict(text=TINY_TEXT, layer_ids=[1, 3, 5], tokens=12_000, min_len=32, max_len=400, budget=2048),
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.extract", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shape", choices=sorted(SHAPES), default="qwen3.6-27b", help="target shape (tiny runs on CPU in seconds)"
    )
    p.add_argument("--tokens", type=int, default=None, help="synthetic corpus size in tokens, all ranks together")
    p.add_argument("--min-len", type=int, default=None, help="shortest sequence")
    p.add_argument("--max-len", type=int, default=None, help="longest sequence")
    p.add_argument("--tokens-per-batch", type=int, default=None, help="micro-batch token budget (padded)")
    p.add_argument("--layer-ids", default=None, help="comma-separated tap ids (default 1,16,31,46)")
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--logits-chunk", type=int, default=1024)
    p.add_argument("--zstd-level", type=int, default=None, help="default: the shard writer's")
    p.add_argument("--hidden-encoding", choices=["planes", "plain"], default=None)
    p.add_argument("--writer-threads", type=int, default=4)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument(
        "--workdir", default=None, help="where the corpus and shards go (local disk); default /tmp/extract-bench"
    )
    p.add_argument("--keep", action="store_true", help="keep the written shards")
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the untimed bare pass that first tunes kernels for each shape: (b) then runs cold and "
        "(a) warm after it, so (b)/(a) reads low",
    )
    p.add_argument(
        "--warmup-batches",
        type=int,
        default=0,
        metavar="N",
        help="the untimed pass over the first N micro-batches only (0: all of them); on packed rows every "
        "micro-batch has one shape, so a few tune the kernels, and whatever is still cold counts against (b)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=None,
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="run (b) once more with these extract config overrides, e.g. launch_ahead_layers=4 or "
        "gil_switch_interval=0.0005 (repeatable; (b) runs once per --variant, in order; default: once as configured)",
    )
    p.add_argument(
        "--packing",
        action="store_true",
        help="(a) and every (b) on packed rows (packing=true: no padding; refused where a layer could mix samples)",
    )
    p.add_argument(
        "--attn-implementation",
        default="sdpa",
        choices=["sdpa", "eager", "flash_attention_2"],
        help="the attention layers' kernel (with --packing, sdpa runs once per sample; transformers has no flex "
        "attention for Qwen3.5)",
    )
    p.add_argument(
        "--reference-conv",
        action="store_true",
        help="the Gated DeltaNet convolution on transformers' reference code instead of fla's Triton kernel",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    args.tokens = args.tokens or shape["tokens"]
    args.min_len = args.min_len or shape["min_len"]
    args.max_len = args.max_len or shape["max_len"]
    args.tokens_per_batch = args.tokens_per_batch or shape["budget"]
    args.layer_ids = [int(x) for x in args.layer_ids.split(",")] if args.layer_ids else shape["layer_ids"]
    args.variants = [[kv for kv in v.split(",") if kv] for v in args.variant] if args.variant else [[]]
    if any(not all("=" in kv for kv in v) for v in args.variants):
        p.error("--variant: expected KEY=VALUE pairs separated by commas")
    if not 0 < args.min_len <= args.max_len <= args.tokens_per_batch:
        p.error("need 0 < --min-len <= --max-len <= --tokens-per-batch")
    if args.warmup_batches < 0:
        p.error("--warmup-batches: expected 0 (all) or a positive count")
    return args


# ----------------------------------------------------------------------------------------------
# Inputs


def length_mix(total_tokens: int, min_len: int, max_len: int, rng: np.random.Generator) -> list[int]:
    """Sequence lengths adding up to at least `total_tokens` (less than min_len more): log-uniform
    between min and max (chat data has many short and some long samples), the last one cut short."""
    lengths, total = [], 0
    while total < total_tokens:
        n = int(np.exp(rng.uniform(np.log(min_len), np.log(max_len + 1))))
        n = max(min_len, min(max_len, n, total_tokens - total))
        lengths.append(n)
        total += n
    return lengths


# Above every id of the benchmark's tokenizer (300 ids, its special tokens among them), so that no
# pad, eos or mask token occurs in the random corpus: extraction refuses a mask token found in the data.
FIRST_CORPUS_ID = 512


def write_token_corpus(path: str, lengths: list[int], vocab_size: int, seed: int, world: int = 1) -> list[int]:
    """JSONL of {"input_ids": [...]} records (no `datasets` needed); loss on every token. Returns the
    tokens each of `world` ranks will own.

    Ranks own samples by a hash of their tokens, so over a few hundred samples of 500-8000 tokens
    their shares differ by several percent (the spread shrinks as one over the square root of the
    sample count: nothing over a real corpus) and the slowest rank sets a short run's pace. With
    several ranks, each sequence's ids are therefore drawn again until the sample falls to the rank
    that owns the fewest tokens so far: every rank gets the same length mix and the same tokens
    within one sequence."""
    from common.hashing import sample_id

    rng = np.random.default_rng(seed)
    owned = [0] * world
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for n in lengths:
            neediest = owned.index(min(owned))
            while True:
                ids = rng.integers(FIRST_CORPUS_ID, vocab_size, size=n).astype(np.int32)
                owner = int(sample_id(ids, np.ones(n, dtype=np.uint8)), 16) % world
                if world == 1 or owner == neediest:
                    break
            owned[owner] += n
            f.write('{"input_ids": [' + ",".join(map(str, ids.tolist())) + "]}\n")
    os.replace(tmp, path)
    return owned


def build_random_target(text_kwargs: dict, device: str, dtype: torch.dtype, attn_implementation: str = "sdpa"):
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from recipes.tiny import build_chat_tokenizer
    from target.load import reach_text_parts

    config = Qwen3_5TextConfig(**text_kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.eval().requires_grad_(False)
    # Token ids come pre-made; the tokenizer only supplies pad/eos ids and provenance.
    tokenizer = build_chat_tokenizer(["benchmark corpus of random token ids " * 8], 300)
    return reach_text_parts(model, tokenizer, path=""), sum(p.numel() for p in model.parameters())


def kernel_report(model=None) -> dict:
    from transformers.utils import import_utils

    from target.kernel_routing import fla_convolution_installed

    fla_spec = importlib.util.find_spec("fla")
    check = getattr(import_utils, "is_flash_linear_attention_available", None)
    conv = getattr(import_utils, "is_causal_conv1d_available", None)
    return {
        "fla_importable": fla_spec is not None,
        "fla_used_by_transformers": bool(check()) if check else None,
        "causal_conv1d_used": bool(conv()) if conv else None,
        "fla_convolution": None if model is None else fla_convolution_installed(model),
    }


# ----------------------------------------------------------------------------------------------
# Measurements


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bare_batches(target, cfg, corpus_path: str, ranks) -> list:
    """(input ids, lengths, packed) of exactly the micro-batches (b) runs on this rank."""
    from extract import corpus as C
    from extract.batching import collate_packed, collate_right_padded, plan_micro_batches, plan_packed_micro_batches
    from extract.corpus.windows import read_windows

    policy = C.SamplePolicy(cfg.max_len, cfg.length_policy, cfg.min_loss_tokens, {}, target.vocab_size)
    builder = C.SampleBuilder(target.tokenizer, policy)
    batches = []
    for window in read_windows(cfg, C.find_corpus(corpus_path), builder, ranks):
        lengths = [s.n_tokens for s in window.samples]
        for plan in (plan_packed_micro_batches if cfg.packing else plan_micro_batches)(lengths, cfg.tokens_per_batch):
            sequences = [torch.from_numpy(window.samples[i].input_ids) for i in plan]
            ids, batch_lengths = collate_packed(sequences) if cfg.packing else collate_right_padded(sequences, 0)
            batches.append((ids, batch_lengths, cfg.packing))
    return batches


def measure_bare(target, cfg, batches: list, device: str) -> dict:
    """(a): hooks + chunked top-k over `batches`; nothing leaves the GPU."""
    from extract.capture import capture

    if not batches:
        return {"tokens": 0, "seconds": 0.0, "batches": 0}
    ids, lengths, packed = batches[0]
    capture(target, ids, lengths, cfg.layer_ids, cfg.topk, cfg.logits_chunk, packed)  # warm-up (kernels, allocator)
    sync(device)
    start, tokens = time.perf_counter(), 0
    for ids, lengths, packed in batches:
        captured = capture(target, ids, lengths, cfg.layer_ids, cfg.topk, cfg.logits_chunk, packed)
        tokens += sum(lengths)
        del captured
    sync(device)
    seconds = time.perf_counter() - start
    return {
        "tokens": tokens,
        "seconds": seconds,
        "batches": len(batches),
        "padded_tokens": sum(int(i.numel()) for i, _, _ in batches),
    }


class GilProbe:
    """How long a thread waits for the GIL: a thread sleeps 1 ms (releasing the GIL) over and over
    and records by how much each wake-up overshoots. On an idle interpreter that is the OS timer's
    slack (tens of microseconds); when another thread keeps the GIL, it approaches Python's switch
    interval (5 ms by default), which every GIL-releasing call of the write thread would pay too."""

    SLEEP = 0.001

    def __init__(self):
        self.delays: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            time.sleep(self.SLEEP)
            self.delays.append(time.perf_counter() - start - self.SLEEP)

    def __enter__(self) -> GilProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        if not self.delays:
            return {"wakeups": 0}
        d = np.array(self.delays) * 1e3
        return {
            "wakeups": int(d.size),
            "mean_ms": float(d.mean()),
            "p50_ms": float(np.percentile(d, 50)),
            "p99_ms": float(np.percentile(d, 99)),
            "max_ms": float(d.max()),
        }


def run_full(cfg, target, ranks, device: str, overrides: list[str]) -> tuple[dict, dict]:
    """(b) once: the real extraction into a fresh `cfg.out_dir`; (measurements, dataset summary)."""
    from extract import pipeline

    if ranks.rank == 0:
        shutil.rmtree(cfg.out_dir, ignore_errors=True)
    ranks.barrier()
    reset_peak(device)
    cpu0, start = time.process_time(), time.perf_counter()  # CPU of all threads of this process
    with GilProbe() as probe:
        summary = pipeline.run(cfg, target=target, ranks=ranks)[None]
        sync(device)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
    run = summary.get("this_run", {})
    tier = _tier_facts(cfg.out_dir) if ranks.rank == 0 else None
    full = {
        "tokens": run.get("tokens", 0),
        "seconds": seconds,
        "samples": run.get("samples", 0),
        "peak_gpu_gib": peak_gib(device),
        "bytes_written": summary["bytes"] if ranks.world == 1 else None,
        "pad_efficiency": run.get("pad_efficiency"),
        "overrides": overrides,
        "process_cpu_cores": cpu / seconds if seconds else None,
        "gil_probe": probe.summary(),
        "startup_seconds": run.get("startup_seconds"),
        "drain_seconds": run.get("drain_seconds"),
        **{k: v for k, v in run.items() if k.startswith("write") or k.startswith("commit")},
        "tier": tier,
    }
    return full, summary


def _tier_facts(out_dir: str) -> dict | None:
    """Encoding, projection and the reconstruction error per tap recorded in the written dataset."""
    from shards import ShardDataset
    from shards.describe import reconstruction_by_tap

    try:
        ds = ShardDataset(out_dir, verify_samples=False)
    except (OSError, ValueError):
        return None
    taps, tokens, _ = reconstruction_by_tap(ds.shards)
    return {
        "encoding": ds.encoding,
        "projection": (ds.projection or {}).get("spec"),
        "error_tokens": tokens,
        "rel_rms_per_tap": [t["rel_rms"] for t in taps],
        "worst_channel_rel_rms": [t["worst_channel_rel_rms"] for t in taps],
    }


def fit_projections_once(cfgs: list, target, ranks, workdir: str) -> tuple[list, list]:
    """Variants with a storage-tier projection `pca:...` get it fitted here, once and untimed (rank 0
    runs the calibration pass; a real extraction pays it once per corpus), and then read it from a
    file, so (b) measures the per-token cost of the tier alone. Returns (configs, calibration info)."""
    import dataclasses

    out_cfgs, infos = [], []
    for i, c in enumerate(cfgs):
        if not (c.projection or "").startswith("pca:"):
            out_cfgs.append(c)
            infos.append(None)
            continue
        from extract.calibrate import calibrate
        from shards.projection import projection_bytes

        path = os.path.join(workdir, f"projection-variant{i}.safetensors")
        started = time.perf_counter()
        if ranks.rank == 0:
            projection = calibrate(c, target)
            with open(path, "wb") as f:
                f.write(projection_bytes(projection))
            infos.append(
                {
                    "spec": c.projection,
                    "seconds": time.perf_counter() - started,
                    "rank_per_tap": projection.rank,
                    "explained": projection.info["explained"],
                    **projection.info.get("calibration", {}),
                }
            )
        else:
            infos.append({"spec": c.projection, "fitted_by": "rank 0"})
        ranks.barrier()
        out_cfgs.append(dataclasses.replace(c, projection=path))
    return out_cfgs, infos


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def host_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from common.config import load_config
    from extract.config import ExtractConfig
    from extract.ranks import Ranks

    ranks = Ranks.from_env()
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.shape != "tiny" and not use_cuda:
        print("benchmarks.extract: the qwen3.6-27b shape needs a GPU; use --shape tiny on a CPU", file=sys.stderr)
        return 2
    device = f"cuda:{ranks.local_rank}" if use_cuda else "cpu"
    if use_cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if use_cuda else torch.float32
    workdir = os.path.abspath(args.workdir or "/tmp/extract-bench")
    corpus_path, out_dir = os.path.join(workdir, "corpus.jsonl"), os.path.join(workdir, "shards")
    shape = SHAPES[args.shape]

    if ranks.rank == 0:
        os.makedirs(workdir, exist_ok=True)
        shutil.rmtree(out_dir, ignore_errors=True)
        lengths = length_mix(args.tokens, args.min_len, args.max_len, np.random.default_rng(args.seed))
        owned = write_token_corpus(corpus_path, lengths, shape["text"]["vocab_size"], args.seed, ranks.world)
        print(
            f"corpus: {len(lengths)} sequences, {sum(lengths):,} tokens; per rank: "
            f"{', '.join(f'{n:,}' for n in owned)}",
            file=sys.stderr,
        )
    ranks.barrier()

    t0 = time.perf_counter()
    target, n_params = build_random_target(shape["text"], device, dtype, args.attn_implementation)
    if args.packing:
        from extract.pipeline import prepare_packing

        try:
            prepare_packing(target)  # as the pipeline does, so (a) runs the same attention as (b)
        except ValueError as refusal:
            print(f"benchmarks.extract: --packing {str(refusal).removeprefix('packing: ')}", file=sys.stderr)
            return 2
    if args.reference_conv:
        from target.kernel_routing import restore_reference_convolution

        print(f"reference convolution restored: {restore_reference_convolution(target.model)}", file=sys.stderr)
    sync(device)
    build_seconds = time.perf_counter() - t0
    overrides = [
        "target=random-weights",
        f"out_dir={out_dir}",
        f"corpus={corpus_path}",
        f"layer_ids={args.layer_ids}",
        f"topk={args.topk}",
        f"max_len={args.max_len}",
        "min_loss_tokens=1",
        f"tokens_per_batch={args.tokens_per_batch}",
        f"logits_chunk={args.logits_chunk}",
        f"writer_threads={args.writer_threads}",
        f"dtype={'bfloat16' if use_cuda else 'float32'}",
        f"device={'cuda' if use_cuda else 'cpu'}",
    ]
    if args.zstd_level:
        overrides.append(f"zstd_level={args.zstd_level}")
    if args.hidden_encoding:
        overrides.append(f"hidden_encoding={args.hidden_encoding}")
    if args.packing:
        overrides.append("packing=true")
    overrides.append(f"attn_implementation={args.attn_implementation}")
    cfgs = [
        load_config(ExtractConfig, None, overrides + variant) for variant in args.variants
    ]  # all checked before any work
    cfg = cfgs[0]

    # Kernels are tuned (and Triton kernels compiled) on the first use of each sequence shape, which
    # cost the first pass over these micro-batches about a third of its time on an H200 (4.9 K tok/s
    # cold, 7.6 K warm). A real extraction pays that once over millions of tokens, so by default one
    # untimed bare pass runs first and both phases are measured warm; its time is reported. (b) runs
    # before (a), so anything still cold counts against (b): (b)/(a) is never flattered.
    batches = bare_batches(target, cfg, corpus_path, ranks)
    warmup_batches = batches[: args.warmup_batches] if args.warmup_batches > 0 else batches
    warmup = measure_bare(target, cfg, warmup_batches, device) if args.warmup else None
    cfgs, calibrations = fit_projections_once(cfgs, target, ranks, workdir)
    fulls = []
    for variant, variant_cfg, calibration in zip(args.variants, cfgs, calibrations, strict=True):
        full, summary = run_full(variant_cfg, target, ranks, device, variant)
        full["calibration"] = calibration
        fulls.append(full)
        if ranks.rank == 0:  # a line per variant as it finishes (kept if a time limit stops the run later)
            print(
                f"(b) {', '.join(variant) or 'as configured'}: {full['tokens'] / full['seconds']:,.0f} tok/s over "
                f"{full['tokens']:,} tokens, "
                f"{(full['bytes_written'] or 0) / max(full['tokens'], 1):,.0f} B/token; tier "
                f"{json.dumps(full.get('tier'))}",
                flush=True,
            )

    reset_peak(device)
    with GilProbe() as probe:
        bare = measure_bare(target, cfg, batches, device)
    bare["peak_gpu_gib"] = peak_gib(device)
    bare["gil_probe"] = probe.summary()
    result = {
        "rank": ranks.rank,
        "bare": bare,
        "full_variants": fulls,
        "host_rss_gib": host_rss_gib(),
        "build_seconds": build_seconds,
        "warmup_seconds": warmup["seconds"] if warmup else None,
        "warmup_tokens": warmup["tokens"] if warmup else None,
    }
    results = gather(result, ranks)
    if ranks.rank == 0:
        report = make_report(args, results, n_params, device, summary, kernel_report(target.model))
        print(format_report(report), flush=True)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=2)
            print(f"wrote {args.out}")
        if not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)
    return 0


def gather(result: dict, ranks) -> list[dict]:
    if ranks.world == 1:
        return [result]
    if not ranks.group:
        raise SystemExit("benchmarks.extract: several ranks need a process group; start it with torchrun")
    import torch.distributed as dist

    out = [None] * ranks.world
    dist.all_gather_object(out, result)
    return out


def make_report(args, results: list[dict], n_params: int, device: str, summary: dict, kernels: dict) -> dict:
    def rate(part: dict) -> float:
        return part["tokens"] / part["seconds"] if part["seconds"] else 0.0

    def per_rank_rows(variant: int) -> list[dict]:
        rows = []
        for r in results:
            full = r["full_variants"][variant]
            a, b = rate(r["bare"]), rate(full)
            rows.append(
                {
                    "rank": r["rank"],
                    "bare_tok_s": a,
                    "full_tok_s": b,
                    "full_over_bare": b / a if a else None,
                    "bare_tflops": 2 * n_params * a / 1e12,
                    "full_tflops": 2 * n_params * b / 1e12,
                    "bare_tokens": r["bare"]["tokens"],
                    "full_tokens": full["tokens"],
                    "peak_gpu_gib_bare": r["bare"]["peak_gpu_gib"],
                    "peak_gpu_gib_full": full["peak_gpu_gib"],
                    "host_rss_gib": r["host_rss_gib"],
                    "pad_efficiency": full["pad_efficiency"],
                    "model_build_seconds": r["build_seconds"],
                    "write_thread_busy": full.get("write_thread_busy"),
                    "commit_busy": full.get("commit_busy"),
                    "write_thread_cpu": full.get("write_thread_cpu"),
                    "process_cpu_cores": full.get("process_cpu_cores"),
                    "writer_timings": {k: v for k, v in full.items() if k.startswith("writer_")},
                    "gil_probe_full": full.get("gil_probe"),
                    "gil_probe_bare": r["bare"].get("gil_probe"),
                    "warmup_seconds": r.get("warmup_seconds"),
                    "warmup_tokens": r.get("warmup_tokens"),
                    "bare_seconds": r["bare"]["seconds"],
                    "full_seconds": full["seconds"],
                    "full_startup_seconds": full.get("startup_seconds"),
                    "full_drain_seconds": full.get("drain_seconds"),
                    "warmup_tok_s": (r.get("warmup_tokens") or r["bare"]["tokens"]) / r["warmup_seconds"]
                    if r.get("warmup_seconds")
                    else None,
                    "full_bytes_per_token": full["bytes_written"] / full["tokens"]
                    if full.get("bytes_written") and full["tokens"]
                    else None,
                    "calibration": full.get("calibration"),
                    "tier": full.get("tier"),
                }
            )
        return rows

    def totals(variant: int) -> dict:
        wall_a = max(r["bare"]["seconds"] for r in results)
        wall_b = max(r["full_variants"][variant]["seconds"] for r in results)
        total_a = sum(r["bare"]["tokens"] for r in results) / wall_a if wall_a else 0.0
        total_b = sum(r["full_variants"][variant]["tokens"] for r in results) / wall_b if wall_b else 0.0
        return {
            "bare_tok_s": total_a,
            "full_tok_s": total_b,
            "full_over_bare": total_b / total_a if total_a else None,
            "bare_tflops": 2 * n_params * total_a / 1e12,
            "full_tflops": 2 * n_params * total_b / 1e12,
        }

    variants = [
        {"overrides": results[0]["full_variants"][v]["overrides"], "per_rank": per_rank_rows(v), "total": totals(v)}
        for v in range(len(results[0]["full_variants"]))
    ]
    first = variants[0]["total"]["full_tok_s"]
    for variant in variants:  # storage tiers and other variants against the first one, in the same run
        variant["total"]["full_over_first_variant"] = variant["total"]["full_tok_s"] / first if first else None
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python -m benchmarks.extract " + " ".join(sys.argv[1:]),
        "shape": args.shape,
        "parameters": n_params,
        "device": gpu,
        "world_size": len(results),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "kernels": kernels,
        "packing": args.packing,
        "attn_implementation": args.attn_implementation,
        "settings": {
            "tokens": args.tokens,
            "min_len": args.min_len,
            "max_len": args.max_len,
            "tokens_per_batch": args.tokens_per_batch,
            "layer_ids": args.layer_ids,
            "topk": args.topk,
            "logits_chunk": args.logits_chunk,
            "zstd_level": args.zstd_level,
            "hidden_encoding": args.hidden_encoding,
            "writer_threads": args.writer_threads,
            "warmup": args.warmup,
            "variants": args.variants,
        },
        "per_rank": variants[0]["per_rank"],
        "total": variants[0]["total"],
        "variants": variants,
        "dataset": {
            "samples": summary["samples"],
            "tokens": summary["tokens"],
            "bytes": summary["bytes"],
            "bytes_per_token": summary["bytes_per_token"],
        },
    }


def format_report(report: dict) -> str:
    def f(x, spec=",.0f"):
        return "-" if x is None else format(x, spec)

    k = report["kernels"]
    lines = [
        f"benchmarks.extract  shape={report['shape']}  params={report['parameters'] / 1e9:.2f}B  "
        f"device={report['device']} x{report['world_size']}",
        f"torch {report['torch']}, transformers {report['transformers']}; fla importable: {k['fla_importable']}, "
        f"used: {k['fla_used_by_transformers']}; fla convolution: {k.get('fla_convolution')}; "
        f"packed rows: {report.get('packing', False)}; attention: {report.get('attn_implementation', 'sdpa')}",
    ]
    for variant in report["variants"]:
        lines += [
            "",
            "(b) with " + (", ".join(variant["overrides"]) or "the settings above"),
            f"{'rank':>4} {'(a) bare tok/s':>15} {'(b) full tok/s':>15} {'(b)/(a)':>8} {'(a) TFLOP/s':>12} "
            f"{'(b) TFLOP/s':>12} {'peak GPU GiB':>13} "
            f"{'host RSS GiB':>13} {'pad eff':>8} {'write busy':>10} {'of it commit':>12} {'write CPU':>9} "
            f"{'cores':>6}",
        ]
        for r in variant["per_rank"]:
            lines.append(
                f"{r['rank']:>4} {f(r['bare_tok_s']):>15} {f(r['full_tok_s']):>15} "
                f"{f(r['full_over_bare'], '.3f'):>8} {f(r['bare_tflops'], '.1f'):>12} "
                f"{f(r['full_tflops'], '.1f'):>12} {f(r['peak_gpu_gib_full'], '.1f'):>13} "
                f"{f(r['host_rss_gib'], '.1f'):>13} {f(r['pad_efficiency'], '.3f'):>8} "
                f"{f(r.get('write_thread_busy'), '.0%'):>10} {f(r.get('commit_busy'), '.0%'):>12} "
                f"{f(r.get('write_thread_cpu'), '.0%'):>9} "
                f"{f(r.get('process_cpu_cores'), '.1f'):>6}"
            )
        t = variant["total"]
        lines.append(
            f"{'all':>4} {f(t['bare_tok_s']):>15} {f(t['full_tok_s']):>15} {f(t['full_over_bare'], '.3f'):>8} "
            f"{f(t['bare_tflops'], '.1f'):>12} {f(t['full_tflops'], '.1f'):>12}"
        )
        bpt = [r["full_bytes_per_token"] for r in variant["per_rank"] if r.get("full_bytes_per_token")]
        tier = variant["per_rank"][0].get("tier") or {}
        error = ", ".join(f"{x:.4f}" for x in tier.get("rel_rms_per_tap") or []) or "none (lossless)"
        lines.append(
            f"  (b) against the first variant: {f(t.get('full_over_first_variant'), '.3f')} of its tok/s; written "
            + (f"{f(sum(bpt) / len(bpt))} B/token" if bpt else "- B/token")
            + f"; tier {tier.get('encoding', '-')}{' + ' + tier['projection'] if tier.get('projection') else ''}, "
            f"relative RMS error per tap {error}"
        )
        for r in variant["per_rank"]:
            if r.get("calibration") and r["calibration"].get("seconds") is not None:
                c = r["calibration"]
                lines.append(
                    f"  projection {c['spec']}: calibration pass (untimed in (b)) {c['seconds']:.1f} s over "
                    f"{c.get('samples')} samples / "
                    f"{c.get('tokens')} tokens, rank {c['rank_per_tap']} per tap keeps "
                    f"{', '.join(f'{x:.3f}' for x in c['explained'])}"
                )
        for r in variant["per_rank"]:
            timings = ", ".join(
                f"{key.removeprefix('writer_')} {value:,.0f}"
                if key.endswith("_calls")
                else f"{key.removeprefix('writer_')} {value:.0%}"
                for key, value in r["writer_timings"].items()
            )
            gil_b, gil_a = r.get("gil_probe_full") or {}, r.get("gil_probe_bare") or {}
            lines.append(
                f"  rank {r['rank']}: (b) took {f(r['full_seconds'], '.1f')} s, of it "
                f"{f(r['full_startup_seconds'], '.1f')} s from the call to the first "
                f"forward and {f(r['full_drain_seconds'], '.1f')} s after the last forward was launched; (a) took "
                f"{f(r['bare_seconds'], '.1f')} s"
            )
            lines.append(
                f"  rank {r['rank']}: writer time shares: {timings or '-'}; GIL wait (1 ms sleeps) during (b): "
                f"mean {f(gil_b.get('mean_ms'), '.2f')} ms, "
                f"p99 {f(gil_b.get('p99_ms'), '.2f')} ms; during (a): mean {f(gil_a.get('mean_ms'), '.2f')} ms, "
                f"p99 {f(gil_a.get('p99_ms'), '.2f')} ms"
            )
    warm = [r["warmup_tok_s"] for r in report["per_rank"] if r.get("warmup_tok_s")]
    if warm:
        lines += [
            "",
            "untimed warm-up pass (bare forward, cold kernels) per rank: " + ", ".join(f"{f(x)} tok/s" for x in warm),
        ]
    d = report["dataset"]
    lines += [
        "",
        f"dataset: {d['samples']:,} samples, {d['tokens']:,} tokens, {d['bytes'] / 1e9:.2f} GB written = "
        f"{f(d['bytes_per_token'])} B/token",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.extract", main))
