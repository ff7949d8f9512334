"""Extraction into a real S3 server (moto_server on loopback), SIGKILLed at random moments, then resumed.

Each run extracts the reliability world's corpus to `s3://bucket/run-N` in a real child process
(`python -m tests.reliability.child extract`, the CLI path) and the parent kills it with SIGKILL
after a random number of committed samples plus 0-30 ms, or at a random time after the start.
After each kill: the rank manifest verifies and lists only samples of the uninterrupted (local)
run, bit for bit, never fewer than before. The resume must give the uninterrupted run's samples
(each exactly once), counts and rejects; then no object under the prefix is unlisted (every shard
and index object belongs to the manifest), no multipart upload is left open and the lock objects
are gone. Figure: kills survived / N, samples lost, samples duplicated.

    python -m tests.reliability.s3_kills --kills 20 [--seed 0]     (the benchmark run;
    docs/benchmarks-log-2026-11-30-to-2026-12-04.md, "Object storage")
"""

from __future__ import annotations

import json
import random
import time
import uuid

from tests.reliability.datasets import RANK_MANIFEST, compare, sample_bytes
from tests.reliability.extract_kills import check_after_kill
from tests.reliability.outcome import Outcome
from tests.reliability.runner import run_stage, watch_after_count
from tests.reliability.world import World


def _read_json(uri: str):
    from common import io

    fs, path = io.resolve(uri)
    return io.read_json(fs, path)


def committed_samples(uri: str) -> int:
    from common.io import join_uri

    try:
        return _read_json(join_uri(uri, RANK_MANIFEST))["counts"]["samples"]
    except (OSError, ValueError, KeyError):
        return 0


def leftovers(uri: str, server) -> list[str]:
    """Objects under the prefix that no manifest lists, open multipart uploads, lock objects."""
    from common import io

    fs, path = io.resolve(uri)
    bucket, prefix = path.split("/", 1)
    manifest = _read_json(io.join_uri(uri, "manifest.json"))
    listed = {e["file"] for e in manifest["shards"]} | {e["index_file"] for e in manifest["shards"]}
    problems = [f"unlisted object {n}" for n in io.list_names(uri) if n.endswith(".arrow") and n not in listed]
    problems += [f"lock object left: {n}" for n in io.list_names(uri) if n.endswith(".lock")]
    uploads = server.client().list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])
    problems += [f"multipart upload left open: {u['Key']}" for u in uploads]
    return problems


def check_final(uri: str, world: World, reference: dict, server) -> tuple[list[str], int, int]:
    from common.io import join_uri
    from shards import verify_dataset

    problems = [f"verify: {p}" for p in verify_dataset(uri)][:5]
    got = sample_bytes(uri)
    cmp = compare(got, reference)
    if not cmp.equal:
        problems.append(f"final dataset differs from the uninterrupted run: {cmp}")
    base = json.loads((world.baseline / "manifest.json").read_text())
    manifest = _read_json(join_uri(uri, "manifest.json"))
    if manifest["counts"] != base["counts"]:
        problems.append(f"counts differ: {manifest['counts']} vs {base['counts']}")
    if not manifest.get("complete"):
        problems.append("final manifest is not complete")
    from common import io

    fs, path = io.resolve(join_uri(uri, "rejects.jsonl"))
    if io.read_bytes(fs, path) != (world.baseline / "rejects.jsonl").read_bytes():
        problems.append("rejects.jsonl differs from the uninterrupted run")
    problems += leftovers(uri, server)
    return problems, cmp.lost, cmp.duplicated


