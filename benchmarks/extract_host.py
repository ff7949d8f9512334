"""`python -m benchmarks.extract_host`: CPU cost per token of the extraction's host path; no GPU needed.

Feeds synthetic micro-batches, laid out as they sit in the pinned host buffers once the
device-to-host copy is done, through the code the pipeline runs after that copy:
cut the samples out of the buffer -> validate -> byte planes -> zstd -> file write + checksum ->
shard commit (footer, index, fsync, rename, manifest). Shapes are the real ones (Qwen3.6-27B:
4 taps x 5120 bf16, W = 20,480; top-32; lengths log-uniform 500-8000; 16,384-token micro-batches,
planned as the pipeline plans them) and the hidden values have the structure of real residual
streams (`benchmarks.synthetic`), so zstd sees realistic bytes.

Two measurements of each path:

  serial     one thread, one stage after another, each stage's CPU time (`time.process_time`, so
             the work of pyarrow's compression threads counts) per token. Stages are timed by
             wrapping the functions the pipeline calls; nested stages are charged exclusively.
  pipelined  the pipeline's own worker threads ("assemble", "write") and buffer pool, fed by this
             thread as the forward loop feeds them: CPU per token of the whole process (minus
             the filling of the buffers, which the GPU's copy engine does in a real run) and wall
             time (meaningless on a shared machine; printed for completeness).

Paths (`--path`):

  current    the pipeline as it is (`extract.host_path.HostPath`)
  legacy     the host path before 2026-12-01, for comparison: the buffer holds the taps as bf16
             [n_taps, B, T, H]; each sample is copied out to uint16 [T, W]; the writer scans it
             for NaN/Inf and splits the byte planes on the host. It runs on this tree's shard
             writer, whose uint16 path also got a cheaper (blocked) NaN/Inf scan; running this
             file in a checkout of the older code (`--path legacy`) measures that code itself.

    python -m benchmarks.extract_host                      # both paths, ~1 minute on 2 cores
    python -m benchmarks.extract_host --tokens 20000 --path current --out host.json

Not a test: numbers depend on the machine. Read the serial table as CPU-seconds per token; the
pipelined total says what the threads together cost (thread hand-offs and GIL included).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
import torch

from common.interrupts import run_main

WIDTH_TAPS, HIDDEN = 4, 5120
RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)  # Linux; elsewhere the whole process
POOL_TOKENS = 8192  # distinct synthetic token rows; samples are slices of them (zstd works per sample)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.extract_host", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=40_000, help="tokens per measurement (default 40,000)")
    p.add_argument("--min-len", type=int, default=500)
    p.add_argument("--max-len", type=int, default=8000)
    p.add_argument("--tokens-per-batch", type=int, default=16384)
    p.add_argument("--taps", type=int, default=WIDTH_TAPS)
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--topk", type=int, default=32)
    p.add_argument(
        "--hidden-split",
        type=int,
        default=None,
        help="column pieces per hidden plane in the current path (default: one per tap, as extract writes)",
    )
    p.add_argument(
        "--writer-threads", type=int, default=4, help="pyarrow compression threads (the pipeline's writer_threads)"
    )
    p.add_argument("--inflight-batches", type=int, default=4, help="host buffers (the pipeline's inflight_batches)")
    p.add_argument("--shard-bytes", type=int, default=None, help="default: the shard writer's (1 GiB)")
    p.add_argument(
        "--write-behind-bytes",
        type=int,
        default=None,
        help="early write-back every this many bytes of a shard; 0 = off; default: the shard writer's (64 MiB)",
    )
    p.add_argument("--path", choices=["current", "legacy", "both"], default="both")
    p.add_argument(
        "--encoding",
        default="planes",
        help="hidden encoding of the current path: planes, or a storage tier (fp8, int4-gG, nf4-gG) whose codes and "
        "scales the device would have laid out in the buffer (quantized here once, untimed)",
    )
    p.add_argument("--mode", choices=["serial", "pipelined", "both"], default="both")
    p.add_argument("--dir", default=None, help="where shards are written (local disk; deleted afterwards)")
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="measurements of each path and mode; the cheapest is reported (after one warm-up)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if not 0 < args.min_len <= args.max_len <= min(args.tokens_per_batch, POOL_TOKENS):
        p.error(f"need 0 < --min-len <= --max-len <= min(--tokens-per-batch, {POOL_TOKENS})")
    return args


# ----------------------------------------------------------------------------------------------
# Synthetic inputs


class Synthetic:
    """A pool of realistic token rows (hidden bf16 bits, top-k) that samples are sliced from."""

    def __init__(self, n_taps: int, hidden: int, topk: int, seed: int):
        from benchmarks.synthetic import _tap_structure, realistic_hidden, realistic_topk

        rng = np.random.default_rng(seed)
        self.n_taps, self.hidden, self.width = n_taps, hidden, n_taps * hidden
        self.hidden_TW = realistic_hidden(rng, POOL_TOKENS, _tap_structure(rng, n_taps, hidden))
        self.hi_TW, self.lo_TW = (self.hidden_TW >> 8).astype(np.uint8), self.hidden_TW.astype(np.uint8)
        self.topk_ids, self.topk_logprobs = realistic_topk(rng, POOL_TOKENS, topk, 248_320)
        self.rng = rng

    def quantize(self, encoding: str, pieces: int) -> None:
        """The pool's codes and scales in a quantized encoding (what the device would copy to the host)."""
        from shards.quant import quantize_bf16_bits

        self.quantized = quantize_bf16_bits(self.hidden_TW, encoding, pieces)

    def window(self, n_tokens: int) -> slice:
        start = int(self.rng.integers(0, POOL_TOKENS - n_tokens + 1))
        return slice(start, start + n_tokens)


