"""Benchmarks: commands that measure and print numbers (`make bench-*`, docs/benchmarks.md), never tests.

They live outside the runtime packages (`common`, `shards`, `extract`, `train`), so what a user
installs and imports carries no benchmark code, and a benchmark may reach into every stage at once
(the stages themselves meet only through `shards/` and `common/`). Not installed with the package:
run them from a checkout, `python -m benchmarks.NAME --help`.

    extract        the full extraction on one or more GPUs (random weights of the 27B shape)
    extract_host   the host path of extraction after the device-to-host copy (CPU)
    regenerate     regeneration through a server, or in-process batched decoding
    shards         shard writing and reading, compression levels
    shard_tiers    storage tiers: bytes, encode/decode speed and error
    train          the training step on a GPU (fixed batch, the data stream, data parallel)
    train_data     the data stream's throughput with the step stubbed
    s3_ceiling     an S3 server's own PUT and ranged-GET rates (moto_server on loopback)
    small_decode   a small target's decoding at batch 1: steps, verifies, proposals, graphed or eager
    spec_round     the speculative round at the Qwen3.6-27B shape and the speed-up its costs project
    synthetic      realistic synthetic samples the shard benchmarks write
    suites         `make bench-gpu suite=NAME`: the GPU suites, one bare H200 command each, one record each
    carry          the pinned SmolLM2 wheel in parts over consecutive device commands, joined there checked
    render         docs/benchmarks.md's "Today" and the README's results table from the records in results/
                   (what they show: catalogue)
"""