def run(world: World, server, *, kills: int, seed: int, bucket: str, check_plain: bool = True) -> Outcome:
    """`kills` SIGKILLs of extractions into `bucket` on `server` (a benchmarks.s3_server.MotoServer)."""
    outcome = Outcome("s3", "Extraction kills against an S3 server")
    start = time.perf_counter()
    rng = random.Random(seed)
    reference = dict(sample_bytes(world.baseline))
    total = len(reference)
    base = server.uri(f"{bucket}/{uuid.uuid4().hex[:8]}")
    run_seconds = 12.0  # a child's run here (start-up included), where no uninterrupted child run measures it
    if check_plain:
        plain_uri = _under(base, "plain")
        plain = run_stage(world, "extract", config=_config(world, "s3-plain", plain_uri), mode="process")
        if plain.status != 0:
            outcome.fail(f"uninterrupted run failed ({plain.status}): {plain.stderr[-800:]}")
            return outcome.finish("could not run")
        problems, _, _ = check_final(plain_uri, world, reference, server)
        outcome.failures += [f"uninterrupted run: {p}" for p in problems]
        run_seconds = plain.seconds
    survived = lost = duplicated = done = 0
    run_index = 0
    while done < kills and run_index < 3 * kills:
        uri = _under(base, f"run-{run_index:03d}")
        config = _config(world, f"s3-run-{run_index:03d}", uri)
        run_index += 1
        ok, committed, run_kills = True, 0, 0
        for _ in range(2 if rng.random() < 0.3 and kills - done >= 2 else 1):
            if rng.random() < 0.6:
                # A first kill after every sample was committed leaves no later count to wait for: then
                # the second kill comes at once (a kill during the finish).
                top = max(1, total - 1)
                threshold = rng.randint(min(max(1, committed), top), top)
                watch = watch_after_count(lambda u=uri: committed_samples(u), threshold, rng.uniform(0.0, 0.03))
            else:
                moment = rng.uniform(0.5, run_seconds)
                watch = lambda elapsed, m=moment: elapsed >= m  # noqa: E731
            result = run_stage(world, "extract", config=config, mode="process", watch=watch)
            if result.status == 0:
                break  # finished before the moment came: not a kill
            if not result.killed:
                outcome.fail(f"{uri}: exit {result.status} instead of a kill: {result.stderr[-400:]}")
                ok = False
                break
            done += 1
            run_kills += 1
            problems, committed = check_after_kill(uri, reference, committed)
            if problems:
                ok = False
                outcome.failures += [f"{uri} (kill {done}): {p}" for p in problems]
        resumed = run_stage(world, "extract", config=config, mode="process")
        if resumed.status != 0:
            outcome.fail(f"{uri}: resume failed with status {resumed.status}: {resumed.stderr[-800:]}")
            continue
        problems, run_lost, run_dup = check_final(uri, world, reference, server)
        lost, duplicated = lost + run_lost, duplicated + run_dup
        if problems:
            outcome.failures += [f"{uri}: {p}" for p in problems]
        elif ok:
            survived += run_kills
    if done < kills:
        outcome.fail(f"only {done} of {kills} kills happened")
    outcome.details.append(f"reference: {total} samples; {run_index} runs; a run takes about {run_seconds:.1f} s")
    outcome.seconds = time.perf_counter() - start
    return outcome.finish(f"{survived}/{kills} kills survived; {lost} samples lost, {duplicated} duplicated")


def _config(world: World, name: str, uri: str):
    """The world's extraction config with `out_dir` on the S3 server."""
    import tomli_w

    from tests.reliability.world import EXTRACT_SETTINGS

    table = {"target": str(world.target_dir), "corpus": str(world.corpus), "out_dir": uri, **EXTRACT_SETTINGS}
    path = world.root / f"{name}.toml"
    path.write_text(tomli_w.dumps({"extract": table}))
    return path


def _under(base: str, name: str) -> str:
    from common.io import join_uri

    return join_uri(base, name)


def main() -> int:
    import argparse
    import os
    import tempfile
    from pathlib import Path

    from benchmarks.s3_server import MotoServer
    from tests.reliability.world import build_world

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.update(MotoServer.env())
    with tempfile.TemporaryDirectory(prefix="s3-kills-") as tmp, MotoServer() as server:
        world = build_world(Path(tmp))
        world.baseline  # noqa: B018 (built now, before the kills)
        server.create_bucket("kills")
        outcome = run(world, server, kills=args.kills, seed=args.seed, bucket="kills")
    print(outcome.figure)
    for line in outcome.details + outcome.failures:
        print(" ", line)
    print(f"  {outcome.seconds:.0f} s")
    return 0 if outcome.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