def make_batches(args, syn: Synthetic) -> list[list]:
    """Micro-batches of tokenized samples (as the pipeline plans them), each sample with its pool slice."""
    from benchmarks.extract import length_mix
    from common.hashing import sample_id
    from extract.batching import plan_micro_batches
    from extract.corpus.rendering import TokenizedSample

    lengths = length_mix(args.tokens, args.min_len, args.max_len, np.random.default_rng(args.seed))
    samples = []
    for position, n in enumerate(lengths):
        input_ids = syn.rng.integers(0, 248_320, n, dtype=np.int32)
        loss_mask = np.ones(n, dtype=np.uint8)
        tokenized = TokenizedSample(
            position, f"bench:{position + 1}", sample_id(input_ids, loss_mask), input_ids, loss_mask
        )
        samples.append((tokenized, syn.window(n)))
    return [[samples[i] for i in plan] for plan in plan_micro_batches(lengths, args.tokens_per_batch)]


# ----------------------------------------------------------------------------------------------
# Stage clock


class StageClock:
    """Charges CPU time (process-wide) and wall time to the innermost running stage.

    `wrap(owner, name, stage)` replaces `owner.name` by a timed wrapper until `restore()`. Only
    meaningful while one thread works at a time (the serial measurement)."""

    def __init__(self):
        self.cpu: dict[str, float] = collections.defaultdict(float)
        self.wall: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self._stack: list[str] = []
        self._mark = (0.0, 0.0)
        self._patched: list = []

    def _charge(self) -> None:
        cpu, wall = time.process_time(), time.perf_counter()
        if self._stack:
            self.cpu[self._stack[-1]] += cpu - self._mark[0]
            self.wall[self._stack[-1]] += wall - self._mark[1]
        self._mark = (cpu, wall)

    @contextlib.contextmanager
    def stage(self, name: str):
        self._charge()
        self._stack.append(name)
        self.calls[name] += 1
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    def wrap(self, owner, name: str, stage: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            with self.stage(stage):
                return original(*args, **kwargs)

        self._patched.append((owner, name, original))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()


class _TimedHasher:
    """An xxh3 hasher whose `update` is charged to the "checksum" stage."""

    def __init__(self, clock: StageClock, hasher):
        self._clock, self._hasher = clock, hasher

    def update(self, data) -> None:
        with self._clock.stage("checksum (xxh3)"):
            self._hasher.update(data)

    def __getattr__(self, name):
        return getattr(self._hasher, name)


def instrument_writer(clock: StageClock) -> None:
    """Time the shard writer's steps (the functions `ShardWriter.write` calls)."""
    import types

    from shards import shard_file
    from shards import writer as W

    clock.wrap(W.ShardWriter, "write", "zstd + IPC framing")  # exclusive: what is left once the parts below are charged
    clock.wrap(W, "validate_sample", "validate")
    clock.wrap(W, "encode_sample", "encode (planes, Arrow arrays)")
    clock.wrap(shard_file.HashingStream, "write", "file write")
    clock.wrap(W.ShardWriter, "_commit_open_shard", COMMIT)
    real = shard_file.xxhash
    shim = types.SimpleNamespace(xxh3_128=lambda: _TimedHasher(clock, real.xxh3_128()))
    shard_file.xxhash = shim
    clock._patched.append((shard_file, "xxhash", real))


def open_writer(root: str, args, width: int, hidden_split: int = 1):
    from shards import ShardWriter

    kwargs = (
        {"shard_bytes": args.shard_bytes, "hidden_split": hidden_split}
        if args.shard_bytes
        else {"hidden_split": hidden_split}
    )
    if args.write_behind_bytes is not None:
        kwargs["write_behind_bytes"] = args.write_behind_bytes or None
    return ShardWriter(
        root,
        provenance={},
        hidden_width=width,
        topk=args.topk,
        manifest_name="manifest.rank000.json",
        shard_prefix="r000-shard",
        hidden_encoding=getattr(args, "encoding", "planes"),
        **kwargs,
    )


# ----------------------------------------------------------------------------------------------
# The current path: the pipeline's HostPath


class CurrentRun:
    """A HostPath over a real ShardWriter, rejects file and buffer pool, as `pipeline._forward_loop` builds it."""

    def __init__(self, args, syn: Synthetic, root: str):
        from extract.batching import BufferPool
        from extract.host_path import HostPath
        from extract.sink import Progress, RejectLog

        self.syn = syn
        self.writer = open_writer(root, args, syn.width, hidden_split(args))
        self.rejects = RejectLog(os.path.join(root, "rejects.rank000.jsonl"), 0)
        self.pool = BufferPool(
            args.inflight_batches,
            n_taps=syn.n_taps,
            hidden_size=syn.hidden,
            token_budget=args.tokens_per_batch,
            topk=args.topk,
            pin=False,
            encoding=self.writer.encoding,
            hidden_split=self.writer.hidden_split,
        )
        self.stats = collections.Counter()
        self.path = HostPath(
            self.writer,
            self.rejects,
            self.pool,
            Progress(None, "bench", enabled=False),
            self.stats,
            on_error="skip",
            depth=args.inflight_batches,
        )

    def fill(self, host, batch):
        """What the device-to-host copy leaves in the buffer: the planes of each sample's rows, the
        top-k rows packed in sample order, and the device's finite flags."""
        from extract.capture import InFlight

        B, T = len(batch), max(t.n_tokens for t, _ in batch)
        put_hidden = self._hidden_filler(host, B, T)
        offset = 0
        for b, (tokenized, rows) in enumerate(batch):
            L = tokenized.n_tokens
            put_hidden(b, L, rows)
            host.topk_ids[offset : offset + L] = torch.from_numpy(self.syn.topk_ids[rows])
            host.topk_logprobs[offset : offset + L] = torch.from_numpy(self.syn.topk_logprobs[rows])
            offset += L
        host.hidden_ok[:B] = True
        host.logits_ok[:B] = True
        return InFlight(host, [t.n_tokens for t, _ in batch], T, events=[], keepalive=[])

    def _hidden_filler(self, host, B: int, T: int):
        """put(b, L, rows): sample b's hidden rows in the buffer's layout: byte planes, or for a
        quantized encoding codes and scales per piece (and zero reconstruction error sums, which
        the device would compute: only their cost on the host counts here)."""
        if host.quant is not None:
            from shards.quant import scales_to_torch

            codes, scales = host.hidden_view(B, T)  # [S, B, T, code width], [S, B, T, scale width]
            host.error_rows(B).zero_()

            def put_quantized(b: int, L: int, rows) -> None:
                for j, (c, g) in enumerate(zip(self.syn.quantized.codes, self.syn.quantized.scales, strict=True)):
                    codes[j, b, :L] = torch.from_numpy(c[rows])
                    scales[j, b, :L] = scales_to_torch(g[rows])

            return put_quantized
        planes = host.hidden_view(B, T)  # [2, S, B, T, W / S]
        S, piece_width = planes.shape[1], planes.shape[-1]

        def put_planes(b: int, L: int, rows) -> None:
            for plane, values_TW in enumerate((self.syn.hi_TW, self.syn.lo_TW)):
                planes[plane, :, b, :L] = (
                    torch.from_numpy(values_TW[rows]).unflatten(-1, (S, piece_width)).transpose(0, 1)
                )

        return put_planes

    def close(self) -> None:
        self.path.finish()
        self.writer.stage_state["rejects_bytes"] = self.rejects.sync()
        self.rejects.close()
        self.writer.close()


def current_serial(args, syn, batches, root) -> dict:
    from extract import host_path

    clock = StageClock()
    instrument_writer(clock)
    clock.wrap(host_path, "sample_views", "unpack (cut sample out of the buffer)")
    fill = FillMeter()
    start = run_start()
    try:
        run = CurrentRun(args, syn, root)
        for batch in batches:
            host = run.pool.acquire()
            inflight = fill(run.fill, host, batch)
            run.path.store(run.path.cut(inflight, [t for t, _ in batch], [True] * len(batch)))
            run.pool.release(host)
        run.close()
    finally:
        clock.restore()
    assert run.stats["tokens"] == n_tokens(batches), (run.stats, n_tokens(batches))
    return serial_result(clock, start, fill, batches)


def current_pipelined(args, syn, batches, root) -> dict:
    run = CurrentRun(args, syn, root)
    fill = FillMeter()
    start = run_start()
    for batch in batches:
        host = run.path.acquire()
        inflight = fill(run.fill, host, batch)
        run.path.put_batch(inflight, [t for t, _ in batch], [True] * len(batch), 0.0)
    run.close()
    assert run.stats["tokens"] == n_tokens(batches), (run.stats, n_tokens(batches))
    return pipelined_result(start, fill, batches)


# ----------------------------------------------------------------------------------------------
# The legacy path (before 2026-12-01), reproduced for comparison


class LegacyBuffers:
    """The old host buffer: taps as bf16 [n_taps, B, T, H], one region per tap."""

    def __init__(self, args, syn: Synthetic):
        self.syn = syn
        self.hidden = torch.empty(syn.n_taps * args.tokens_per_batch * syn.hidden, dtype=torch.bfloat16)
        self.topk_ids = torch.empty(args.tokens_per_batch, args.topk, dtype=torch.int32)
        self.topk_logprobs = torch.empty(args.tokens_per_batch, args.topk, dtype=torch.float32)

    def view(self, B: int, T: int) -> torch.Tensor:
        return self.hidden[: self.syn.n_taps * B * T * self.syn.hidden].view(self.syn.n_taps, B, T, self.syn.hidden)

    def fill(self, batch) -> tuple[int, list[int]]:
        """What the device-to-host copies leave in the buffer."""
        B, T = len(batch), max(t.n_tokens for t, _ in batch)
        taps = self.view(B, T)
        offset = 0
        for b, (tokenized, rows) in enumerate(batch):
            L = tokenized.n_tokens
            src = (
                torch.from_numpy(self.syn.hidden_TW[rows])
                .view(torch.bfloat16)
                .view(L, self.syn.n_taps, self.syn.hidden)
            )
            taps[:, b, :L].copy_(src.permute(1, 0, 2))
            self.topk_ids[offset : offset + L] = torch.from_numpy(self.syn.topk_ids[rows])
            self.topk_logprobs[offset : offset + L] = torch.from_numpy(self.syn.topk_logprobs[rows])
            offset += L
        return T, [t.n_tokens for t, _ in batch]


def legacy_unpack(buf: LegacyBuffers, B: int, T: int, b: int, L: int, offset: int):
    """The old `extract.capture.unpack_sample`: copy sample b out of the buffer."""
    taps_SLH = buf.view(B, T)[:, b, :L, :]
    n_taps, H = taps_SLH.shape[0], taps_SLH.shape[2]
    hidden_LW = torch.empty(L, n_taps * H, dtype=torch.bfloat16)
    hidden_LW.view(L, n_taps, H).copy_(taps_SLH.permute(1, 0, 2))
    topk_ids = buf.topk_ids[offset : offset + L].numpy().copy()
    topk_logprobs = buf.topk_logprobs[offset : offset + L].numpy().copy()
    return hidden_LW.view(torch.uint16).numpy(), topk_ids, topk_logprobs


def legacy_serial(args, syn, batches, root) -> dict:
    from shards import Sample

    clock = StageClock()
    instrument_writer(clock)
    buf = LegacyBuffers(args, syn)
    fill = FillMeter()
    start = run_start()
    try:
        writer = open_writer(root, args, syn.width)
        for batch in batches:
            T, lengths = fill(buf.fill, batch)
            offset = 0
            for b, (tokenized, _) in enumerate(batch):
                with clock.stage("unpack (cut sample out of the buffer)"):
                    hidden, ids, logprobs = legacy_unpack(buf, len(batch), T, b, lengths[b], offset)
                offset += lengths[b]
                writer.write(
                    Sample(tokenized.sample_id, tokenized.input_ids, tokenized.loss_mask, hidden, ids, logprobs)
                )
        writer.close()
    finally:
        clock.restore()
    return serial_result(clock, start, fill, batches)


def legacy_pipelined(args, syn, batches, root) -> dict:
    """The old worker layout: "assemble" copies samples out and frees the buffer, "write" writes."""
    from extract.sink import Worker
    from shards import Sample

    pool = [LegacyBuffers(args, syn) for _ in range(args.inflight_batches)]
    free: collections.deque = collections.deque(pool)
    available = threading.Semaphore(len(pool))
    writer = open_writer(root, args, syn.width)

    def write(item):
        for sample in item:
            writer.write(sample)

    def assemble(item):
        buf, batch, T, lengths = item
        out, offset = [], 0
        for b, (tokenized, _) in enumerate(batch):
            hidden, ids, logprobs = legacy_unpack(buf, len(batch), T, b, lengths[b], offset)
            offset += lengths[b]
            out.append(Sample(tokenized.sample_id, tokenized.input_ids, tokenized.loss_mask, hidden, ids, logprobs))
        free.append(buf)
        available.release()
        writing.put(out)

    writing = Worker("write", write, maxsize=2)
    assembling = Worker("assemble", assemble, maxsize=args.inflight_batches)
    fill = FillMeter()
    start = run_start()
    for batch in batches:
        available.acquire()
        buf = free.popleft()
        T, lengths = fill(buf.fill, batch)
        assembling.put((buf, batch, T, lengths), also_check=(writing,))
    assembling.finish()
    writing.finish()
    writer.close()
    return pipelined_result(start, fill, batches)


# ----------------------------------------------------------------------------------------------
# Results


def n_tokens(batches) -> int:
    return sum(t.n_tokens for batch in batches for t, _ in batch)


class FillMeter:
    """Calls the buffer filling (the stand-in for the GPU's copy engine) and sums its CPU time
    and page faults on the calling thread, so they can be left out of the host path's cost."""

    def __init__(self):
        self.cpu, self.faults = 0.0, 0

    def __call__(self, fn, *args):
        cpu, faults = time.thread_time(), resource.getrusage(RUSAGE_THREAD).ru_minflt
        try:
            return fn(*args)
        finally:
            self.cpu += time.thread_time() - cpu
            self.faults += resource.getrusage(RUSAGE_THREAD).ru_minflt - faults


def run_start() -> tuple:
    """(process CPU, wall, minor page faults) at the start of a measurement."""
    return time.process_time(), time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def faults_per_token(start, fill_faults: int, batches) -> float:
    """Minor page faults per token (first touches of fresh memory: the kernel's share of the cost)."""
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start[2] - fill_faults) / n_tokens(batches)


