"""Scenario 1: extraction killed with SIGKILL, then resumed.

Every kill lands in a chosen window (a fault hook kills the process the n-th time it reaches a
commit step: half-written shard bytes, index or shard written but not renamed, shard renamed but
not in the manifest, manifest written but not renamed, rejects fsync, the merge) or at a random
moment picked by the parent (after a random number of committed samples plus a few milliseconds,
or a random time after start). After each kill: the rank manifest passes `verify` and lists only
samples of the uninterrupted run, bit for bit, never fewer than before. Some runs are killed twice.
The final resume must give the uninterrupted run's sample set, per-sample bytes, counts and
rejects. Figure: kills survived / N, samples lost, samples duplicated.
"""

from __future__ import annotations

import collections
import json
import random
import shutil
import time
from pathlib import Path

from tests.reliability import faults
from tests.reliability.datasets import RANK_MANIFEST, compare, killed_extraction_state, sample_bytes
from tests.reliability.outcome import Outcome
from tests.reliability.runner import run_stage, watch_after_count
from tests.reliability.world import World

# "random" four times: of 30 kills, 8 land at moments the parent picks, 2 in each hooked window.
WINDOWS = (
    "shard_data",
    "index_written",
    "index_renamed",
    "shard_written",
    "shard_renamed",
    "manifest_written",
    "manifest_renamed",
    "rejects_fsync",
    "merged_rejects_written",
    "merged_manifest_written",
    "merged_manifest_renamed",
    "random",
    "random",
    "random",
    "random",
)


def committed_samples(out: Path) -> int:
    try:
        return json.loads((out / RANK_MANIFEST).read_text())["counts"]["samples"]
    except (OSError, ValueError, KeyError):
        return 0


def random_watch(out: Path, rng: random.Random, total: int, run_seconds: float):
    """A parent-side kill moment: after k committed samples plus 0-30 ms, or a random time."""
    if rng.random() < 0.5:
        threshold, delay = rng.randint(1, max(1, total - 1)), rng.uniform(0.0, 0.03)
        return watch_after_count(lambda: committed_samples(out), threshold, delay)
    moment = rng.uniform(0.0, run_seconds)
    return lambda elapsed: elapsed >= moment


def check_after_kill(out: Path | str, reference: dict, before: int) -> tuple[list[str], int]:
    """Problems of the dataset a kill left (empty: sound), and how many samples it commits; `out` is
    a directory or an object-store URI."""
    from common.io import list_names
    from shards import verify_dataset

    if RANK_MANIFEST not in list_names(str(out)):
        return [], 0
    problems = [str(p) for p in verify_dataset(str(out), RANK_MANIFEST)]
    if problems:
        return [f"verify after the kill: {p}" for p in problems[:5]], 0
    got = sample_bytes(out, RANK_MANIFEST)
    cmp = compare(got, reference, subset=True)
    if not cmp.equal:
        problems.append(f"after the kill the committed samples differ from the reference: {cmp}")
    if len(got) < before:
        problems.append(f"a kill lost committed samples: {before} before, {len(got)} after")
    return problems, len(got)


