"""`make bench-gpu suite=s3`: datasets on an S3 server on one H100 or H200 host, against local disk (issue 27's goals).

The server is `moto_server` on loopback (one Python process; its wheels are carried: docs/benchmarks.md says
which), the latency injected by `benchmarks.s3_server.DelayProxy`. Parts, in the order they run:

    ceiling      the server alone (`benchmarks.s3_ceiling`): its PUT and ranged-GET rates on this host, so the
                 rows below can be read against them
    train-s3     training at the 27B widths from local disk, then from the server at 0, 20 and 80 ms per
                 request (`benchmarks.train --s3-delays-ms`): fetch fraction and step time against local disk
                 (goals: fetch fraction <= 2%, step within 2%), 64 synthetic samples in 32 MiB shards looped
    extract-s3   extraction to local disk and into the server in one run (`benchmarks.extract`, two variants,
                 plain request bodies): tok/s into S3 against local disk (goal: within 3%)

Priorities when time is short: train-s3, ceiling, extract-s3.
"""

from __future__ import annotations

from benchmarks.suites.figures import ceiling_figures, read_json, s3_extract_figures, s3_train_figures
from benchmarks.suites.plan import Part


def _ceiling(ctx, units: int):
    argv = ["-m", "benchmarks.s3_ceiling", "--out", ctx.path("ceiling.json")]
    if ctx.scale == "smoke":
        argv += ["--object-mb", "1", "--objects", "2", "--threads", "1", "--put-threads", "1", "--range-mb", "1"]
        argv += ["--io-threads", "", "--part-mb", "0", "--seconds", "0.2"]
    else:
        argv += ["--object-mb", "32", "--range-mb", "4,32", "--seconds", "1"]
    return [[("S3 server ceiling", argv)]]


def _train(ctx, units: int):
    argv = ["-m", "benchmarks.train", "--phases", "stream", "--steps", str(units), "--prefetch-threads", "8"]
    argv += ["--workdir", ctx.path("train"), "--out", ctx.path("train-s3.json")]
    if ctx.scale == "smoke":
        argv += ["--shape", "tiny", "--samples", "16", "--shard-mb", "1", "--s3-delays-ms", "0,20", "--warmup", "1"]
        argv += ["--s3-ceiling-s", "0.2"]
    else:
        argv += ["--samples", "64", "--shard-mb", "32", "--s3-delays-ms", "0,20,80", "--warmup", "6"]
    return [[("training from S3", argv)]]


def _extract(ctx, units: int):
    uri = "out_dir=s3://bench/ex?endpoint_override={endpoint}&scheme=http"
    argv = ["-m", "benchmarks.s3_server", "--bucket", "bench", "--plain-bodies", "--", "-m", "benchmarks.extract"]
    argv += ["--workdir", ctx.path("extract"), "--variant", f"out_dir={ctx.path('extract/local')}", "--variant", uri]
    argv += ["--out", ctx.path("extract-s3.json")]
    if ctx.scale == "smoke":
        argv += ["--shape", "tiny", "--tokens", str(units * 500), "--max-len", "200", "--warmup-batches", "1"]
    else:
        argv += ["--tokens", str(units * 10_000)]
    return [[("extraction into S3", argv)]]


def _collect(name: str, read):
    def collect(ctx, units: int):
        report = read_json(ctx.path(f"{name}.json"))
        return read(report, f"s3.{name.split('-')[0]}"), report

    return collect


def parts(scale: str, options: dict) -> list[Part]:
    smoke = scale == "smoke"
    return [
        Part(
            "ceiling",
            "the S3 server's own PUT and ranged-GET rates",
            6 if smoke else 45,
            0,
            "run",
            1,
            1,
            1,
            "about 40 s on the H200 host (2026-12-04 estimate: "
            "docs/benchmarks-log-2026-11-30-to-2026-12-04.md, Object storage)",
            _ceiling,
            _collect("ceiling", ceiling_figures),
        ),
        Part(
            "train-s3",
            "training from local disk and from S3 at 0/20/80 ms per request: fetch fraction, step vs local",
            20 if smoke else 110,
            1.5 if smoke else 2.2,
            "steps",
            3 if smoke else 24,
            2 if smoke else 8,
            0,
            "2026-12-04 log: 64 samples written in ~12 s, compilation ~183 s (2026-12-01), a step 0.555 s per row "
            "(four rows), the copy into moto ~20 s at 124 MB/s; estimate: 120 s of the compilation only on a bare "
            "machine",
            _train,
            _collect("train-s3", s3_train_figures),
            cold_s=0 if smoke else 120,
            memory_gib=58.8,
            memory_source="the stream phase at the 27B widths: peak measured 57.5-58.8 GiB, 2026-12-01",
        ),
        Part(
            "extract-s3",
            "extraction to local disk and into S3 in one run: tok/s against local disk",
            25 if smoke else 40,
            2 if smoke else 11.2,
            "x 500 tokens" if smoke else "x 10 K tokens",
            4 if smoke else 6,
            2 if smoke else 3,
            2,
            "2026-12-04 log: 60 K tokens, local 5,938 tok/s, into moto 1,639 tok/s (aws-chunked bodies), "
            "model build 18 s; 71 s on a bare H100 (2026-12-05)",
            _extract,
            _collect("extract-s3", s3_extract_figures),
            cold_s=0 if smoke else 55,
            memory_gib=55.3,
            memory_source="extraction at the 27B shape: peak measured 54.1-55.3 GiB, 2026-12-01/05",
        ),
    ]