def serial_result(clock: StageClock, start, fill: FillMeter, batches) -> dict:
    tokens = n_tokens(batches)
    total_cpu = time.process_time() - start[0] - fill.cpu
    stages = {
        name: {
            "cpu_us_per_token": 1e6 * cpu / tokens,
            "wall_us_per_token": 1e6 * clock.wall[name] / tokens,
            "calls": clock.calls[name],
        }
        for name, cpu in clock.cpu.items()
    }
    other = total_cpu - sum(clock.cpu.values())
    stages["other (driver loop, Sample objects)"] = {
        "cpu_us_per_token": 1e6 * other / tokens,
        "wall_us_per_token": None,
        "calls": None,
    }
    return {
        "tokens": tokens,
        "samples": sum(len(b) for b in batches),
        "batches": len(batches),
        "cpu_us_per_token": 1e6 * total_cpu / tokens,
        "page_faults_per_token": faults_per_token(start, fill.faults, batches),
        "stages": stages,
    }


def pipelined_result(start, fill: FillMeter, batches) -> dict:
    tokens = n_tokens(batches)
    cpu = time.process_time() - start[0] - fill.cpu
    wall = time.perf_counter() - start[1]
    return {
        "tokens": tokens,
        "cpu_us_per_token": 1e6 * cpu / tokens,
        "page_faults_per_token": faults_per_token(start, fill.faults, batches),
        "wall_s": wall,
        "wall_tok_s": tokens / wall,
    }


