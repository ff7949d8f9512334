"""What the "Today" section of docs/benchmarks.md and the README's results table show: which figure of which
record, labelled how, beside which goal. `benchmarks.render` fills them from the records in benchmarks/results/.

A `Figures` table has one row per figure (`Fig`): the newest record that holds the figure gives its value and is
linked in the row. A `Series` table shows the rows of one list figure of the newest record that holds it. A figure
no record holds reads "not yet measured", with what measures it (`measured_by`: a suite of `make bench-gpu`, or a
command).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Fig:
    label: str
    key: str
    fmt: str = "{:,.3f}"  # str.format of the value (a bool reads yes / no, a string as it is)
    goal: str = ""
    measured_by: str = ""  # where it differs from its table's


@dataclasses.dataclass(frozen=True)
class Figures:
    title: str
    measured_by: str
    rows: tuple[Fig, ...]
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Series:
    title: str
    measured_by: str
    key: str
    columns: tuple[tuple[str, str, str], ...]  # (header, field of a row, format)
    note: str = ""


def suite(name: str) -> str:
    return f"suite:{name}"


SUITE_TEXT = {
    "real": "SmolLM2-135M-Instruct end to end: offline and online τ, lossless, speed-up, the peers; DFlash2 beside it",
    "real-data": "τ against training data at equal steps; hard CE against CE + KL on the stored top-k, seeds",
    "tiers-real": "the storage tiers trained side by side on SmolLM2: bytes and τ against lossless",
    "shape27b": "the Qwen3.6-27B shape: the speculative round and its projected speed-up, extraction, training MFU",
    "s3": "training from and extraction into a local moto_server at 0/20/80 ms, against local disk",
}

TAU = "{:.3f}"
MS = "{:.2f} ms"
TOKS = "{:,.0f}"
X = "{:.2f}x"
PCT = "{:.1%}"
SMALL_PCT = "{:.3%}"

REAL = Figures(
    "Real target: SmolLM2-135M-Instruct end to end",
    suite("real"),
    (
        Fig("drafter training steps", "real.training.steps", "{:,}"),
        Fig("offline chain τ, HumanEval (16 anchors per answer)", "real.eval.humaneval.tau", TAU),
        Fig("offline DDTree-64 τ, HumanEval", "real.eval.humaneval.ddtree_tau_64", TAU),
        Fig("offline chain τ, held-out chat", "real.eval.chat_heldout.tau", TAU),
        Fig("offline DDTree-64 τ, held-out chat", "real.eval.chat_heldout.ddtree_tau_64", TAU),
        Fig("online τ, HumanEval, batch 1, <= 256 tokens", "real.online.tau", TAU),
        Fig("HumanEval prompts decoded online", "real.online.prompts", "{:,}"),
        Fig("lossless (speculative = target-only greedy, token for token)", "real.online.lossless", "{}"),
        Fig("speed-up against target-only greedy decoding, decode", "real.online.speedup", X, "2.5x"),
        Fig("speed-up against target-only greedy decoding, wall", "real.online.speedup_wall", X),
        Fig("target-only greedy decoding", "real.online.target_ms_per_token", "{:.2f} ms/token"),
        Fig("transformers prompt-lookup decoding, speed-up (wall)", "real.peers.prompt_lookup.speedup_wall", X),
        Fig("transformers `generate`, speed-up (wall)", "real.peers.generate.speedup_wall", X),
        Fig("build to the online decoding step", "real.to_decoding_s", "{:,.0f} s"),
        Fig("the whole pipeline at the scale that ran (steps and prompts above)", "real.suite_s", "{:,.0f} s"),
    ),
    "Speed-ups count the same decoding's target-only greedy decoding on our static cache with CUDA graphs.",
)

SPLITS = (("humaneval", "HumanEval"), ("chat_heldout", "held-out chat"))
REAL_DFLASH2 = Figures(
    "Real target: DFlash2 against DFlash on SmolLM2-135M-Instruct, the same shards and steps (one seed)",
    suite("real"),
    (
        Fig("DFlash2 drafter training steps", "real.dflash2.training.steps", "{:,}"),
        Fig("DFlash2 training time / DFlash's (the same steps)", "real.dflash2.training_s_over_dflash", "{:.2f}"),
        *(
            Fig(f"offline {kind} τ, {name}: {whose}", f"real.dflash2.eval.{split}.{key}", TAU)
            for split, name in SPLITS
            for kind, whose, key in (
                ("chain", "the selector's walk", "tau"),
                ("chain", "unary top-1", "unary_tau"),
                ("DDTree-64", "the selector's tree", "ddtree_tau_64"),
                ("DDTree-64", "unary", "unary_ddtree_tau_64"),
            )
        ),
        *(
            Fig(f"{kind} τ / DFlash's, {name}", f"real.dflash2.eval.{split}.{key}_over_dflash", "{:.3f}", goal)
            for kind, key, goal in (("chain", "tau", "> 1"), ("DDTree-64", "ddtree_tau_64", ""))
            for split, name in SPLITS
        ),
        Fig("online τ, HumanEval, batch 1, <= 256 tokens", "real.dflash2.online.tau", TAU),
        Fig("HumanEval prompts decoded online (the first of DFlash's)", "real.dflash2.online.prompts", "{:,}"),
        Fig("online τ / DFlash's, the same prompts", "real.dflash2.online.tau_over_dflash", "{:.3f}", "> 1"),
        Fig("lossless (speculative = target-only greedy, token for token)", "real.dflash2.online.lossless", "{}"),
        Fig("speed-up against target-only greedy decoding, wall", "real.dflash2.online.speedup_wall", X),
    ),
    "The DFlash2 drafter's τ is its selector's proposals (what it serves); unary: its head's argmax, on the same "
    "blocks. Ratios only where both drafters trained the same steps (offline) or decoded the same prompts (online).",
)

LADDER_COLUMNS = (
    ("training data", "data", "{}"),
    ("loss", "loss", "{}"),
    ("seed", "seed", "{}"),
    ("samples", "samples", "{:,}"),
    ("epochs", "epochs", "{:.1f}"),
    ("steps", "steps", "{:,}"),
    ("HumanEval chain τ", "humaneval_tau", TAU),
    ("chat chain τ", "chat_heldout_tau", TAU),
    ("HumanEval DDTree-64", "humaneval_ddtree_tau_64", TAU),
    ("chat DDTree-64", "chat_heldout_ddtree_tau_64", TAU),
)
REAL_DATA = (
    Series(
        "τ against training data: shares of the pool, equal steps",
        suite("real-data"),
        "real_data.ladder",
        LADDER_COLUMNS,
    ),
    Series("τ against the data's source, equal steps", suite("real-data"), "real_data.sources", LADDER_COLUMNS),
    Series(
        "Loss at small data: hard cross-entropy against cross-entropy plus KL on the stored top-k",
        suite("real-data"),
        "real_data.loss",
        LADDER_COLUMNS,
    ),
    Figures(
        "The stored top-k at small data, in one number",
        suite("real-data"),
        (
            Fig(
                "chain τ with the KL term minus without, HumanEval (mean over seeds)",
                "real_data.kl_minus_hard.humaneval",
                "{:+.3f}",
            ),
            Fig("the same, held-out chat", "real_data.kl_minus_hard.chat_heldout", "{:+.3f}"),
            Fig("KL weight", "real_data.kl_weight", "{:g}"),
        ),
    ),
)

TIERS_REAL = Series(
    "Storage tiers on SmolLM2 (mean over seeds; change against lossless)",
    suite("tiers-real"),
    "tiers_real.rows",
    (
        ("tier", "tier", "{}"),
        ("bytes/token", "bytes_per_token", TOKS),
        ("vs raw bf16", "vs_raw_bf16", "{:.3f}"),
        ("HumanEval chain τ", "chain_tau_humaneval", TAU),
        ("change", "delta_chain_tau_humaneval", "{:+.1%}"),
        ("chat chain τ", "chain_tau_chat_heldout", TAU),
        ("change", "delta_chain_tau_chat_heldout", "{:+.1%}"),
        ("online τ, HumanEval", "online_tau_humaneval", TAU),
        ("seeds", "seeds", "{}"),
    ),
)

# The one-token step's layer kinds (benchmarks.step_profile.KINDS), as the round's figures key them.
STEP_KINDS = (
    ("Gated DeltaNet", "gated_deltanet"),
    ("attention", "attention"),
    ("MLP", "mlp"),
    ("output head (248,320 rows)", "head"),
    ("other", "other"),
)
ANCHOR = (
    "Published anchor, measured end to end (not projected): DFlash paper (arXiv 2602.06036), Table 1, Qwen3-8B "
    "on one H200, Transformers backend, HumanEval: τ 6.50, 5.14x."
)
ROUND = Figures(
    "The speculative round at the Qwen3.6-27B shape (random weights, bf16, batch 1)",
    suite("shape27b"),
    (
        Fig("graphed: how it ran", "shape27b.round.graphed.how", "{}"),
        Fig(
            "graphed: the target's one-token step",
            "shape27b.round.graphed.step_ms",
            MS,
            "~11 ms on an H200 (54 GB at 4.8 TB/s), ~16 ms on an H100 (3.35 TB/s)",
        ),
        Fig("graphed: the 16-token verify", "shape27b.round.graphed.verify16_ms", MS),
        Fig("graphed: verify / step", "shape27b.round.graphed.verify_over_step", X, "<= 1.15x"),
        Fig("graphed: the drafter's proposal (published layout, 5 layers)", "shape27b.round.graphed.propose_ms", MS),
        Fig("graphed: proposal / step", "shape27b.round.graphed.propose_over_step", X, "<= 0.15x"),
        Fig("graphed: break-even τ (projected)", "shape27b.round.graphed.break_even_tau", "{:.2f}"),
        Fig("graphed: speed-up at τ 6.5 (projected)", "shape27b.round.graphed.speedup_at_anchor_tau", X, ">= 5x"),
        Fig("graphed, with rollback (how decoding runs a hybrid target): how", "shape27b.round.rollback.how", "{}"),
        Fig("graphed, with rollback: one-token step", "shape27b.round.rollback.step_ms", MS),
        Fig("graphed, with rollback: weight-streaming bound of the step", "shape27b.round.rollback.bound_ms", MS),
        Fig("graphed, with rollback: step / bound", "shape27b.round.rollback.step_over_bound", X, "<= 1.3x"),
        Fig(
            "graphed, with rollback: 16-token verify (per-token states kept)", "shape27b.round.rollback.verify16_ms", MS
        ),
        Fig(
            "graphed, with rollback: rollback (the accepted length's states)", "shape27b.round.rollback.rollback_ms", MS
        ),
        Fig(
            "graphed, with rollback: (verify + rollback) / step",
            "shape27b.round.rollback.verify_rollback_over_step",
            X,
            "<= 1.2x",
        ),
        Fig("graphed, with rollback: proposal", "shape27b.round.rollback.propose_ms", MS),
        Fig("graphed, with rollback: break-even τ (projected)", "shape27b.round.rollback.break_even_tau", "{:.2f}"),
        Fig(
            "graphed, with rollback: speed-up at τ 6.5 (projected)",
            "shape27b.round.rollback.speedup_at_anchor_tau",
            X,
            ">= 4.5x",
        ),
        *(
            Fig(f"one-token step: {what} kernels", f"shape27b.round.rollback.step_kernels.{key}_ms", MS)
            for what, key in STEP_KINDS
        ),
        Fig("one-token step: launches and idle in the graph", "shape27b.round.rollback.launches_idle_ms", MS),
        Fig("eager fallback (cache copy + re-run; before: every hybrid target): how", "shape27b.round.eager.how", "{}"),
        Fig("eager: one-token step", "shape27b.round.eager.step_ms", MS),
        Fig("eager: 16-token verify", "shape27b.round.eager.verify16_ms", MS),
        Fig("eager: cache snapshot before the verify", "shape27b.round.eager.snapshot_ms", MS),
        Fig("eager: proposal", "shape27b.round.eager.propose_ms", MS),
        Fig(
            "eager: break-even τ (projected, with the re-run of the accepted tokens)",
            "shape27b.round.eager.break_even_tau",
            "{:.2f}",
        ),
        Fig("eager: speed-up at τ 6.5 (projected)", "shape27b.round.eager.speedup_at_anchor_tau", X),
    ),
    ANCHOR,
)
PROJECTION = Series(
    "Projected speed-up against target-only greedy decoding at the 27B shape (measured costs, τ the variable)",
    suite("shape27b"),
    "shape27b.round.projection",
    (
        ("τ", "tau", "{}"),
        ("graphed: round", "graphed_round_ms", MS),
        ("graphed: speed-up (projected)", "graphed_speedup", X),
        ("graphed, with rollback: round", "rollback_round_ms", MS),
        ("graphed, with rollback: speed-up (projected)", "rollback_speedup", X),
        ("eager: round", "eager_round_ms", MS),
        ("eager: speed-up (projected)", "eager_speedup", X),
    ),
    ANCHOR,
)

EXTRACTION = Figures(
    "Extraction at the Qwen3.6-27B shape (random weights; tok/s of the full extraction writing finished shards)",
    suite("shape27b"),
    (
        Fig("packed rows, five taps: full", "shape27b.extract_packed5.full_tok_s", "{:,.0f} tok/s"),
        Fig("packed rows, five taps: bare forward", "shape27b.extract_packed5.bare_tok_s", "{:,.0f} tok/s"),
        Fig("packed rows, five taps: full / bare", "shape27b.extract_packed5.full_over_bare", "{:.3f}", ">= 0.95"),
        Fig("packed rows, five taps: full TFLOP/s", "shape27b.extract_packed5.full_tflops", "{:.1f}"),
        Fig("packed rows, five taps: bare TFLOP/s", "shape27b.extract_packed5.bare_tflops", "{:.1f}", ">= 500"),
        Fig("packed rows, five taps: the cold first pass", "shape27b.extract_packed5.cold_tok_s", "{:,.0f} tok/s"),
        Fig("packed rows, five taps: bytes/token on disk", "shape27b.extract_packed5.bytes_per_token", TOKS),
        Fig("padded rows, five taps: full", "shape27b.extract_unpacked5.full_tok_s", "{:,.0f} tok/s"),
        Fig("padded rows, five taps: full / bare", "shape27b.extract_unpacked5.full_over_bare", "{:.3f}"),
        Fig("packed rows, four taps: full", "shape27b.extract_packed4.full_tok_s", "{:,.0f} tok/s"),
        Fig("packed rows, four taps: full / bare", "shape27b.extract_packed4.full_over_bare", "{:.3f}"),
        Fig("padded rows, four taps: full", "shape27b.extract_unpacked4.full_tok_s", "{:,.0f} tok/s"),
        Fig("padded rows, four taps: full / bare", "shape27b.extract_unpacked4.full_over_bare", "{:.3f}"),
        Fig(
            "padded rows, four taps, two H200: full (both)",
            "shape27b.extract_unpacked4_2gpu.full_tok_s",
            "{:,.0f} tok/s",
            measured_by="torchrun --nproc-per-node 2 -m benchmarks.extract",
        ),
    ),
)
TRAINING = Figures(
    "Drafter training at the 27B widths on one H200 (compiled, flex attention, bf16 autocast)",
    suite("shape27b"),
    (
        Fig("stream (synthetic shards, budget 6,144): step (median)", "shape27b.train_stream.step_s", "{:.3f} s"),
        Fig("stream: MFU", "shape27b.train_stream.mfu", PCT),
        Fig("stream: fetch fraction", "shape27b.train_stream.fetch_frac", SMALL_PCT),
        Fig("stream: peak memory", "shape27b.train_stream.peak_gib", "{:.1f} GiB"),
        Fig("the published layout (27b-zlab, fixed batch 2 x 4,096): step", "shape27b.train_zlab.step_s", "{:.3f} s"),
        Fig("the published layout: MFU", "shape27b.train_zlab.mfu", PCT),
        Fig("the published layout: peak memory", "shape27b.train_zlab.peak_gib", "{:.1f} GiB"),
        Fig("DFlash2 on the stream's batches (block 16): step (median)", "shape27b.train_dflash2.step_s", "{:.3f} s"),
        Fig("DFlash2: MFU", "shape27b.train_dflash2.mfu", PCT),
        Fig("DFlash2: MFU / DFlash's (stream)", "shape27b.train_dflash2.mfu_vs_dflash", "{:.3f}", ">= 0.90"),
        Fig("DFlash2: peak memory", "shape27b.train_dflash2.peak_gib", "{:.1f} GiB"),
        Fig(
            "data parallel, world size 1 under DDP against the plain trainer: step time",
            "ddp.world1_step_ratio",
            "{:.3f}",
            "<= 1.02",
            "python -m benchmarks.train --phases stream --ddp 1",
        ),
        Fig(
            "data parallel, 2 GPUs against 1 at the same tokens per step: context tok/s",
            "ddp.two_gpu_tok_ratio",
            "{:.2f}",
            ">= 1.9",
            "python -m benchmarks.train --phases stream --ddp 2 --accumulation 2 (nvidia-h200-x2)",
        ),
    ),
)

S3 = (
    Figures(
        "Object storage: a local moto_server on the H200 host against local disk",
        suite("s3"),
        (
            Fig("the server alone: PUT as the shard writer puts", "s3.ceiling.put_shard_writer_MB_s", "{:,.0f} MB/s"),
            Fig("the server alone: ranged GET through the latency proxy", "s3.ceiling.get_proxy_MB_s", "{:,.0f} MB/s"),
            Fig("training, local disk: fetch fraction", "s3.train.local_fetch_frac", SMALL_PCT),
            Fig("training, local disk: step (median)", "s3.train.local_step_s", "{:.3f} s"),
            Fig("extraction to local disk", "s3.extract.local_tok_s", "{:,.0f} tok/s"),
            Fig("extraction into S3", "s3.extract.s3_tok_s", "{:,.0f} tok/s"),
            Fig("extraction into S3 / to local disk", "s3.extract.s3_over_local", "{:.3f}", ">= 0.97"),
        ),
    ),
    Series(
        "Training from S3 with latency per request (the real drafter step at the 27B widths)",
        suite("s3"),
        "s3.train.rows",
        (
            ("latency", "latency_ms", "{:g} ms"),
            ("fetch fraction", "fetch_frac", SMALL_PCT),
            ("step (median)", "step_s", "{:.3f} s"),
            ("step vs local disk", "step_vs_local", "{:.3f}"),
            ("requests/step", "requests_per_step", "{:.1f}"),
        ),
        "Goals: fetch fraction <= 2%, step within 2% of local disk.",
    ),
    Series(
        "Training data stream from S3, scaled to a CPU (the step a 200 ms sleep)",
        "python -m benchmarks.object_store --width 512 --shard-mb 1 --delays-ms 0,20,80 --warmup 15",
        "object_store.rows",
        (
            ("source", "source", "{}"),
            ("fetch fraction", "fetch_frac", "{:.2%}"),
            ("step vs local", "step_vs_local", "{:.3f}"),
            ("batches/s", "batches_per_s", "{:.3f}"),
            ("requests/batch", "requests_per_batch", "{:.1f}"),
        ),
    ),
)

SMALL_DECODE = Figures(
    "Decoding at SmolLM2-135M's shape, batch 1 (random weights)",
    "python -m benchmarks.small_decode --dtype float32 --tokens 128 --compile",
    (
        Fig("float32, static cache + CUDA graphs: one-token step", "small_decode.fp32.graphs.step_ms", MS),
        Fig("float32, graphs + layers compiled (`default`): step", "small_decode.fp32.compiled.step_ms", MS),
        Fig("float32, graphs + `max-autotune`: step", "small_decode.fp32.autotune.step_ms", MS),
        Fig("float32, transformers `generate`, static cache: step", "small_decode.fp32.generate_static.step_ms", MS),
        Fig("float32, graphs: 16-token verify", "small_decode.fp32.graphs.verify16_ms", MS),
        Fig("float32, graphs + layers compiled: 16-token verify", "small_decode.fp32.compiled.verify16_ms", MS),
        Fig("float32, compile time at set-up (`default`)", "small_decode.fp32.compiled.setup_s", "{:.1f} s"),
        Fig("bfloat16, graphs: step", "small_decode.bf16.graphs.step_ms", MS),
        Fig("bfloat16, graphs: 16-token verify", "small_decode.bf16.graphs.verify16_ms", MS),
        Fig("five-layer drafter proposal, float32, graphed", "small_decode.fp32.propose5_graphed_ms", MS),
        Fig("five-layer drafter proposal, bf16, graphed", "small_decode.bf16.propose5_graphed_ms", MS),
    ),
)

REGENERATION = Figures(
    "Regeneration (the target's own answers)",
    "python -m extract.regenerate",
    (
        Fig("SmolLM2, 5,707 training prompts, batch 1,024, static cache + graphs", "regen.smollm2.seconds", "{:.0f} s"),
        Fig("SmolLM2, the same: answer tokens/s", "regen.smollm2.tok_s", TOKS),
        Fig(
            "27B shape, local backend, batch 256 (generated tok/s with the prefill)",
            "regen.27b_local.tok_s",
            TOKS,
            measured_by="python -m benchmarks.regenerate local --batch-sizes 256",
        ),
        Fig(
            "server backend against `transformers serve --continuous-batching`, tiny target, CPU: requests/s",
            "regen.server_cpu.requests_per_s",
            "{:.2f}",
            measured_by="python -m benchmarks.regenerate server",
        ),
    ),
)

DEMO = Figures(
    "Demo: the tiny default end to end",
    "make demo",
    (
        Fig("2-core VM, CPU: demo time", "demo.vm.seconds", "{:.0f} s"),
        Fig("2-core VM: drafter acc@1", "demo.vm.acceptance_k1", TAU),
        Fig("2-core VM: chain τ", "demo.vm.tau", "{:.2f}"),
        Fig("2-core VM: DDTree-64 τ", "demo.vm.ddtree_tau_64", "{:.2f}"),
        Fig("2-core VM: online τ", "demo.vm.online_tau", "{:.2f}"),
        Fig("2-core VM: lossless", "demo.vm.lossless", "{}"),
        Fig("H200 host: demo time", "demo.h200.seconds", "{:.0f} s", measured_by="python3 -m recipes.demo target=tiny"),
        Fig("H200 host: chain τ", "demo.h200.tau", "{:.2f}", measured_by="python3 -m recipes.demo target=tiny"),
        Fig("H200 host: online τ", "demo.h200.online_tau", "{:.2f}", measured_by="python3 -m recipes.demo target=tiny"),
        Fig("H200 host: speed-up", "demo.h200.speedup", X, measured_by="python3 -m recipes.demo target=tiny"),
    ),
)

FORMAT_AND_HOST = Figures(
    "Shard format and the extraction host path (CPU)",
    "python -m benchmarks.shards / python -m benchmarks.extract_host",
    (
        Fig(
            "zstd-1 byte planes (the default): bytes/token, synthetic 27B features",
            "shards.planes.bytes_per_token",
            TOKS,
        ),
        Fig("the same against raw bf16", "shards.planes.vs_raw_bf16", "{:.3f}"),
        Fig("write, MB/s per core", "shards.planes.write_MB_s", "{:,.0f}"),
        Fig("read + decode, tok/s per core", "shards.planes.read_tok_s", TOKS),
        Fig("host path in series on the write thread, H200 host", "host_path.h200.serial_us", "{:.1f} µs/token"),
        Fig("host path: at most, per rank, H200 host", "host_path.h200.max_tok_s", TOKS),
    ),
)

GPU_TIER = Figures(
    "Test suite on a GPU host (the whole tier in one command; now run in parts: `python3 -m tests.gpu_tier PART`)",
    "python3 -m pytest -q -n 4 -rs -m gpu tests/gpu",
    (
        Fig("GPU tier: passed", "tests.gpu.passed", "{:,}"),
        Fig("GPU tier: failed", "tests.gpu.failed", "{:,}"),
        Fig("GPU tier: wall time", "tests.gpu.seconds", "{:.0f} s"),
    ),
)

DFLASH2_TINY = (
    Series(
        "DFlash2 against DFlash on the tiny default: equal data and steps, offline chain τ on the held-out shards "
        "(2-core VM, CPU)",
        "python -m benchmarks.dflash2_tiny",
        "dflash2_tiny.rows",
        (
            ("class", "class", "{}"),
            ("block", "block_size", "{}"),
            ("seed", "seed", "{}"),
            ("steps", "steps", "{}"),
            ("chain τ, unary top-1", "unary_tau", TAU),
            ("chain τ, selector's walk", "selector_tau", TAU),
            ("coverage (last 50 steps)", "coverage", "{:.3f}"),
            ("training", "train_s", "{:.0f} s"),
        ),
        "A DFlash drafter has no selector. Unary: the head's argmax over the drafter's output (for a DFlash2 drafter, "
        "its backbone alone); selector: DFlash2's served proposal. The blocks are the same for every run.",
    ),
    Series(
        "DFlash2 on the tiny default, ablations (same data, steps and evaluation as above)",
        "python -m benchmarks.dflash2_tiny --runs dflash2:16 --set loss.selector_weight=0",
        "dflash2_tiny.ablation_rows",
        (
            ("class", "class", "{}"),
            ("setting", "settings", "{}"),
            ("seed", "seed", "{}"),
            ("steps", "steps", "{}"),
            ("chain τ, unary top-1", "unary_tau", TAU),
            ("chain τ, selector's walk", "selector_tau", TAU),
            ("coverage (last 50 steps)", "coverage", "{:.3f}"),
        ),
    ),
    Figures(
        "DFlash2 against DFlash on the tiny default, in one number (mean over seeds)",
        "python -m benchmarks.dflash2_tiny",
        (
            Fig("DFlash, block 16: chain τ", "dflash2_tiny.dflash.b16.unary_tau", TAU),
            Fig("DFlash2, block 16: chain τ of the selector's walk", "dflash2_tiny.dflash2.b16.selector_tau", TAU),
            Fig("DFlash2, block 16: chain τ of its unary top-1", "dflash2_tiny.dflash2.b16.unary_tau", TAU),
            Fig(
                "DFlash2's selector / DFlash",
                "dflash2_tiny.b16.selector_vs_dflash",
                "{:.3f}",
                "> 1 to become the default",
            ),
        ),
    ),
)

TODAY = (
    REAL,
    REAL_DFLASH2,
    *REAL_DATA,
    TIERS_REAL,
    ROUND,
    PROJECTION,
    EXTRACTION,
    TRAINING,
    *S3,
    SMALL_DECODE,
    REGENERATION,
    DEMO,
    *DFLASH2_TINY,
    FORMAT_AND_HOST,
    GPU_TIER,
)

README = Figures(
    "Results",
    "",
    (
        Fig("SmolLM2-135M: drafter training steps (τ below)", "real.training.steps", "{:,}", measured_by=suite("real")),
        Fig("SmolLM2-135M: offline chain τ, HumanEval", "real.eval.humaneval.tau", TAU, measured_by=suite("real")),
        Fig(
            "SmolLM2-135M: offline chain τ, held-out chat", "real.eval.chat_heldout.tau", TAU, measured_by=suite("real")
        ),
        Fig(
            "SmolLM2-135M: DFlash2 / DFlash offline chain τ, equal steps, HumanEval",
            "real.dflash2.eval.humaneval.tau_over_dflash",
            X,
            measured_by=suite("real"),
        ),
        Fig(
            "SmolLM2-135M: DFlash2 / DFlash offline chain τ, equal steps, held-out chat",
            "real.dflash2.eval.chat_heldout.tau_over_dflash",
            X,
            measured_by=suite("real"),
        ),
        Fig("SmolLM2-135M: online τ, HumanEval", "real.online.tau", TAU, measured_by=suite("real")),
        Fig("SmolLM2-135M: lossless", "real.online.lossless", "{}", measured_by=suite("real")),
        Fig(
            "SmolLM2-135M: speed-up against target-only greedy (wall)",
            "real.online.speedup_wall",
            X,
            measured_by=suite("real"),
        ),
        Fig(
            "SmolLM2-135M: stored top-k at small data, chain τ change (HumanEval)",
            "real_data.kl_minus_hard.humaneval",
            "{:+.3f}",
            measured_by=suite("real-data"),
        ),
        Fig(
            "Qwen3.6-27B shape: 16-token verify / one-token step (graphed, bf16)",
            "shape27b.round.graphed.verify_over_step",
            X,
            "<= 1.15x",
            suite("shape27b"),
        ),
        Fig(
            "Qwen3.6-27B shape: projected speed-up at τ 6.5 (graphed)",
            "shape27b.round.graphed.speedup_at_anchor_tau",
            X,
            ">= 5x (paper, Qwen3-8B: 5.14x)",
            suite("shape27b"),
        ),
        Fig(
            "Qwen3.6-27B shape: extraction, packed, five taps",
            "shape27b.extract_packed5.full_tok_s",
            "{:,.0f} tok/s",
            measured_by=suite("shape27b"),
        ),
        Fig(
            "Qwen3.6-27B shape: drafter training MFU (published layout)",
            "shape27b.train_zlab.mfu",
            PCT,
            measured_by=suite("shape27b"),
        ),
        Fig(
            "extraction into S3 (moto on loopback) / to local disk",
            "s3.extract.s3_over_local",
            "{:.3f}",
            ">= 0.97",
            suite("s3"),
        ),
        Fig("tiny default (`make demo`), 2-core VM: chain τ", "demo.vm.tau", "{:.2f}", measured_by="make demo"),
        Fig(
            "`make drafter scale=smoke` on the tiny target, 2-core CPU: wall time",
            "drafter.smoke.tiny.wall_s",
            "{:.0f} s",
            "<= 180 s",
            "make drafter target=artifacts/tiny/target prompts=artifacts/tiny/corpus/train.jsonl scale=smoke",
        ),
        Fig(
            "SmolLM2-135M end to end on one GPU: time to its decoding step",
            "real.to_decoding_s",
            "{:.0f} s",
            measured_by=suite("real"),
        ),
    ),
)
