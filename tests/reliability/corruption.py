"""Scenario 3: random byte flips and truncations in shards, index files, the manifest and checkpoints.

Every damaged copy is checked four ways for shard datasets:
- `verify_dataset` (what `python -m shards verify` runs) must report a problem naming the file;
- the trainer's data stream with `data.verify_checksums=true` must stop with an error naming it;
- the same stream with the default settings (per-sample checksums on, whole-file checksums off)
  must stop naming the file, or read exactly the intact data ("same": the damaged bytes are never
  read, e.g. the file header or footer); reading different data without noticing ("silent") fails;
- the stream with every check off (`data.verify_samples=false`) is observed, not judged: it shows
  what the per-sample checksums catch that zstd and Arrow alone do not.
Checkpoints: `load_checkpoint` must refuse naming the file, and a run resuming from the damaged
checkpoint must stop with that message. Finally runs with `data.on_corrupt=skip` train past a
damaged shard and count exactly its samples, or, for a byte flipped inside one sample with the
default settings, exactly that sample. Figure: corruptions detected / injected.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import random
import shutil
import time
from pathlib import Path

from tests.reliability.outcome import Outcome
from tests.reliability.world import World

CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "state.json", "drafter_config.json")


def damage(path: Path, rng: random.Random) -> str:
    """Flip one byte (XOR with a random non-zero value) or truncate the file; returns what was done."""
    data = bytearray(path.read_bytes())
    if rng.random() < 0.65 and data:
        at = rng.randrange(len(data))
        data[at] ^= rng.randint(1, 255)
        what = f"byte {at} of {len(data)} flipped"
    else:
        keep = rng.randrange(len(data)) if data else 0
        data = data[:keep]
        what = f"truncated to {keep} bytes"
    path.write_bytes(bytes(data))
    return what


# The trainer's data checks: the default, the slow whole-file checksums on top, and nothing at all.
DEFAULT_CHECKS = {"verify_checksums": False, "verify_samples": True}
ALL_CHECKS = {"verify_checksums": True, "verify_samples": True}
NO_CHECKS = {"verify_checksums": False, "verify_samples": False}


def data_config(root: Path, *, verify_checksums: bool, verify_samples: bool, on_corrupt: str = "fail"):
    from train.data import DataConfig

    return DataConfig(
        shards=str(root),
        verify_checksums=verify_checksums,
        verify_samples=verify_samples,
        on_corrupt=on_corrupt,
        token_budget=512,
        num_buckets=2,
        holdout_fraction=0.0,
        prefetch_threads=1,
        prefetch_depth=2,
    )


def epoch_fingerprint(root: Path, checks: dict) -> list[str]:
    """One epoch of the trainer's batches, each reduced to a hash (raises what the stream raises)."""
    import torch

    from train.data import DataStream

    prints = []
    with DataStream(data_config(root, **checks)) as stream:
        for _ in range(stream.steps_per_epoch):
            batch = next(stream)
            h = hashlib.sha256("|".join(batch.sample_ids).encode())
            for name in batch.TENSOR_FIELDS:
                h.update(getattr(batch, name).contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            prints.append(h.hexdigest())
    return prints


def stream_outcome(root: Path, name: str, reference: list[str], checks: dict) -> str:
    """'named' (stopped naming the file), 'unnamed' (stopped, file not named), 'silent' or 'same'."""
    try:
        got = epoch_fingerprint(root, checks)
    except Exception as exc:  # noqa: BLE001 - how the stream stops is what is measured
        return "named" if name in str(exc) else f"unnamed: {type(exc).__name__}: {str(exc)[:200]}"
    return "same" if got == reference else "silent"


def dataset_files(root: Path) -> dict[str, list[str]]:
    import json

    manifest = json.loads((root / "manifest.json").read_text())
    return {
        "shard": [e["file"] for e in manifest["shards"]],
        "index": [e["index_file"] for e in manifest["shards"]],
        "manifest": ["manifest.json"],
    }


def make_checkpoint(world: World, work: Path) -> Path:
    """A finished 2-step run; returns its run directory (latest checkpoint at step 2)."""
    from train.loop import train

    train(world.train_cfg(work / "runs", "ckpt", "optim.max_steps=2", "checkpoint.every=1"))
    return work / "runs" / "ckpt"


def check_dataset_damage(trial: Path, name: str, reference: list[str]) -> tuple[bool, bool, str, str]:
    """(verify named it, trainer with every check named it, outcome with the default checks, outcome with none)."""
    from shards import verify_dataset

    problems = [str(p) for p in verify_dataset(str(trial))]
    by_verify = any(name in p for p in problems)
    by_trainer = stream_outcome(trial, name, reference, ALL_CHECKS) == "named"
    default = stream_outcome(trial, name, reference, DEFAULT_CHECKS)
    unchecked = stream_outcome(trial, name, reference, NO_CHECKS)
    return by_verify, by_trainer, default, unchecked


def check_checkpoint_damage(run_dir: Path, name: str) -> tuple[bool, str]:
    """(load_checkpoint refused naming the file, the message)."""
    from train.checkpoint import latest_checkpoint, load_checkpoint

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    try:
        load_checkpoint(ckpt)
    except ValueError as exc:
        return name in str(exc), str(exc)
    except Exception as exc:  # noqa: BLE001 - anything else is a traceback from deep inside
        return False, f"{type(exc).__name__}: {exc}"
    return False, "loaded without error"


def resume_refuses(cfg, name: str) -> tuple[bool, str]:
    from train.loop import train

    try:
        train(cfg)
    except ValueError as exc:
        return name in str(exc), str(exc)
    except Exception as exc:  # noqa: BLE001
        return False, f"{type(exc).__name__}: {exc}"
    return False, "resumed without error"


def _damage_for_skip(path: Path, entry: dict, how: str, rng: random.Random, index_path: Path) -> int:
    """Damage a shard for the on_corrupt=skip runs; returns how many of its samples must be skipped."""
    from common.io import resolve
    from shards.manifest import read_index

    data = bytearray(path.read_bytes())
    skipped = entry["samples"]
    if how == "truncate":
        data = data[: len(data) // 2]
    elif how == "flip":
        data[rng.randrange(len(data))] ^= 0x5A
    else:  # "sample flip": a byte inside one sample's record batch; only that sample is unreadable
        index = read_index(*resolve(str(index_path.parent)), entry).to_pylist()
        row = index[rng.randrange(len(index))]
        data[rng.randrange(row["offset"], row["offset"] + row["length"])] ^= 0x5A
        skipped = 1
    path.write_bytes(bytes(data))
    return skipped


def skip_corrupt_shard(world: World, pristine: Path, work: Path, rng: random.Random, outcome: Outcome) -> None:
    """Runs with data.on_corrupt=skip train past a damaged shard and count exactly the unreadable samples."""
    import json

    from train.loop import train

    for how, verify in (("flip", True), ("truncate", False), ("sample flip", False)):
        trial = work / f"skip-{how.replace(' ', '-')}"
        shutil.copytree(pristine, trial)
        manifest = json.loads((trial / "manifest.json").read_text())
        entry = rng.choice(manifest["shards"])
        skipped = _damage_for_skip(trial / entry["file"], entry, how, rng, trial / entry["index_file"])
        cfg = world.train_cfg(
            work / "runs",
            f"skip-{how.replace(' ', '-')}",
            "optim.max_steps=1000",
            "optim.epochs=1",
            "checkpoint.every=1000",
            "data.on_corrupt=skip",
            f"data.verify_checksums={str(verify).lower()}",
            shards=trial,
        )
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, max_steps=None))  # one epoch, every batch
        try:
            summary = train(cfg)
        except Exception as exc:  # noqa: BLE001
            outcome.fail(
                f"on_corrupt=skip ({how}, verify_checksums={verify}): the run stopped: {type(exc).__name__}: {exc}"
            )
            continue
        counted = summary.get("corrupt_samples")
        if counted != {entry["file"]: skipped}:
            outcome.fail(
                f"on_corrupt=skip ({how}, verify_checksums={verify}): counted {counted!r}, expected "
                f"{{{entry['file']!r}: {skipped}}}"
            )
        else:
            outcome.details.append(
                f"on_corrupt=skip, {how}, verify_checksums={verify}: trained one epoch past {entry['file']}, "
                f"counted its {skipped} unreadable sample(s) (of {entry['samples']}) in the run summary"
            )