def check_final(out: Path, baseline: Path, reference: dict) -> tuple[list[str], int, int]:
    """Problems of the finished dataset vs the uninterrupted run; (problems, lost, duplicated)."""
    from shards import verify_dataset

    problems = [f"verify: {p}" for p in verify_dataset(str(out))][:5]
    got = sample_bytes(out)
    cmp = compare(got, reference)
    if not cmp.equal:
        problems.append(f"final dataset differs from the uninterrupted run: {cmp}")
    base_manifest = json.loads((baseline / "manifest.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    if manifest["counts"] != base_manifest["counts"]:
        problems.append(f"counts differ: {manifest['counts']} vs {base_manifest['counts']}")
    if not manifest.get("complete"):
        problems.append("final manifest is not complete")
    for name in ("rejects.jsonl", "summary.json"):
        if not (out / name).exists():
            problems.append(f"{name} is missing after the resume")
    if (out / "rejects.jsonl").exists() and (out / "rejects.jsonl").read_text() != (
        baseline / "rejects.jsonl"
    ).read_text():
        problems.append("rejects.jsonl differs from the uninterrupted run")
    leftovers = sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp"))
    if leftovers:
        problems.append(f"temporary files left after the resume: {leftovers[:5]}")
    return problems, cmp.lost, cmp.duplicated


def run(world: World, *, kills: int, seed: int, mode: str, work: Path, windows: tuple[str, ...] = WINDOWS) -> Outcome:
    outcome = Outcome(1, "Extraction kills")
    start = time.perf_counter()
    rng = random.Random(seed)
    reference = dict(sample_bytes(world.baseline))
    total = len(reference)

    # An uninterrupted child run: counts how often each window comes up, and checks that a child
    # process stores exactly what the in-process reference stores.
    plain = run_stage(world, "extract", config=world.extract_config(work / "plain"), mode=mode)
    if plain.status != 0:
        outcome.fail(f"uninterrupted run failed ({plain.status}): {plain.stderr[-800:]}")
        return outcome.finish("could not run")
    problems, _, _ = check_final(work / "plain", world.baseline, reference)
    outcome.failures += [f"uninterrupted child run: {p}" for p in problems]
    reach = plain.counts

    windows = list(windows)
    rng.shuffle(windows)
    hits: collections.Counter = collections.Counter()
    missed: collections.Counter = collections.Counter()
    states: collections.Counter = collections.Counter()
    survived = lost = duplicated = done = 0
    run_index = 0
    while done < kills and run_index < 3 * kills:
        out = work / f"run-{run_index:03d}"
        run_index += 1
        config = world.extract_config(out)
        ok, committed, run_kills = True, 0, 0
        for _ in range(2 if rng.random() < 0.3 and kills - done >= 2 else 1):
            window = windows[done % len(windows)]
            fault, watch = None, None
            if window == "random":
                watch = random_watch(out, rng, total, plain.seconds)
            else:
                # A resumed run has less left to do: aim the n-th arrival inside what remains.
                left = max(1, round(reach.get(window, 1) * (1 - committed / total)))
                fault = faults.Fault("kill", window, rng.randint(1, left))
            result = run_stage(world, "extract", config=config, fault=fault, mode=mode, watch=watch)
            if result.status == 0:
                missed[window] += 1  # the run finished before the window came up: not a kill
                break
            if not result.killed:
                outcome.fail(f"{out.name}: {window}: exit {result.status} instead of a kill: {result.stderr[-400:]}")
                ok = False
                break
            done += 1
            run_kills += 1
            hits[window] += 1
            states[killed_extraction_state(out)] += 1
            problems, committed = check_after_kill(out, reference, committed)
            if problems:
                ok = False
                outcome.failures += [f"{out.name} ({window}): {p}" for p in problems]
        resumed = run_stage(world, "extract", config=config, mode=mode)
        if resumed.status != 0:
            outcome.fail(f"{out.name}: resume failed with status {resumed.status}: {resumed.stderr[-800:]}")
            continue
        problems, run_lost, run_dup = check_final(out, world.baseline, reference)
        lost, duplicated = lost + run_lost, duplicated + run_dup
        if problems:
            outcome.failures += [f"{out.name}: {p}" for p in problems]
        elif ok:
            survived += run_kills
            shutil.rmtree(out, ignore_errors=True)  # keep failed runs for inspection only
    if done < kills:
        outcome.fail(f"only {done} of {kills} kills happened")
    outcome.details.append("kills per window: " + ", ".join(f"{w} {n}" for w, n in sorted(hits.items())))
    if missed:
        outcome.details.append(
            "runs that finished before their window came up (retried): "
            + ", ".join(f"{w} {n}" for w, n in sorted(missed.items()))
        )
    outcome.details.append(
        "state found on disk after the kill: " + ", ".join(f"{s} {n}" for s, n in sorted(states.items()))
    )
    outcome.details.append(
        f"reference: {total} samples in "
        f"{len(json.loads((world.baseline / 'manifest.json').read_text())['shards'])} shards; "
        f"{run_index} runs, mode {mode}"
    )
    outcome.seconds = time.perf_counter() - start
    return outcome.finish(f"{survived}/{kills} kills survived; {lost} samples lost, {duplicated} duplicated")
