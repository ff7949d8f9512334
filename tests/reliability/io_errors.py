"""Scenario 4: a write that fails with ENOSPC (full disk) or EIO, injected in-process at one point of
the extraction or training write paths (see `faults.POINTS`).

Each case runs the real command line entry point (`extract.__main__.main`, `train.__main__.main`) in
this process with the fault armed, and passes when:
- the command stops with a non-zero status and a one-line message on stderr that starts with the
  stage's name and says what failed (the errno text), without a Python traceback;
- the last good state is intact: the extraction's committed samples pass `verify` and match the
  uninterrupted run bit for bit; every listed checkpoint loads and no temporary directory is left;
- rerunning the same command without the fault finishes with exactly the uninterrupted result.
Figure: scenarios passed.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from tests.reliability import faults
from tests.reliability.cli import call_main, message
from tests.reliability.datasets import RANK_MANIFEST, compare, sample_bytes
from tests.reliability.extract_kills import check_final
from tests.reliability.outcome import Outcome
from tests.reliability.train_kills import compare_runs, train_extra
from tests.reliability.world import World

# (action, point, which arrival): mid-run arrivals, so that something good exists to keep.
EXTRACT_CASES = (
    ("enospc", "shard_data", 40),
    ("eio", "shard_written", 5),
    ("enospc", "index_written", 4),
    ("enospc", "manifest_written", 6),
    ("eio", "rejects_fsync", 1),
    ("enospc", "merged_rejects_written", 1),
    ("enospc", "merged_manifest_written", 1),
)
TRAIN_CASES = (
    ("enospc", "ckpt_model", 2),
    ("enospc", "ckpt_optimizer", 2),
    ("enospc", "ckpt_state", 3),
    ("eio", "ckpt_fsync", 7),
    ("enospc", "metrics_line", 5),
)
STEPS, EVERY = 8, 2


def judge_message(stage: str, code, stderr: str, expected: str) -> list[str]:
    problems = []
    if code == 0:
        problems.append("the command reported success")
    if "Traceback (most recent call last)" in stderr:
        problems.append(f"a traceback reached the user: ...{stderr.strip()[-300:]}")
    line = message(stderr, f"{stage}:")
    if not line:
        problems.append(f"no '{stage}: ...' message on stderr; got: {stderr.strip()[-300:]!r}")
    elif expected not in line:
        problems.append(f"the message does not say what failed ({expected!r}): {line}")
    elif "'/" not in line:
        problems.append(f"the message names no file: {line}")
    return problems


def extraction_case(
    world: World, work: Path, action: str, point: str, nth: int, reference: dict
) -> tuple[list[str], str]:
    from extract.__main__ import main

    out = work / f"extract-{point}"
    config = world.extract_config(out)
    expected = "No space left on device" if action == "enospc" else "Input/output error"
    with faults.injected(faults.Fault(action, point, nth)):
        code, stderr = call_main(main, [str(config)])
        fired = list(faults.fired)
    if not fired:
        return [f"the fault never fired (exit {code})"], ""
    problems = judge_message("extract", code, stderr, expected)
    said = message(stderr, "extract:")
    if (out / RANK_MANIFEST).exists():
        from shards import verify_dataset

        bad = [str(p) for p in verify_dataset(str(out), RANK_MANIFEST)]
        if bad:
            problems.append(f"the committed part fails verify: {bad[:3]}")
        else:
            cmp = compare(sample_bytes(out, RANK_MANIFEST), reference, subset=True)
            if not cmp.equal:
                problems.append(f"the committed part differs from the uninterrupted run: {cmp}")
    code, stderr = call_main(main, [str(config)])
    if code != 0:
        problems.append(f"rerun failed ({code}): {stderr[-400:]}")
    else:
        problems += [f"after the rerun: {p}" for p in check_final(out, world.baseline, reference)[0]]
    if not problems:
        shutil.rmtree(out, ignore_errors=True)
    return problems, said


def training_case(world: World, work: Path, action: str, point: str, nth: int) -> tuple[list[str], str]:
    from train.__main__ import main
    from train.checkpoint import list_checkpoints, load_checkpoint

    runs = work / "runs"
    name = f"io-{point}"
    args = world.train_args(runs, name, *train_extra(STEPS, EVERY))
    expected = "No space left on device" if action == "enospc" else "Input/output error"
    with faults.injected(faults.Fault(action, point, nth)):
        code, stderr = call_main(main, args)
        fired = list(faults.fired)
    if not fired:
        return [f"the fault never fired (exit {code})"], ""
    problems = judge_message("train", code, stderr, expected)
    said = message(stderr, "train:")
    checkpoints = runs / name / "checkpoints"
    found = list_checkpoints(checkpoints)
    if not found:
        problems.append("no checkpoint survived (the failure came after a complete save)")
    for step, path in found:
        try:
            load_checkpoint(path)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{path.name} does not load: {exc}")
    leftovers = [p.name for p in checkpoints.iterdir() if ".tmp-" in p.name] if checkpoints.is_dir() else []
    if leftovers:
        problems.append(f"temporary checkpoint directories left: {leftovers}")
    code, stderr = call_main(main, args)
    if code != 0:
        problems.append(f"rerun failed ({code}): {stderr[-400:]}")
    else:
        problems += [f"after the rerun: {p}" for p in compare_runs(runs / name, runs / "io-reference", STEPS)[0]]
    return problems, said


def run(world: World, *, work: Path, extract_cases=EXTRACT_CASES, train_cases=TRAIN_CASES) -> Outcome:
    from train.__main__ import main as train_main

    outcome = Outcome(4, "Full disk and I/O errors")
    start = time.perf_counter()
    reference = dict(sample_bytes(world.baseline))
    passed = total = 0
    for action, point, nth in extract_cases:
        total += 1
        problems, said = extraction_case(world, work, action, point, nth, reference)
        passed += not problems
        outcome.failures += [f"extraction, {action} at {point} #{nth}: {p}" for p in problems]
        outcome.details.append(
            f"extraction, {action.upper()} at {point} (#{nth}): {'passed' if not problems else 'FAILED'}; {said[:240]}"
        )
    if train_cases:
        code, stderr = call_main(
            train_main, world.train_args(work / "runs", "io-reference", *train_extra(STEPS, EVERY))
        )
        if code != 0:
            outcome.fail(f"reference training run failed: {stderr[-600:]}")
            return outcome.finish(f"{passed}/{total + len(train_cases)} scenarios passed")
    for action, point, nth in train_cases:
        total += 1
        problems, said = training_case(world, work, action, point, nth)
        passed += not problems
        outcome.failures += [f"training, {action} at {point} #{nth}: {p}" for p in problems]
        outcome.details.append(
            f"training, {action.upper()} at {point} (#{nth}): {'passed' if not problems else 'FAILED'}; {said[:240]}"
        )
    outcome.seconds = time.perf_counter() - start
    return outcome.finish(f"{passed}/{total} scenarios passed")
