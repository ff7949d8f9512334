"""GPU benchmark suites: `make bench-gpu suite=NAME` (on the device host: `python3 -m benchmarks.suites NAME`),
each one command of at most 9 minutes on one H100 or H200 (two for `real` and `shape27b`: the second continues
the first on the same host), from a bare machine with carried wheels.

    real        SmolLM2-135M-Instruct end to end (build, regeneration, extraction, training, offline
                evaluation, export, online decoding on as many HumanEval prompts as fit, the peer baselines)
    real-data   τ against training data at equal steps, and hard cross-entropy against cross-entropy plus a
                KL term on the stored top-k at small data, with seeds (SmolLM2)
    tiers-real  the storage tiers trained side by side on SmolLM2 (`make tiers` on its config)
    shape27b    the Qwen3.6-27B shape on random weights: the speculative round and its projected speed-up,
                extraction, drafter training MFU
    s3          training from and extraction into a local moto_server with injected latency, against local disk

Each suite (`benchmarks/suites/NAME.py`) lists its parts, each with what it costs (`plan.Part`: a fixed time, a
time per unit and a cold start on a bare machine, from the log, scaled to the suite's last record on the same kind
of GPU); `plan.fit` chooses what fits the budget and prints what it cut; `runner` runs every part as child
processes under a deadline, plans the rest again from the time really left after each, and writes ONE record
(`record`) and ONE log under the output folder ($OUT on the device host) as it goes; a second command on the same
host continues an unfinished record (`continuation`). Records committed under benchmarks/results/ render the
"Today" section of docs/benchmarks.md and the README's results table (`python -m benchmarks.render`).

This file, `__main__` and `host` import only the standard library: on the device host they run before the carried
wheels are installed (`host` installs them and checks that the modules the project imports are importable).
"""

SUITES = {
    "real": "benchmarks.suites.real",
    "real-data": "benchmarks.suites.real_data",
    "tiers-real": "benchmarks.suites.tiers_real",
    "shape27b": "benchmarks.suites.shape27b",
    "s3": "benchmarks.suites.s3",
}
# What a suite's commands import beyond what the project's own imports show (`host.needed_modules`): transformers
# reads the SmolLM2 GGUF with `gguf`; the S3 suite starts moto's server.
DEVICE_MODULES = {
    "real": ("gguf",),
    "real-data": ("gguf",),
    "tiers-real": ("gguf",),
    "s3": ("moto.server",),
}
