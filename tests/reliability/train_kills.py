"""Scenario 2: training killed with SIGKILL, then resumed.

Kills land in chosen windows (a fault hook: model / optimizer / state file half-written, the
checkpoint directory complete but not renamed, renamed but older ones not pruned, an old one
half-deleted by the pruning, a metrics line half-written) or at a random moment picked by the
parent (after a random number of logged steps plus a few milliseconds). After each kill every
checkpoint the run lists must load (`load_checkpoint`: safetensors + `torch.load(weights_only=True)`),
and the latest one must be the last save that finished. The resumed run must log every step once,
with exactly the losses of an uninterrupted run, and end with the same weights.
Figure: kills survived / N, steps whose loss differs.
"""

from __future__ import annotations

import collections
import random
import shutil
import time
from pathlib import Path

from tests.reliability import faults
from tests.reliability.outcome import Outcome
from tests.reliability.runner import run_stage, watch_after_count
from tests.reliability.world import World

# "random" three times: of 22 kills, about 6 land at moments the parent picks.
WINDOWS = (
    "ckpt_model",
    "ckpt_optimizer",
    "ckpt_state",
    "ckpt_written",
    "ckpt_renamed",
    "ckpt_prune",
    "metrics_line",
    "random",
    "random",
    "random",
)


def train_extra(steps: int, every: int) -> list[str]:
    return [f"optim.max_steps={steps}", f"checkpoint.every={every}", "checkpoint.keep_last=2"]


def logged_steps(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_text().count("\n")
    except OSError:
        return 0


def random_watch(run_dir: Path, rng: random.Random, steps: int):
    threshold, delay = rng.randint(1, steps - 1), rng.uniform(0.0, 0.03)
    return watch_after_count(lambda: logged_steps(run_dir), threshold, delay)


def check_checkpoints(run_dir: Path) -> list[str]:
    """Every listed checkpoint loads, and the previous save is there: a save starts only after the
    one before it finished, so of the last two steps logged with `ckpt: true`, the first one's
    checkpoint must exist (the kill may have hit the second one's save)."""
    from train.checkpoint import list_checkpoints, load_checkpoint
    from train.metrics import read_metrics

    problems = []
    found = list_checkpoints(run_dir / "checkpoints")
    for step, path in found:
        try:
            ckpt = load_checkpoint(path)
            if int(ckpt["state"]["step"]) != step:
                problems.append(f"{path.name} holds step {ckpt['state']['step']}")
        except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
            problems.append(f"{path.name} does not load: {type(exc).__name__}: {exc}")
    started = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if r.get("ckpt")]
    if len(started) >= 2 and started[-2] not in {step for step, _ in found}:
        problems.append(
            f"the checkpoint of step {started[-2]} finished before the next save started, but it is gone "
            f"(checkpoints: {[s for s, _ in found]})"
        )
    return problems


def compare_runs(run_dir: Path, reference: Path, steps: int) -> tuple[list[str], int]:
    """(problems, steps whose loss differs) between a resumed run and the uninterrupted one."""
    import torch

    from train.checkpoint import latest_checkpoint, load_checkpoint
    from train.metrics import read_metrics

    got = read_metrics(run_dir / "metrics.jsonl")
    want = {r["step"]: r["loss"] for r in read_metrics(reference / "metrics.jsonl")}
    problems = []
    if [r["step"] for r in got] != list(range(1, steps + 1)):
        problems.append(f"metrics.jsonl steps are {[r['step'] for r in got][:40]}, expected 1..{steps} once each")
    differ = sum(1 for s in range(1, steps + 1) if s not in {r["step"] for r in got}) + sum(
        1 for r in got if want.get(r["step"]) != r["loss"]
    )
    if differ:
        problems.append(f"{differ} steps have a loss other than the uninterrupted run's")
    final, ref_final = latest_checkpoint(run_dir / "checkpoints"), latest_checkpoint(reference / "checkpoints")
    if final is None or final.name != ref_final.name:
        problems.append(f"final checkpoint {final} instead of {ref_final.name}")
    else:
        a, b = load_checkpoint(final)["model"], load_checkpoint(ref_final)["model"]
        if any(not torch.equal(a[k], b[k]) for k in b):
            problems.append("final weights differ from the uninterrupted run's")
    return problems, differ


def run(
    world: World,
    *,
    kills: int,
    seed: int,
    mode: str,
    work: Path,
    steps: int = 24,
    every: int = 3,
    windows: tuple[str, ...] = WINDOWS,
) -> Outcome:
    outcome = Outcome(2, "Training kills")
    start = time.perf_counter()
    rng = random.Random(seed)
    world.baseline  # noqa: B018 (built now, before the kills)
    runs = work / "runs"
    extra = train_extra(steps, every)
    plain = run_stage(world, "train", train_args=world.train_args(runs, "reference", *extra), mode=mode)
    if plain.status != 0:
        outcome.fail(f"uninterrupted run failed ({plain.status}): {plain.stderr[-1500:]}")
        return outcome.finish("could not run")
    reference = runs / "reference"
    reach = plain.counts
    saves = steps // every + (steps % every != 0)

    order = list(windows)
    rng.shuffle(order)
    hits: collections.Counter = collections.Counter()
    missed: collections.Counter = collections.Counter()
    survived = differing = done = 0
    run_index = 0
    while done < kills and run_index < 3 * kills:
        name = f"run-{run_index:03d}"
        run_index += 1
        run_dir = runs / name
        args = world.train_args(runs, name, *extra)
        ok, run_kills = True, 0
        for _ in range(2 if rng.random() < 0.3 and kills - done >= 2 else 1):
            window = order[done % len(order)]
            fault, watch = None, None
            if window == "random":
                watch = random_watch(run_dir, rng, steps)
            else:
                left = max(1, round(reach.get(window, 1) * (1 - logged_steps(run_dir) / steps)))
                fault = faults.Fault("kill", window, rng.randint(1, left))
            result = run_stage(world, "train", train_args=args, fault=fault, mode=mode, watch=watch)
            if result.status == 0:
                missed[window] += 1
                break
            if not result.killed:
                outcome.fail(f"{name}: {window}: exit {result.status} instead of a kill: {result.stderr[-600:]}")
                ok = False
                break
            done += 1
            run_kills += 1
            hits[window] += 1
            problems = check_checkpoints(run_dir)
            if problems:
                ok = False
                outcome.failures += [f"{name} ({window}, {fault.spec if fault else 'parent'}): {p}" for p in problems]
        resumed = run_stage(world, "train", train_args=args, mode=mode)
        if resumed.status != 0:
            outcome.fail(f"{name}: resume failed with status {resumed.status}: {resumed.stderr[-1500:]}")
            continue
        problems, run_differ = compare_runs(run_dir, reference, steps)
        differing += run_differ
        if problems:
            outcome.failures += [f"{name}: {p}" for p in problems]
        elif ok:
            survived += run_kills
            shutil.rmtree(run_dir, ignore_errors=True)
    if done < kills:
        outcome.fail(f"only {done} of {kills} kills happened")
    outcome.details.append("kills per window: " + ", ".join(f"{w} {n}" for w, n in sorted(hits.items())))
    if missed:
        outcome.details.append(
            "runs that finished before their window came up (retried): "
            + ", ".join(f"{w} {n}" for w, n in sorted(missed.items()))
        )
    outcome.details.append(
        f"reference: {steps} steps, a checkpoint every {every} ({saves} saves, keep_last 2); {run_index} runs, "
        f"mode {mode}"
    )
    outcome.seconds = time.perf_counter() - start
    return outcome.finish(f"{survived}/{kills} kills survived; {differing} steps with a different loss")