def format_report(report: dict) -> str:
    lines = [
        f"benchmarks.extract_host  encoding {report.get('encoding', 'planes')}  W={report['width']:,} "
        f"top-{report['topk']}  {report['tokens']:,} tokens in "
        f"{report['samples']} samples / {report['batches']} micro-batches  ({report['machine']})"
    ]
    for path, pc in report["plane_compression"].items():
        lines.append(
            f"zstd alone [{path}, {pc['split']} piece(s) per plane]: high plane {pc['zstd_hi_us_per_token']:.1f} "
            "us/token "
            f"(ratio {pc['zstd_hi_ratio']:.3f}), low plane {pc['zstd_lo_us_per_token']:.1f} us/token (ratio "
            f"{pc['zstd_lo_ratio']:.3f}), "
            f"slowest piece {pc['zstd_slowest_piece_us_per_token']:.1f}"
        )
    lines.append("")
    for path, result in report["paths"].items():
        serial = result.get("serial")
        if serial:
            lines.append(
                f"[{path}] serial: CPU (and wall) us per token by stage, best of "
                f"{len(serial['all_runs_cpu_us_per_token'])}"
            )
            for name, s in sorted(serial["stages"].items(), key=lambda kv: -kv[1]["cpu_us_per_token"]):
                wall = "" if s["wall_us_per_token"] is None else f"  ({s['wall_us_per_token']:.2f})"
                lines.append(f"  {name:<52} {s['cpu_us_per_token']:8.2f}{wall}")
            lines.append(
                f"  {'total':<52} {serial['cpu_us_per_token']:8.2f}  = {1e6 / serial['cpu_us_per_token']:,.0f} "
                "tok/s per core"
                f"; {serial['page_faults_per_token']:.1f} page faults/token"
            )
            critical = serial.get("write_thread_serial_us_per_token")
            if critical is not None:  # (derived from the planes' zstd; not computed for a quantized encoding)
                lines.append(
                    f"  {'in series on the write thread (incl. fsync wait)':<52} {critical:8.2f}  = at most "
                    f"{1e6 / critical:,.0f} tok/s per rank"
                )
        piped = result.get("pipelined")
        if piped:
            lines.append(
                f"[{path}] pipelined: {piped['cpu_us_per_token']:.2f} CPU us/token in all threads (runs: "
                + ", ".join(f"{x:.1f}" for x in piped["all_runs_cpu_us_per_token"])
                + f"); {piped['page_faults_per_token']:.1f} page faults/token; wall {piped['wall_s']:.1f} s = "
                f"{piped['wall_tok_s']:,.0f} tok/s on this machine"
            )
        lines.append("")
    return "\n".join(lines)


