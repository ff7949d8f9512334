"""Scenario 3: random byte flips and truncations in shards, index files, the manifest and checkpoints.

Every damaged copy is checked three ways for shard datasets:
- `verify_dataset` (what `python -m shards verify` runs) must report a problem naming the file;
- the trainer's data stream with `data.verify_checksums=true` must stop with an error naming it;
- the same stream with checksums off (the default) is observed, not judged: it stops naming the
  file, or reads data that differs from the intact dataset ("silent"), or reads the same data
  (the damaged bytes were not used: padding, metadata no reader looks at).
Checkpoints: `load_checkpoint` must refuse naming the file, and a run resuming from the damaged
checkpoint must stop with that message. Finally a run with `data.on_corrupt=skip` trains past a
damaged shard and counts exactly its samples. Figure: corruptions detected / injected.
"""

from __future__ import annotations

import collections
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


def data_config(root: Path, *, verify: bool, on_corrupt: str = "fail"):
    from train.data import DataConfig

    return DataConfig(shards=str(root), verify_checksums=verify, on_corrupt=on_corrupt, token_budget=512, num_buckets=2,
                      holdout_fraction=0.0, prefetch_threads=1, prefetch_depth=2)


def epoch_fingerprint(root: Path, *, verify: bool) -> list[str]:
    """One epoch of the trainer's batches, each reduced to a hash (raises what the stream raises)."""
    import torch

    from train.data import DataStream

    prints = []
    with DataStream(data_config(root, verify=verify)) as stream:
        for _ in range(stream.steps_per_epoch):
            batch = next(stream)
            h = hashlib.sha256("|".join(batch.sample_ids).encode())
            for name in batch.TENSOR_FIELDS:
                h.update(getattr(batch, name).contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            prints.append(h.hexdigest())
    return prints


def stream_outcome(root: Path, name: str, reference: list[str], *, verify: bool) -> str:
    """'named' (stopped naming the file), 'unnamed' (stopped, file not named), 'silent' or 'same'."""
    try:
        got = epoch_fingerprint(root, verify=verify)
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


def check_dataset_damage(trial: Path, name: str, reference: list[str]) -> tuple[bool, bool, str]:
    """(verify named it, trainer with checksums named it, trainer without checksums: outcome)."""
    from shards import verify_dataset

    problems = [str(p) for p in verify_dataset(str(trial))]
    by_verify = any(name in p for p in problems)
    by_trainer = stream_outcome(trial, name, reference, verify=True) == "named"
    unchecked = stream_outcome(trial, name, reference, verify=False)
    return by_verify, by_trainer, unchecked


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


def skip_corrupt_shard(world: World, pristine: Path, work: Path, rng: random.Random, outcome: Outcome) -> None:
    """A run with data.on_corrupt=skip trains past a damaged shard and counts exactly its samples."""
    import json

    from train.loop import train

    for verify, how in ((True, "flip"), (False, "truncate")):
        trial = work / f"skip-{how}"
        shutil.copytree(pristine, trial)
        manifest = json.loads((trial / "manifest.json").read_text())
        entry = rng.choice(manifest["shards"])
        path = trial / entry["file"]
        data = bytearray(path.read_bytes())
        if how == "flip":
            data[rng.randrange(len(data))] ^= 0x5A
        else:
            data = data[: len(data) // 2]
        path.write_bytes(bytes(data))
        cfg = world.train_cfg(work / "runs", f"skip-{how}", "optim.max_steps=1000", "optim.epochs=1", "checkpoint.every=1000",
                              "data.on_corrupt=skip", f"data.verify_checksums={str(verify).lower()}", shards=trial)
        cfg.optim.max_steps = None  # one epoch, every batch
        try:
            summary = train(cfg)
        except Exception as exc:  # noqa: BLE001
            outcome.fail(f"on_corrupt=skip ({how}, verify_checksums={verify}): the run stopped: {type(exc).__name__}: {exc}")
            continue
        counted = summary.get("corrupt_samples")
        if counted != {entry["file"]: entry["samples"]}:
            outcome.fail(f"on_corrupt=skip ({how}, verify_checksums={verify}): counted {counted!r}, "
                         f"expected {{{entry['file']!r}: {entry['samples']}}}")
        else:
            outcome.details.append(f"on_corrupt=skip, {how}, verify_checksums={verify}: trained one epoch past {entry['file']}, "
                                   f"counted its {entry['samples']} samples in the run summary")


def run(world: World, *, trials: int, seed: int, work: Path) -> Outcome:
    """`trials` damaged copies of the dataset files and as many of checkpoint files."""
    outcome = Outcome(3, "Corruption")
    start = time.perf_counter()
    rng = random.Random(seed)
    pristine = work / "pristine"
    shutil.copytree(world.baseline, pristine)
    reference = epoch_fingerprint(pristine, verify=True)
    files = dataset_files(pristine)
    injected = detected = 0
    by_kind: dict = collections.defaultdict(lambda: collections.Counter())
    unchecked: collections.Counter = collections.Counter()
    kinds = ["shard"] * 3 + ["index"] + ["manifest"]
    for i in range(trials):
        kind = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds)
        name = rng.choice(files[kind])
        trial = work / "trial"
        shutil.rmtree(trial, ignore_errors=True)
        shutil.copytree(pristine, trial)
        what = damage(trial / name, rng)
        by_verify, by_trainer, seen = check_dataset_damage(trial, name, reference)
        injected += 1
        by_kind[kind]["injected"] += 1
        by_kind[kind]["verify"] += by_verify
        by_kind[kind]["trainer"] += by_trainer
        unchecked[seen.split(":")[0]] += 1
        if by_verify and by_trainer:
            detected += 1
        else:
            outcome.fail(f"{name}: {what}: verify named it: {by_verify}, trainer with verify_checksums named it: {by_trainer}")
        if seen.startswith("unnamed"):
            outcome.fail(f"{name}: {what}: with checksums off the trainer stopped without naming the file: {seen}")

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
        outcome.details.append(f"{kind} files: {c['injected']} damaged; verify named the file {c['verify']}, "
                               f"trainer with verify_checksums {c['trainer']}")
    c = by_kind["checkpoint"]
    outcome.details.append(f"checkpoint files: {c['injected']} damaged; load_checkpoint named the file {c['load_checkpoint']} "
                           f"(a resume through train() tried once per file kind)")
    outcome.details.append("trainer with verify_checksums=false (the default), dataset damage: "
                           + ", ".join(f"{k} {v}" for k, v in sorted(unchecked.items()))
                           + " (named = stopped naming the file; silent = read different data without noticing; "
                             "same = the damaged bytes were never read). Truncations and manifest damage are always caught "
                             "(file sizes and the manifest's own checksum are checked on every open); a flipped byte inside "
                             "a shard's compressed data is caught only by checksums: run `python -m shards verify` once "
                             "on a copied dataset, or train with data.verify_checksums=true")
    outcome.seconds = time.perf_counter() - start
    return outcome.finish(f"{detected}/{injected} corruptions detected")
