"""The cached build of `artifacts/tiny`: the recipe digest (parameters, the code that decides the
artifacts, and the shipped build's manifest or, for a target trained here, the Python version), the
build into a temporary directory renamed into place, and the lock that makes concurrent callers wait
for one build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common.config import config_to_dict
from common.io import replace_local_dir
from recipes.tiny.compute import log, resolve_build_device
from recipes.tiny.config import TRAINING_KNOBS, TinyConfig, resolve_precision
from recipes.tiny.corpus import build_corpus, read_jsonl, write_jsonl
from recipes.tiny.regenerate import REGEN_FILES, regenerate_corpus
from recipes.tiny.shipped import CORPUS_FILES, TARGET_FILES, shipped_digest, unpack_shipped
from recipes.tiny.target import build_tiny_target

BUILD_RECORD = "build.json"
REQUIRED_FILES = (BUILD_RECORD, *CORPUS_FILES, *REGEN_FILES.values(), *TARGET_FILES)
# Knobs that change where or how fast the build runs, not what it builds.
NOT_IN_RECIPE = ("out_dir", "threads", "force")


# The code that decides the artifacts: this package, the regeneration code it answers the corpus with, the repeat rule.
RECIPE_CODE = (
    *sorted(Path(__file__).resolve().parent.glob("*.py")),
    *(
        Path(importlib.util.find_spec(name).origin).resolve()
        for name in ("extract.regenerate.local", "extract.regenerate.conversation", "common.repeat")
    ),
)


def recipe(cfg: TinyConfig) -> dict[str, Any]:
    """Everything that decides the artifacts: build parameters with the device type and precision
    they resolve to here, the code of this package (and the regeneration's and the repeat rule's),
    and where the corpus and target come from: the shipped build's manifest (`target=shipped`), or
    the Python version (`target=train`: its bundled documentation is the corpus).

    A CPU build and a GPU build are different computations (other kernels, bf16 on the GPU where a
    CPU may train in fp32), so the device type is part of the recipe: on a GPU host a CPU-built
    cache is rebuilt, not passed off as a GPU build, and the other way round. Left out on purpose:
    library versions, the CPU model and the thread count. They change the rounding, which after
    1,000 training steps gives a different but equally valid target, not a different recipe (which
    is why the default target is the shipped one), and build.json records the machine that built
    the cache (`built_on`)."""
    cfg = auto_as_shipped(cfg)
    trains = cfg.target == "train"
    left_out = NOT_IN_RECIPE + (() if trains else TRAINING_KNOBS)
    params = {k: v for k, v in config_to_dict(cfg).items() if k not in left_out}
    params["device"] = resolve_build_device(cfg.device)
    if trains:
        params["precision"] = resolve_precision(cfg.precision, params["device"])
    source = {"python": sys.version.split()[0]} if trains else {"shipped": shipped_digest()}
    return {
        "params": params,
        "code": hashlib.sha256(b"".join(path.read_bytes() for path in RECIPE_CODE)).hexdigest()[:16],
        **source,
    }


def recipe_digest(cfg: TinyConfig) -> str:
    return hashlib.sha256(json.dumps(recipe(cfg), sort_keys=True).encode()).hexdigest()[:16]


def is_built(out_dir: str | os.PathLike, digest: str) -> bool:
    """True when `out_dir` holds a finished build of exactly this recipe."""
    out = Path(out_dir)
    if not all((out / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        return json.loads((out / BUILD_RECORD).read_text()).get("recipe_digest") == digest
    except (OSError, ValueError):
        return False


def build_tiny(cfg: TinyConfig | None = None, *, progress: bool = True) -> Path:
    """Build the tiny corpus and target into `cfg.out_dir` unless a matching build is there.

    The build happens in a temporary sibling directory that is renamed into place at the end, so a
    build killed midway never looks finished; its leftovers are removed by the next run. A lock
    file makes concurrent callers wait for one build instead of racing.
    """
    cfg = cfg or TinyConfig()
    cfg.check()
    out = Path(cfg.out_dir).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(out):
        if cfg.target == "auto" and not cfg.force and holds_trained_build(out):
            log(f"keeping the tiny default trained here in {out} (a target=train build); target=shipped replaces it")
            return out
        cfg = auto_as_shipped(cfg)
        digest = recipe_digest(cfg)
        if not cfg.force and is_built(out, digest):
            log(f"tiny default is up to date in {out} (recipe {digest}); nothing to do")
            return out
        remove_leftovers(out)
        tmp = out.with_name(f"{out.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            build_into(tmp, cfg, digest, progress)
            replace_local_dir(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def auto_as_shipped(cfg: TinyConfig) -> TinyConfig:
    """`cfg` with target=auto read as shipped (once no target=train build is there to keep)."""
    import dataclasses

    return dataclasses.replace(cfg, target="shipped") if cfg.target == "auto" else cfg


def holds_trained_build(out: Path) -> bool:
    """True when `out` holds a finished build made with target=train (what target=auto keeps)."""
    if not all((out / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        return json.loads((out / BUILD_RECORD).read_text())["recipe"]["params"].get("target") == "train"
    except (OSError, ValueError, KeyError, TypeError):
        return False


def build_into(tmp: Path, cfg: TinyConfig, digest: str, progress: bool) -> None:
    from common.device import describe_machine

    started = time.perf_counter()
    log(f"building the tiny default (recipe {digest}) in {tmp}")
    if cfg.target == "shipped":
        train, heldout, report = unpack_shipped_build(tmp)
    else:
        train, heldout, report = train_build(tmp, cfg, progress)
    train_regen, heldout_regen, regen = regenerate_corpus(tmp / "target", train, heldout, cfg, progress=progress)
    write_jsonl(tmp / REGEN_FILES["train"], train_regen)
    write_jsonl(tmp / REGEN_FILES["heldout"], heldout_regen)
    report["regenerated_corpus"] = regen
    (tmp / "target/tiny_report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    record = {
        "recipe_digest": digest,
        "recipe": recipe(cfg),
        "built_on": describe_machine(),
        "build_seconds": round(time.perf_counter() - started, 1),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (tmp / BUILD_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")  # written last
    log(summary_lines(report, record["build_seconds"]))


def unpack_shipped_build(tmp: Path) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """(train, heldout, report) of the shipped corpus and target, unpacked into `tmp`."""
    manifest = unpack_shipped(tmp)
    reference = manifest["reference_build"]
    train, heldout = read_jsonl(tmp / "corpus/train.jsonl"), read_jsonl(tmp / "corpus/heldout.jsonl")
    report = json.loads((tmp / "target/tiny_report.json").read_text())
    report["shipped_from"] = {"built_on": reference["built_on"], "python": reference["recipe"].get("python")}
    log(
        f"corpus ({len(train)} train and {len(heldout)} held-out records) and target: the shipped build "
        f"(trained on {reference['built_on']['cpu']}, {report['device']}, {report['precision']}, Python "
        f"{reference['recipe'].get('python')}); regenerating the answers with it here"
    )
    return train, heldout, report


def train_build(tmp: Path, cfg: TinyConfig, progress: bool) -> tuple[list[dict], list[dict], dict[str, Any]]:
    """(train, heldout, report) of a corpus built from this Python and a target trained on it here."""
    train, heldout = build_corpus(cfg.seed, cfg.heldout_fraction)
    write_jsonl(tmp / "corpus/train.jsonl", train)
    write_jsonl(tmp / "corpus/heldout.jsonl", heldout)
    log(f"corpus: {len(train)} train and {len(heldout)} held-out records")
    report = build_tiny_target(tmp / "target", train, heldout, cfg, progress=progress)
    log(f"target trained on {report['device']} in {report['train_seconds']:.0f} s; regenerating the answers with it")
    return train, heldout, report


def remove_leftovers(out: Path) -> None:
    """Delete temporary directories of earlier builds that were killed (the lock is held)."""
    for leftover in sorted(out.parent.glob(f"{out.name}.*.tmp")):
        log(f"removing the leftover of an unfinished build: {leftover}")
        shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def build_lock(out: Path) -> Iterator[None]:
    with open(out.with_name(f"{out.name}.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def summary_lines(report: dict[str, Any], seconds: float) -> str:
    train, heldout = report["corpus"]["train"], report["corpus"]["heldout"]
    return "\n".join(
        [
            f"tiny target: Qwen3, {report['num_layers']} layers, hidden {report['hidden_size']}, "
            f"{report['parameters'] / 1e6:.2f}M parameters, vocab {report['vocab_size']}, "
            f"mask token {report['mask_token']} = {report['mask_token_id']}",
            f"held-out next-token accuracy {report['heldout_next_token_accuracy']:.3f} "
            f"(always the most frequent token: {report['most_frequent_token_accuracy']:.3f}; "
            f"on training samples: {report['train_probe_next_token_accuracy']:.3f}); "
            f"on answer tokens {report['heldout_answer_next_token_accuracy']:.3f} "
            f"(most frequent token: {report['most_frequent_token_answer_accuracy']:.3f})",
            f"corpus tokens: train {train['tokens']} in {train['records']} records, "
            f"held-out {heldout['tokens']} in {heldout['records']}",
            *regen_summary_lines(report.get("regenerated_corpus")),
            f"tap layer ids {report['tap_layer_ids']}; built in {seconds:.0f} s",
        ]
    )


def regen_summary_lines(regen: dict[str, Any] | None) -> list[str]:
    if not regen:
        return []
    train, heldout = regen["train"], regen["heldout"]
    dropped = train["dropped_empty_answer"] + heldout["dropped_empty_answer"]
    no_round_trip = train["dropped_no_round_trip"] + heldout["dropped_no_round_trip"]
    skipped = train["skipped_no_user_turn"] + heldout["skipped_no_user_turn"]
    answers = train["answers"] + heldout["answers"]
    at_cap = train["answers_at_cap"] + heldout["answers_at_cap"]
    at_repeat = train.get("answers_cut_at_repeat", 0) + heldout.get("answers_cut_at_repeat", 0)
    return [
        f"target-regenerated corpus: {train['records_out']} train and {heldout['records_out']} held-out records "
        f"(dropped: {dropped} with an empty answer, {no_round_trip} whose answer does not survive tokenization; "
        f"{skipped} without a user turn skipped), {answers} greedy answers, "
        f"median {train['answer_length'].get('p50')} tokens, {at_repeat} cut where they start repeating, "
        f"{at_cap} cut at {regen['max_new_tokens']}; {regen['seconds']:.0f} s on {regen.get('device', 'cpu')}",
        "held-out regenerated answer tokens equal to the target's greedy token: "
        f"{regen['heldout_answer_greedy_agreement']:.4f}",
    ]