def hidden_split(args) -> int:
    return args.hidden_split or args.taps


def plane_compression(syn: Synthetic, level: int, split: int) -> dict:
    """CPU us per token of zstd on each byte plane, in `split` column pieces (one buffer each, as
    the IPC writer does): the writer compresses all pieces of a sample in parallel, so the slowest
    piece is the irreducible serial part of writing a sample."""
    import pyarrow as pa

    codec = pa.Codec("zstd", level)
    out = {"split": split, "zstd_slowest_piece_us_per_token": 0.0}
    width = syn.width // split
    for name, plane in (("hi", syn.hi_TW), ("lo", syn.lo_TW)):
        codec.compress(plane[:256])
        seconds, nbytes = 0.0, 0
        for j in range(split):
            piece = np.ascontiguousarray(plane[:, j * width : (j + 1) * width])
            start = time.process_time()
            nbytes += codec.compress(piece).size
            elapsed = time.process_time() - start
            seconds += elapsed
            out["zstd_slowest_piece_us_per_token"] = max(
                out["zstd_slowest_piece_us_per_token"], 1e6 * elapsed / plane.shape[0]
            )
        out[f"zstd_{name}_us_per_token"] = 1e6 * seconds / plane.shape[0]
        out[f"zstd_{name}_ratio"] = nbytes / plane.nbytes
    return out


