"""Scenario 7: extraction killed and resumed with torch's default thread count (what users run on
a CPU), checking what resume promises there (docs/guide.md, shards/FORMAT.md "What resume guarantees"):

- promised, judged: the finished dataset holds exactly the samples of an uninterrupted run with
  the same settings, each once (sample ids, which hash the tokens and the loss mask; the tokens
  and masks compared too), the same counts and the same rejects; it verifies; after every kill
  the committed samples are a subset of those and never fewer than before;
- not promised, observed: how many samples' stored values (hidden states, top-k, log-probs) are
  not bit-identical to the uninterrupted run's, and by how much. Bit-identical values are
  promised only with deterministic kernels (one CPU thread: scenario 1).

Figure: kills survived / N with the promise kept; samples lost or duplicated; samples whose
stored values differ bitwise (observed).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests.reliability.datasets import RANK_MANIFEST
from tests.reliability.extract_kills import random_watch
from tests.reliability.outcome import Outcome
from tests.reliability.runner import run_stage
from tests.reliability.world import World, child_env


def samples(root: Path, manifest: str = "manifest.json") -> dict:
    from shards import ShardDataset

    return {s.sample_id: s for s in ShardDataset(str(root), manifest_name=manifest)}


def token_problems(got: list, reference: dict) -> list[str]:
    """Where the samples' identity (ids, tokens, loss masks) departs from the reference's."""
    ids = [s.sample_id for s in got]
    problems = []
    if len(ids) != len(set(ids)):
        problems.append(f"{len(ids) - len(set(ids))} samples stored twice")
    extra = [i for i in ids if i not in reference]
    if extra:
        problems.append(f"{len(extra)} samples the uninterrupted run does not have")
    for s in got:
        ref = reference.get(s.sample_id)
        if ref is not None and (
            not np.array_equal(s.input_ids, ref.input_ids) or not np.array_equal(s.loss_mask, ref.loss_mask)
        ):
            problems.append(f"sample {s.sample_id}: tokens or loss mask differ")
    return problems


def value_differences(got: dict, reference: dict) -> tuple[int, int, float]:
    """(samples whose stored values differ bitwise, the largest hidden-state difference in bf16
    steps, the largest log-prob difference of the stored top-1)."""
    differing, steps, logprob = 0, 0, 0.0
    for sid, s in got.items():
        ref = reference[sid]
        same = all(
            np.array_equal(getattr(s, f).view(np.uint8), getattr(ref, f).view(np.uint8))
            for f in ("hidden", "topk_ids", "topk_logprobs")
        )
        if same:
            continue
        differing += 1
        a, b = s.hidden.view(np.int16).astype(np.int32), ref.hidden.view(np.int16).astype(np.int32)
        steps = max(steps, int(np.abs(a - b).max()))
        logprob = max(logprob, float(np.abs(s.topk_logprobs[:, 0] - ref.topk_logprobs[:, 0]).max()))
    return differing, steps, logprob


def child_threads() -> str:
    """torch's thread count in a child started the way the scenario starts them."""
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=child_env(threads=None),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return probe.stdout.strip() or f"unknown: {probe.stderr[-200:]}"


def run(world: World, *, kills: int, seed: int, work: Path) -> Outcome:
    from shards import verify_dataset

    outcome = Outcome(7, "Extraction kills, default threads")
    start = time.perf_counter()
    rng = random.Random(seed + 7)
    plain = run_stage(
        world, "extract", config=world.extract_config(work / "plain"), mode="process", default_threads=True
    )
    if plain.status != 0:
        outcome.fail(f"uninterrupted run failed ({plain.status}): {plain.stderr[-800:]}")
        return outcome.finish("could not run")
    reference = samples(work / "plain")
    base_counts = json.loads((work / "plain" / "manifest.json").read_text())["counts"]
    base_rejects = (work / "plain" / "rejects.jsonl").read_text()
    single = samples(world.baseline)
    vs_single = value_differences(reference, single) if reference.keys() == single.keys() else None
    if vs_single is None:
        outcome.fail("the default-threads run holds other samples than the one-thread run")
    survived = lost = duplicated = done = differing = steps = 0
    logprob = 0.0
    run_index = 0
    while done < kills and run_index < 3 * kills:
        out = work / f"run-{run_index:03d}"
        run_index += 1
        config = world.extract_config(out)
        killed = run_stage(
            world,
            "extract",
            config=config,
            mode="process",
            default_threads=True,
            watch=random_watch(out, rng, len(reference), plain.seconds),
        )
        if killed.status == 0:
            continue  # finished before the kill moment: try again
        if not killed.killed:
            outcome.fail(f"{out.name}: exit {killed.status} instead of a kill: {killed.stderr[-400:]}")
            continue
        done += 1
        problems = []
        if (out / RANK_MANIFEST).exists():
            problems += [f"verify after the kill: {p}" for p in verify_dataset(str(out), RANK_MANIFEST)][:3]
            if not problems:
                problems += token_problems(list(samples(out, RANK_MANIFEST).values()), reference)
        resumed = run_stage(world, "extract", config=config, mode="process", default_threads=True)
        if resumed.status != 0:
            outcome.fail(f"{out.name}: resume failed with status {resumed.status}: {resumed.stderr[-600:]}")
            continue
        problems += [f"verify: {p}" for p in verify_dataset(str(out))][:3]
        final = samples(out)
        problems += token_problems(list(final.values()), reference)
        missing = len(reference.keys() - final.keys())
        lost += missing
        duplicated += sum(e["samples"] for e in json.loads((out / "manifest.json").read_text())["shards"]) - len(final)
        if missing:
            problems.append(f"{missing} samples of the uninterrupted run are missing")
        if json.loads((out / "manifest.json").read_text())["counts"] != base_counts:
            problems.append("counts differ from the uninterrupted run's")
        if (out / "rejects.jsonl").read_text() != base_rejects:
            problems.append("rejects.jsonl differs from the uninterrupted run's")
        if not problems:
            survived += 1
            n, s, lp = value_differences({k: v for k, v in final.items() if k in reference}, reference)
            differing, steps, logprob = differing + n, max(steps, s), max(logprob, lp)
            shutil.rmtree(out, ignore_errors=True)
        outcome.failures += [f"{out.name}: {p}" for p in problems]
    if done < kills:
        outcome.fail(f"only {done} of {kills} kills happened")
    outcome.details.append(
        f"threads: torch's default in the children ({child_threads()} on this machine; OMP_NUM_THREADS unset); "
        f"{run_index} runs, "
        f"reference {len(reference)} samples (an uninterrupted run with the same threads)"
    )
    outcome.details.append(
        f"observed, not judged: {differing} of the {survived * len(reference)} resumed samples are not "
        "bit-identical to the "
        f"uninterrupted run (largest hidden-state difference {steps} bf16 steps, top-1 log-prob {logprob:.2g})"
        + (
            ""
            if vs_single is None
            else f"; the uninterrupted default-threads run against the one-thread run: {vs_single[0]} of "
            f"{len(reference)} samples differ ({vs_single[1]} bf16 steps, {vs_single[2]:.2g})"
        )
    )
    outcome.seconds = time.perf_counter() - start
    return outcome.finish(
        f"{survived}/{kills} kills kept the promise; {lost} samples lost, {duplicated} duplicated; "
        f"{differing} samples' values not bit-identical (observed)"
    )
