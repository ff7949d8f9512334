"""Scenario 5, concurrent writers: two writers of one output must never both write.

- extract: two real `python -m extract` processes started together into one out_dir, with
  different batch settings (the case that used to corrupt the dataset): one writes it, the other
  stops at once naming the first (or, if the first finished before it looked, finds it complete);
  the dataset verifies and holds the uninterrupted run's samples once each and its rejects once.
- train: two `python -m train` processes into one run directory: the same, judged on the run's
  metrics (every step once) and its last checkpoint.
- a crashed writer: a process holding a dataset's lock makes an extraction stop at once having
  written nothing; once that process is SIGKILLed, the extraction runs (the lock died with it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.reliability.families import Tally
from tests.reliability.world import REPO, World, child_env

LOCKED = "is being written by another process"


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args], cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    return [(p.wait(timeout=600), p.stderr.read()) for p in procs]


def judge_pair(results: list[tuple[int, str]]) -> tuple[list[str], bool]:
    """(problems with the exit codes and messages, whether the two overlapped)."""
    codes = sorted(code for code, _ in results)
    problems = (
        [] if codes in ([0, 0], [0, 2]) else [f"exit codes {codes}: " + " | ".join(err[-300:] for _, err in results)]
    )
    problems += [
        f"the refused writer did not say why: {err[-300:]}" for code, err in results if code == 2 and LOCKED not in err
    ]
    return problems, codes == [0, 2]


def extraction_pair(world: World, out: Path) -> tuple[list[str], bool]:
    from shards import ShardDataset, verify_dataset

    first = world.extract_config(out, tokens_per_batch=256)
    moved = first.with_name(first.name + ".a.toml")
    shutil.move(first, moved)
    second = world.extract_config(out, tokens_per_batch=512, sort_window=10)
    problems, overlapped = judge_pair(finish([start(["-m", "extract", str(c)]) for c in (moved, second)]))
    if not (out / "manifest.json").exists():
        return problems + ["no finished dataset"], overlapped
    problems += [f"verify: {p}" for p in verify_dataset(str(out))][:3]
    ids = [s.sample_id for s in ShardDataset(str(out), verify_samples=False)]
    reference = [s.sample_id for s in ShardDataset(str(world.baseline), verify_samples=False)]
    if sorted(ids) != sorted(reference):
        problems.append(f"{len(ids)} samples ({len(set(ids))} distinct), the uninterrupted run has {len(reference)}")
    rejects = (out / "rejects.jsonl").read_text().splitlines()
    if sorted(json.loads(r)["position"] for r in rejects) != sorted(
        json.loads(r)["position"] for r in (world.baseline / "rejects.jsonl").read_text().splitlines()
    ):
        problems.append(
            f"rejects.jsonl lists {len(rejects)} lines, the uninterrupted run "
            f"{len((world.baseline / 'rejects.jsonl').read_text().splitlines())}"
        )
    leftovers = sorted(p.name for p in out.iterdir() if p.name.endswith((".tmp", ".lock")))
    if leftovers:
        problems.append(f"left behind: {leftovers[:5]}")
    return problems, overlapped


def training_pair(world: World, runs: Path, name: str, steps: int = 12) -> tuple[list[str], bool]:
    from train.checkpoint import latest_checkpoint, load_checkpoint

    args = ["-m", "train", *world.train_args(runs, name, f"optim.max_steps={steps}", "checkpoint.every=3")]
    problems, overlapped = judge_pair(finish([start(args), start(args)]))
    metrics = runs / name / "metrics.jsonl"
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []
    if logged != list(range(1, steps + 1)):
        problems.append(f"metrics.jsonl logs steps {logged[:30]}, expected 1..{steps} once each")
    try:
        load_checkpoint(latest_checkpoint(runs / name / "checkpoints"), map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
        problems.append(f"the last checkpoint does not load: {type(exc).__name__}: {exc}")
    return problems, overlapped


def crashed_writer(world: World, out: Path) -> list[str]:
    from shards import verify_dataset

    out.mkdir(parents=True)
    lock = out / ".manifest.rank000.json.lock"
    code = (
        f"import sys, time; sys.path.insert(0, {str(REPO)!r}); from common.locks import exclusive_lock; "
        f"exclusive_lock({str(lock)!r}, what='x', hint='y'); print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=child_env())
    problems, refused_after = [], 0.0
    config = world.extract_config(out)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.perf_counter()
        [(status, err)] = finish([start(["-m", "extract", str(config)])])
        if status != 2 or LOCKED not in err or f"pid {holder.pid}" not in err:
            problems.append(f"with a live writer: exit {status}: {err[-300:]}")
        if sorted(os.listdir(out)) != [lock.name]:
            problems.append(f"the refused writer wrote or deleted files: {sorted(os.listdir(out))}")
        refused_after = time.perf_counter() - started
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    [(status, err)] = finish([start(["-m", "extract", str(config)])])
    if status != 0 or verify_dataset(str(out)):
        problems.append(f"after the holder was killed: exit {status}: {err[-300:]}")
    if refused_after > 120:
        problems.append(f"the refusal took {refused_after:.0f} s")
    return problems


def concurrent_writers(world: World, tally: Tally, work: Path, *, extraction_pairs: int, training_pairs: int) -> str:
    """Run the cases; returns a details line (how many pairs really overlapped)."""
    overlaps = {"extract": 0, "train": 0}
    for i in range(extraction_pairs):
        problems, overlapped = extraction_pair(world, work / f"writers-extract-{i}")
        overlaps["extract"] += overlapped
        tally.add("writers:two_extractions", not problems, "; ".join(problems))
    for i in range(training_pairs):
        problems, overlapped = training_pair(world, work / "writers-runs", f"pair-{i}")
        overlaps["train"] += overlapped
        tally.add("writers:two_trainings", not problems, "; ".join(problems))
    problems = crashed_writer(world, work / "writers-crashed")
    tally.add("writers:crashed_holder", not problems, "; ".join(problems))
    return (
        f"concurrent writers: of {extraction_pairs} extraction pairs {overlaps['extract']} overlapped (one refused), "
        f"of {training_pairs} training pairs {overlaps['train']}; the others ran one after the other (the second "
        "found the work done)"
    )