def measure_all(args, syn, batches, base: str, paths: list[str], modes: list[str]) -> dict:
    """{path: {mode: result}}, each the cheapest (CPU per token) of `repeats` runs. The first
    touches of fresh memory and page cache cost several times the steady state on a VM, so the
    page cache is warmed first and the paths take turns going first."""
    runners = {
        "current": {"serial": current_serial, "pipelined": current_pipelined},
        "legacy": {"serial": legacy_serial, "pipelined": legacy_pipelined},
    }
    warm_page_cache(base, n_tokens(batches) * syn.width * 3 // 2)
    for path in paths:  # imports, allocator pools
        runners[path]["serial"](args, syn, batches[:1], os.path.join(base, f"{path}-warmup"))
    runs: dict = collections.defaultdict(list)
    for repeat in range(args.repeats):
        for path in paths if repeat % 2 == 0 else paths[::-1]:
            for mode in modes:
                root = os.path.join(base, f"{path}-{mode}-{repeat}")
                runs[path, mode].append(runners[path][mode](args, syn, batches, root))
                shutil.rmtree(root, ignore_errors=True)
    results: dict = {}
    for (path, mode), measured in runs.items():
        best = dict(min(measured, key=lambda r: r["cpu_us_per_token"]))
        best["all_runs_cpu_us_per_token"] = [r["cpu_us_per_token"] for r in measured]
        results.setdefault(path, {})[mode] = best
    return results


def warm_page_cache(base: str, nbytes: int) -> None:
    """Write and delete a file as large as what a run writes."""
    path = os.path.join(base, "warm.bin")
    block = np.ones(1 << 24, dtype=np.uint8)
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes >> 24)):
            f.write(block)
    os.remove(path)


