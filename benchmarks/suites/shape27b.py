"""`make bench-gpu suite=shape27b`: the Qwen3.6-27B shape on random weights, one H100 or H200, bf16.

Parts, most important first (the plan cuts from the end when time is short; `only=PART,...` runs the rest in a
second command):

    round              the speculative round (`benchmarks.spec_round`): the target's one-token step, the 16-token
                       verify, the drafter's proposal, graphed without state rollback (the same kernels replayed),
                       "graphed, with rollback" (per-token Gated DeltaNet states: how our decoding runs a hybrid
                       target) and eager with a cache copy (the fallback); the projected speed-up for τ = 2..10, the
                       break-even τ, and where the one-token step goes per layer kind beside its weight-streaming bound
    extract-packed5    extraction, packed rows, five taps (`benchmarks.extract --packing`): full against bare,
                       TFLOP/s, the untimed cold first pass
    train-stream       drafter training, the stream phase at the 27B widths (`benchmarks.train --phases stream`)
    train-zlab         drafter training, the published layout (`--shape 27b-zlab --phases fixed`)
    train-dflash2      DFlash2 drafter training on train-stream's batches (`--phases stream --arch dflash2
                       --block-size 16`): its MFU against DFlash's (goal: within 10%)
    extract-unpacked5  extraction, padded rows, five taps
    extract-packed4    extraction, packed rows, four taps
    extract-unpacked4  extraction, padded rows, four taps

At the smoke scale (a CPU) the same modules run at toy widths; packed rows are refused there (the CPU's Gated
DeltaNet would carry one sample's state into the next), so the packed parts are left out.

Its parts are planned to fit two commands on one H100 or H200 (with the costs of the 2026-12-05 H100 record and
the estimates): the second continues the first's record on the same host (`benchmarks.suites.continuation`) with
what it cut, on a machine whose compilation caches are warm. Each
part needs about 50-60 GiB of GPU memory (`memory_gib`, the peaks measured): a smaller GPU is refused.
"""

from __future__ import annotations

from benchmarks.suites.figures import extract_figures, read_json, round_figures, train_figures
from benchmarks.suites.plan import Part

FIVE_TAPS = "1,16,31,46,61"
FOUR_TAPS = "1,16,31,46"
EXTRACT_LOG = (
    "2026-12-04 packed five taps: cold pass 6,298, full 8,254, bare 9,039 tok/s; model build 17.7 s; "
    "2026-12-05 H100, bare machine: model build 71 s (the cold start: estimate 55 s)"
)
# Peak GPU memory, GiB, as measured (docs/benchmarks.md); the round's peak is not recorded: its bf16 weights alone
# are 50.1 GiB.
ROUND_GIB = (52.0, "estimate: the 27B target's bf16 weights 50.1 GiB, its caches and the drafter")
EXTRACT_GIB = (55.3, "peak measured 54.1-55.3 GiB, 2026-12-01/05")
TRAIN_GIB = {
    "stream": (58.8, "peak measured 57.5-58.8 GiB, 2026-12-01"),
    "fixed": (49.0, "peak measured 49.0 GiB, 2026-12-01"),
}
DFLASH2_GIB = (62.0, "estimate: train-stream's peak + ~3 GiB for the selector's and convolutions' 0.2 B parameters")


def _round(ctx, units: int):
    argv = ["-m", "benchmarks.spec_round", "--out", ctx.path("round.json")]
    if ctx.scale == "smoke":
        argv += ["--shape", "tiny", "--sizes", "1,16", "--tokens", "2", "--repeats", "1", "--rounds", "1"]
        argv += ["--profile-steps", "1"]
        argv += ["--prompt-len", "16"]
    return [[("speculative round", argv)]]


def _extract(name: str, taps: str, packing: bool):
    def stages(ctx, units: int):
        argv = ["-m", "benchmarks.extract", "--layer-ids", taps, "--workdir", ctx.path(name)]
        argv += ["--out", ctx.path(f"{name}.json")] + (["--packing"] if packing else [])
        if ctx.scale == "smoke":
            argv += ["--shape", "tiny", "--tokens", str(units * 500), "--max-len", "200", "--warmup-batches", "1"]
        else:
            argv += ["--tokens", str(units * 10_000)]
        return [[(name, argv)]]

    def collect(ctx, units: int):
        report = read_json(ctx.path(f"{name}.json"))
        return extract_figures(report, f"shape27b.{name.replace('-', '_')}"), report

    return stages, collect