def run(world: World, *, trials: int, seed: int, work: Path) -> Outcome:
    """`trials` damaged copies of the dataset files and as many of checkpoint files."""
    outcome = Outcome(3, "Corruption")
    start = time.perf_counter()
    rng = random.Random(seed)
    pristine = work / "pristine"
    shutil.copytree(world.baseline, pristine)
    reference = epoch_fingerprint(pristine, ALL_CHECKS)
    files = dataset_files(pristine)
    injected = detected = 0
    by_kind: dict = collections.defaultdict(lambda: collections.Counter())
    by_default: dict = collections.defaultdict(lambda: collections.Counter())  # kind -> outcome -> count
    unchecked: collections.Counter = collections.Counter()
    unnamed_unchecked: list[str] = []
    kinds = ["shard"] * 3 + ["index"] + ["manifest"]
    for i in range(trials):
        kind = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds)
        name = rng.choice(files[kind])
        trial = work / "trial"
        shutil.rmtree(trial, ignore_errors=True)
        shutil.copytree(pristine, trial)
        what = damage(trial / name, rng)
        by_verify, by_trainer, default, seen = check_dataset_damage(trial, name, reference)
        injected += 1
        by_kind[kind]["injected"] += 1
        by_kind[kind]["verify"] += by_verify
        by_kind[kind]["trainer"] += by_trainer
        by_default[kind][default.split(":")[0]] += 1
        unchecked[seen.split(":")[0]] += 1
        if by_verify and by_trainer and default in ("named", "same"):
            detected += 1
        else:
            outcome.fail(
                f"{name}: {what}: verify named it: {by_verify}, trainer with verify_checksums named it: {by_trainer}, "
                f"trainer with the default checks: {default}"
            )
        if seen.startswith("unnamed"):  # observed only: switching the checks off is the user's choice
            unnamed_unchecked.append(f"{name}: {what}: {seen}")

    run_dir = make_checkpoint(world, work)
    from train.checkpoint import latest_checkpoint

    resumed_kinds = set()
    for i in range(trials):
        name = CHECKPOINT_FILES[i % len(CHECKPOINT_FILES)]
        trial = work / "runs" / "ckpt-trial"
        shutil.rmtree(trial, ignore_errors=True)
        shutil.copytree(run_dir, trial)
        what = damage(latest_checkpoint(trial / "checkpoints") / name, rng)
        named, message = check_checkpoint_damage(trial, name)
        injected += 1
        by_kind["checkpoint"]["injected"] += 1
        by_kind["checkpoint"]["load_checkpoint"] += named
        if named and name not in resumed_kinds:  # through the trainer too, once per file
            resumed_kinds.add(name)
            cfg = world.train_cfg(work / "runs", "ckpt-trial", "optim.max_steps=2", "checkpoint.every=1")
            named, message = resume_refuses(cfg, name)
            if not named:
                outcome.fail(f"checkpoint {name}: {what}: resuming did not stop naming the file: {message}")
        if named:
            detected += 1
        else:
            outcome.fail(f"checkpoint {name}: {what}: not refused naming the file: {message[:300]}")
    skip_corrupt_shard(world, pristine, work, rng, outcome)

    for kind in ("shard", "index", "manifest"):
        c = by_kind[kind]
        outcome.details.append(
            f"{kind} files: {c['injected']} damaged; verify named the file {c['verify']}, "
            f"trainer with verify_checksums {c['trainer']}, trainer with the default checks: "
            + ", ".join(f"{k} {v}" for k, v in sorted(by_default[kind].items()))
        )
    c = by_kind["checkpoint"]
    outcome.details.append(
        f"checkpoint files: {c['injected']} damaged; load_checkpoint named the file {c['load_checkpoint']} "
        f"(a resume through train() tried once per file kind)"
    )
    default = sum((by_default[kind] for kind in by_default), collections.Counter())
    outcome.details.append(
        "trainer with the default checks (data.verify_samples=true: each index file against the manifest, each "
        "sample's bytes against their xxh3-64 in the index; data.verify_checksums=false), dataset damage: "
        + ", ".join(f"{k} {v}" for k, v in sorted(default.items()))
        + "; with every check off (data.verify_samples=false): "
        + ", ".join(f"{k} {v}" for k, v in sorted(unchecked.items()))
        + " (named = stopped naming the file; silent = read different data without noticing; "
        "same = the damaged bytes were never read: file header, footer). Truncations and manifest damage "
        "are caught either way (file sizes and the manifest's own checksum are checked on every open); "
        "a flipped byte inside a shard's compressed data is caught only by the per-sample checksums"
    )
    if unnamed_unchecked:
        outcome.details.append(
            "with every check off, stopped without naming the file (observed, not judged): "
            + "; ".join(unnamed_unchecked)
        )
    outcome.seconds = time.perf_counter() - start
    return outcome.finish(f"{detected}/{injected} corruptions detected")