COMMIT = "commit (footer, index, fsync, rename, manifest)"


def critical_path(serial: dict, planes: dict) -> float:
    """us per token the write thread spends in series: all CPU but the cutting (another thread)
    and the zstd of every piece but the slowest (they run beside it in pyarrow's pool), plus the
    time it waits for fsync at commits."""
    stages = serial["stages"]
    unpack = stages.get("unpack (cut sample out of the buffer)", {}).get("cpu_us_per_token", 0.0)
    commit = stages.get(COMMIT, {"cpu_us_per_token": 0.0, "wall_us_per_token": 0.0})
    fsync_wait = max(0.0, commit["wall_us_per_token"] - commit["cpu_us_per_token"])
    parallel = (
        planes["zstd_hi_us_per_token"] + planes["zstd_lo_us_per_token"] - planes["zstd_slowest_piece_us_per_token"]
    )
    return serial["cpu_us_per_token"] - unpack - parallel + fsync_wait


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    import pyarrow as pa

    from shards import DEFAULT_ZSTD_LEVEL

    torch.set_num_threads(1)  # as under torchrun (OMP_NUM_THREADS=1); the host path's torch work is copies
    pa.set_cpu_count(args.writer_threads)
    t0 = time.perf_counter()
    syn = Synthetic(args.taps, args.hidden, args.topk, args.seed)
    quantized = args.encoding != "planes"
    if quantized:
        if args.path != "current":
            print(
                "benchmarks.extract_host: --encoding other than planes measures the current path only (--path current)",
                file=sys.stderr,
            )
            return 2
        syn.quantize(args.encoding, hidden_split(args))
    batches = make_batches(args, syn)
    print(f"synthetic inputs in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    base = tempfile.mkdtemp(prefix="bench-host-", dir=args.dir)
    paths = ["current", "legacy"] if args.path == "both" else [args.path]
    modes = ["serial", "pipelined"] if args.mode == "both" else [args.mode]
    try:
        results = measure_all(args, syn, batches, base, paths, modes)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    planes = (
        {}
        if quantized
        else {
            path: plane_compression(syn, DEFAULT_ZSTD_LEVEL, 1 if path == "legacy" else hidden_split(args))
            for path in results
        }
    )
    for path, result in results.items():
        if "serial" in result and path in planes:
            result["serial"]["write_thread_serial_us_per_token"] = critical_path(result["serial"], planes[path])
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python -m benchmarks.extract_host " + " ".join(argv),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, load "
        f"{os.getloadavg()[0]:.1f}",
        "pyarrow": pa.__version__,
        "numpy": np.__version__,
        "torch": torch.__version__,
        "encoding": args.encoding,
        "width": syn.width,
        "topk": args.topk,
        "tokens": n_tokens(batches),
        "samples": sum(len(b) for b in batches),
        "batches": len(batches),
        "writer_threads": args.writer_threads,
        "repeats": args.repeats,
        "plane_compression": planes,
        "paths": results,
    }
    print(format_report(report), flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.extract_host", main))