def _train(name: str, shape: str, phase: str, extra: tuple[str, ...] = ()):
    def stages(ctx, units: int):
        argv = ["-m", "benchmarks.train", "--phases", phase, "--steps", str(units), "--workdir", ctx.path("train")]
        argv += ["--out", ctx.path(f"{name}.json"), *extra]
        if ctx.scale == "smoke":
            argv += ["--shape", f"tiny{shape.removeprefix('27b')}", "--warmup", "1", "--samples", "16"]
        else:
            argv += ["--shape", shape, "--warmup", "4" if phase == "stream" else "3", "--samples", "64"]
        return [[(name, argv)]]

    def collect(ctx, units: int):
        report = read_json(ctx.path(f"{name}.json"))
        prefix = f"shape27b.{name.replace('-', '_')}"
        figures = train_figures(report, phase, prefix)
        if extra and figures:  # DFlash2: its MFU against DFlash's on the same batches (train-stream), if that ran
            dflash = train_figures(read_json(ctx.path("train-stream.json")), phase, "dflash")
            if dflash.get("dflash.mfu"):
                figures[f"{prefix}.mfu_vs_dflash"] = figures[f"{prefix}.mfu"] / dflash["dflash.mfu"]
        return figures, report

    return stages, collect


def _collect_round(ctx, units: int):
    report = read_json(ctx.path("round.json"))
    return round_figures(report, "shape27b.round"), report


def parts(scale: str, options: dict) -> list[Part]:
    smoke = scale == "smoke"
    out = [
        Part(
            "round",
            "the speculative round's costs (graphed, graphed with rollback, eager) and the projected speed-up",
            20 if smoke else 260,
            0,
            "run",
            1,
            1,
            0,
            "2026-12-05 (H100, 62b06fc): the graphed and eager rows 168 s, graph capture 93 s of it; the rollback "
            "row (five more graphs with per-token states) and the step profile estimated at 90 s more, not measured "
            "yet; fla's Triton compilation on a bare machine ~40 s",
            _round,
            _collect_round,
            cold_s=0 if smoke else 40,
            memory_gib=ROUND_GIB[0],
            memory_source=ROUND_GIB[1],
        )
    ]
    extraction = [("extract-packed5", FIVE_TAPS, True, 1), ("extract-unpacked5", FIVE_TAPS, False, 4)]
    extraction += [("extract-packed4", FOUR_TAPS, True, 5), ("extract-unpacked4", FOUR_TAPS, False, 6)]
    for name, taps, packing, priority in extraction:
        if smoke and packing:
            continue
        stages, collect = _extract(name, taps if not smoke else "1,2,3,5,6", packing)
        per_unit = 4.2 if packing else 4.6  # seconds per 10 K tokens over the cold pass, (b) and (a)
        out.append(
            Part(
                name,
                f"extraction, {'packed' if packing else 'padded'} rows, {len(taps.split(','))} taps: full against bare",
                20 if smoke else 45,
                2 if smoke else per_unit,
                "x 500 tokens" if smoke else "x 10 K tokens",
                6 if smoke else 30,
                2 if smoke else 10,
                priority,
                EXTRACT_LOG,
                stages,
                collect,
                cold_s=0 if smoke else 55,
                family="extract",  # one model, one kernel set: the first extraction on a machine warms the rest
                memory_gib=EXTRACT_GIB[0],
                memory_source=EXTRACT_GIB[1],
            )
        )
    # Compilation is most of the fixed cost (183 s and 147 s on a warm H200): inductor's caches keep it for the
    # next run on the machine (estimate: about 60% of it is the cold start).
    for name, shape, phase, priority, fixed, cold, step, extra in (
        ("train-stream", "27b", "stream", 2, 80, 120, 0.55, ()),
        ("train-zlab", "27b-zlab", "fixed", 3, 60, 80, 0.48, ()),
        # Block 16, as train-stream: the same batches and blocks, so the MFUs differ by the class alone.
        ("train-dflash2", "27b", "stream", 4, 80, 120, 0.6, ("--arch", "dflash2", "--block-size", "16")),
    ):
        stages, collect = _train(name, shape, phase, extra)
        out.append(
            Part(
                name,
                f"{'DFlash2 ' if extra else ''}drafter training at the 27B widths, {phase} phase, {shape}",
                12 if smoke else fixed,
                0.5 if smoke else step,
                "steps",
                3 if smoke else 20,
                2 if smoke else 8 if phase == "stream" else 6,
                priority,
                "not measured yet: train-stream's costs, a little more per step"
                if extra
                else "2026-11-30/12-01 logs: compilation 183 s (stream) and 147 s for the 27b-zlab command with 6 "
                "steps; steps 0.55 s (stream) and 0.48 s (27b-zlab)",
                stages,
                collect,
                cold_s=0 if smoke else cold,
                memory_gib=(DFLASH2_GIB if extra else TRAIN_GIB[phase])[0],
                memory_source=(DFLASH2_GIB if extra else TRAIN_GIB[phase])[1],
                needs=("train-stream",) if extra else (),  # its MFU is compared with DFlash's on the same batches
            )
        )
    return sorted(out, key=lambda p: p.priority)  # run in the order of importance: a long part cuts the rest
