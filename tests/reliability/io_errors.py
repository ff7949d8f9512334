"""Scenario 4: a write that fails with ENOSPC (full disk) or EIO, injected in-process at one point of
the extraction or training write paths (see `faults.POINTS`).

Each case runs the real command line entry point (`extract.__main__.main`, `train.__main__.main`) in
this process with the fault armed, and passes when:
- the command stops with a non-zero status and a one-line message on stderr that starts with the
  stage's name and says what failed (the errno text), without a Python traceback;
- the last good state is intact: the extraction's committed samples pass `verify` and match the
  uninterrupted run bit for bit; every listed checkpoint loads and no temporary directory is left;
- rerunning the same command without the fault finishes with exactly the uninterrupted result.
The same holds for `shards transcode` and `extract.regenerate` (injected ENOSPC / EIO in a shard
write, a journal line, data.jsonl's commit), and, where the test can make a small file system
(`small_disk`: a tmpfs in a user namespace), for all four stages on a real full disk (transcode twice:
also with one shard far larger than the writer's 1 MB buffer, so that the disk fills inside the shard
and the buffered close fails too): the first run exits 4 with one line naming the file and "No space
left on device", leaves no temporary file, and the same command after the disk has grown ends
identical to a clean run.
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
TRANSCODE_CASES = (
    ("enospc", "shard_data", 3),
    ("eio", "merged_manifest_written", 1),
)
REGENERATE_CASES = (
    ("enospc", "journal_line", 5),
    ("enospc", "regen_data_written", 1),
)
SMALL_DISK_STAGES = ("extract", "transcode", "transcode_wide", "regenerate", "train", "train_optimizer")
STEPS, EVERY = 8, 2
REGEN_SETTINGS = ["backend=local", "max_new_tokens=6", "batch_size=4", "window_records=8", "dtype=float32"]
REGEN_SETTINGS += ["device=cpu", "progress=false", "fsync_every_s=0"]


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
    for _step, path in found:
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


def transcode_args(world: World, dst: Path, wide: Path | None = None) -> list[str]:
    if wide is not None:  # one shard, far past the writer's 1 MB buffer: the disk fills inside it
        return ["transcode", str(wide), str(dst), "encoding=planes", "progress=false"]
    return ["transcode", str(world.baseline), str(dst), "encoding=fp8", "shard_bytes=20000", "progress=false"]


def wide_dataset(work: Path) -> Path:
    """60 synthetic samples of 40 tokens x 2048 features (7 MB): shards larger than a write buffer."""
    from shards import ShardWriter
    from tests.shards.synth import TOPK, make_sample, provenance

    root = work / "wide-source"
    if not (root / "manifest.json").exists():
        prov = provenance()
        prov["target"]["hidden_size"] = 1024
        with ShardWriter(str(root), provenance=prov, hidden_width=2048, topk=TOPK) as writer:
            for i in range(60):
                writer.write(make_sample(i, n_tokens=40, width=2048))
    return root


def regenerate_args(world: World, out: Path) -> list[str]:
    return [f"target={world.target_dir}", f"corpus={world.corpus}", f"out={out}", *REGEN_SETTINGS]


def reference_transcode(world: World, work: Path, wide: Path | None = None) -> Path:
    from shards.__main__ import main

    out = work / ("transcode-reference" if wide is None else "transcode-wide-reference")
    if not (out / "manifest.json").exists():
        code, stderr = call_main(main, transcode_args(world, out, wide))
        assert code == 0, stderr[-600:]
    return out


def reference_regeneration(world: World, work: Path) -> Path:
    from extract.regenerate.__main__ import main

    out = work / "regenerate-reference"
    if not (out / "regenerate.json").exists():
        code, stderr = call_main(main, regenerate_args(world, out))
        assert code == 0, stderr[-600:]
    return out


def same_transcode(out: Path, reference: Path) -> list[str]:
    from shards import verify_dataset

    problems = [f"verify: {p}" for p in verify_dataset(str(out))][:5]
    cmp = compare(sample_bytes(out, "manifest.json"), dict(sample_bytes(reference, "manifest.json")))
    if not cmp.equal:
        problems.append(f"the transcoded dataset differs from a clean transcode: {cmp}")
    return problems


def same_regeneration(out: Path, reference: Path) -> list[str]:
    problems = []
    for name in ("data.jsonl", "rejects.jsonl"):
        if not (out / name).exists():
            problems.append(f"{name} is missing")
        elif (out / name).read_bytes() != (reference / name).read_bytes():
            problems.append(f"{name} differs from a clean regeneration")
    return problems


def stage_case(world: World, work: Path, stage: str, action: str, point: str, nth: int) -> tuple[list[str], str]:
    """An injected fault in transcode or regeneration, then a clean rerun."""
    if stage == "transcode":
        from shards.__main__ import main

        out, prefix = work / f"transcode-{point}", "shards transcode:"
        args, reference, same = transcode_args(world, out), reference_transcode(world, work), same_transcode
    else:
        from extract.regenerate.__main__ import main

        out, prefix = work / f"regenerate-{point}", "regenerate:"
        args, reference, same = regenerate_args(world, out), reference_regeneration(world, work), same_regeneration
    expected = "No space left on device" if action == "enospc" else "Input/output error"
    with faults.injected(faults.Fault(action, point, nth)):
        code, stderr = call_main(main, args)
        fired = list(faults.fired)
    if not fired:
        return [f"the fault never fired (exit {code})"], ""
    problems = judge_message(prefix.rstrip(":"), code, stderr, expected)
    if code != 4:
        problems.append(f"exit status {code}, not 4")
    said = message(stderr, prefix)
    left = [p.name for p in out.rglob("*") if p.name.endswith(".tmp")] if out.exists() else []
    if left:
        problems.append(f"temporary files left after the error: {left[:5]}")
    code, stderr = call_main(main, args)
    if code != 0:
        problems.append(f"rerun failed ({code}): {stderr[-400:]}")
    else:
        problems += [f"after the rerun: {p}" for p in same(out, reference)]
    return problems, said


def small_disk_case(world: World, work: Path, stage: str) -> tuple[list[str], str]:
    """The stage on a real full disk (a small tmpfs), then again with room: see `small_disk`."""
    from tests.reliability import small_disk

    disk, keep = work / f"disk-{stage}", work / f"disk-{stage}-kept"
    if stage == "extract":
        reference = world.baseline
        config = world.extract_config(work / f"disk-{stage}-config" / "out")
        text = config.read_text().replace(str(work / f"disk-{stage}-config" / "out"), str(disk / "out"))
        config.write_text(text)
        args, output = [str(config)], "out"
    elif stage == "transcode":
        reference = reference_transcode(world, work)
        args, output = transcode_args(world, disk / "out"), "out"
    elif stage == "transcode_wide":
        reference = reference_transcode(world, work, wide_dataset(work))
        args, output = transcode_args(world, disk / "out", wide_dataset(work)), "out"
    elif stage == "regenerate":
        reference = reference_regeneration(world, work)
        args, output = regenerate_args(world, disk / "out"), "out"
    else:
        reference = reference_training(world, work)
        args, output = world.train_args(disk, "run", *train_extra(STEPS, EVERY)), "run"
    size_kb = max(16, small_disk.disk_bytes(reference) // 2 // 4096 * 4)
    if stage == "train_optimizer":  # full inside torch's writer: the first checkpoint's optimizer.pt (issue 54)
        size_kb = first_optimizer_fills(reference)
    report = small_disk.run_case(stage, args, disk=disk, size_kb=size_kb, output=output, keep=keep)
    if "error" in report:
        return [report["error"]], ""
    (code, stderr), left, (again, again_err) = report["first"], report["left"], report["second"]
    prefix = {"extract": "extract", "transcode": "shards transcode", "regenerate": "regenerate", "train": "train"}
    prefix["transcode_wide"], prefix["train_optimizer"] = prefix["transcode"], prefix["train"]
    problems = judge_message(prefix[stage], code, stderr, "No space left on device")
    if stage == "train_optimizer" and "optimizer.pt" not in message(stderr, "train:"):
        problems.append(f"the disk did not fill inside optimizer.pt (on a {size_kb} kB disk): the case tested nothing")
    if code != 4:
        problems.append(f"exit status {code}, not 4 (on a {size_kb} kB disk)")
    if left:
        problems.append(f"temporaries left on the full disk: {left[:5]}")
    if again != 0:
        problems.append(f"rerun with room failed ({again}): {again_err[-400:]}")
    elif stage == "extract":
        problems += [
            f"after the rerun: {p}" for p in check_final(keep, world.baseline, dict(sample_bytes(reference)))[0]
        ]
    elif stage in ("transcode", "transcode_wide"):
        problems += [f"after the rerun: {p}" for p in same_transcode(keep, reference)]
    elif stage == "regenerate":
        problems += [f"after the rerun: {p}" for p in same_regeneration(keep, reference)]
    else:
        problems += [f"after the rerun: {p}" for p in compare_runs(keep, reference, STEPS)[0]]
    return problems, message(stderr, prefix[stage] + ":")


def first_optimizer_fills(reference: Path) -> int:
    """kB of a disk that holds a run's files up to its first checkpoint's model.safetensors, and half its
    optimizer.pt (what torch.save writes: its zip writer turned ENOSPC into "enforce fail at inline_container")."""
    from tests.reliability import small_disk

    first = sorted((reference / "checkpoints").glob("step-*"))[0]
    pages = lambda n: -(-n // 4096) * 4096  # noqa: E731
    before = sum(pages(p.stat().st_size) for p in reference.iterdir() if p.is_file())
    room = before + small_disk.disk_bytes(first) - pages((first / "optimizer.pt").stat().st_size) // 2
    return room // 1024


def reference_training(world: World, work: Path) -> Path:
    from train.__main__ import main as train_main

    reference = work / "runs" / "io-reference"
    if not (reference / "metrics.jsonl").exists():
        code, stderr = call_main(
            train_main, world.train_args(work / "runs", "io-reference", *train_extra(STEPS, EVERY))
        )
        assert code == 0, stderr[-600:]
    return reference


def run(
    world: World,
    *,
    work: Path,
    extract_cases=EXTRACT_CASES,
    train_cases=TRAIN_CASES,
    transcode_cases=TRANSCODE_CASES,
    regenerate_cases=REGENERATE_CASES,
    small_disk_stages=SMALL_DISK_STAGES,
) -> Outcome:
    from tests.reliability import small_disk
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
    for stage, cases in (("transcode", transcode_cases), ("regenerate", regenerate_cases)):
        for action, point, nth in cases:
            total += 1
            problems, said = stage_case(world, work, stage, action, point, nth)
            passed += not problems
            outcome.failures += [f"{stage}, {action} at {point} #{nth}: {p}" for p in problems]
            outcome.details.append(
                f"{stage}, {action.upper()} at {point} (#{nth}): {'passed' if not problems else 'FAILED'}; {said[:240]}"
            )
    why_not = small_disk.unavailable() if small_disk_stages else None
    if why_not:
        outcome.details.append(f"real full disks (small tmpfs): not run here: {why_not}")
    for stage in () if why_not else small_disk_stages:
        total += 1
        problems, said = small_disk_case(world, work, stage)
        passed += not problems
        outcome.failures += [f"{stage} on a full disk: {p}" for p in problems]
        outcome.details.append(
            f"{stage} on a real full disk (small tmpfs): {'passed' if not problems else 'FAILED'}; {said[:240]}"
        )
    outcome.seconds = time.perf_counter() - start
    return outcome.finish(f"{passed}/{total} scenarios passed")
