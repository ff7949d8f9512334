"""The shipped tiny default: the corpus and the trained target of one reference build, kept in the
repository (`recipes/tiny/shipped/`, about 6 MB), so that every machine starts the demo from the same
target and the same prompts.

Why: a build trains the target for 1,000 steps, and another CPU type, thread count, precision or a
GPU rounds differently, which after 1,000 steps is a different (equally accurate) target that loops
in a different share of its answers; the corpus itself is text shipped with Python, so another
Python version is another corpus. Built on two machines from the same commit, the demo's chain τ
differed by nearly half, almost all of it from the target (docs/benchmarks-log-2026-11-30-to-2026-12-04.md,
"Demo: the tiny default end to end"). What still runs on each machine is what the demo exists to show:
regeneration of the answers by the target, extraction, drafter training, evaluation and
speculative decoding.

Layout of `shipped/`: `target/` (the Hugging Face directory as the build wrote it), `corpus/` (the
real-text records, gzipped), `MANIFEST.json` (checksum and size of every file, and the build record
of the reference build: recipe, machine, Python). `unpack_shipped` checks every file against the
manifest before it copies anything; `python -m recipes.tiny.shipped [from=artifacts/tiny]` replaces
the shipped build with a finished `target=train` build.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from common.hashing import CHECKSUM_ALGO, file_checksum
from common.io import replace_local_dir, temp_name
from recipes.tiny.config import training_knobs_off_default

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
MANIFEST = "MANIFEST.json"
TARGET_FILES = (
    "target/chat_template.jinja",
    "target/config.json",
    "target/generation_config.json",
    "target/model.safetensors",
    "target/tokenizer.json",
    "target/tokenizer_config.json",
    "target/tiny_report.json",
)
CORPUS_FILES = ("corpus/train.jsonl", "corpus/heldout.jsonl")  # stored as NAME.gz
# Measured by the regeneration of the machine that unpacks it, not shipped.
REPORT_KEYS_NOT_SHIPPED = ("regenerated_corpus",)


def file_entry(path: Path) -> dict[str, Any]:
    """What the manifest records of a file: its size and the project's file checksum
    (`common.hashing.file_checksum`)."""
    import pyarrow.fs as pafs

    return {"bytes": path.stat().st_size, CHECKSUM_ALGO: file_checksum(pafs.LocalFileSystem(), str(path))}


def shipped_name(name: str) -> str:
    """A build file's name in the shipped folder (the corpus files are gzipped there)."""
    return f"{name}.gz" if name in CORPUS_FILES else name


def read_manifest(shipped_dir: Path | None = None) -> dict[str, Any]:
    path = Path(shipped_dir or SHIPPED_DIR) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"the shipped tiny default is missing ({path} not found): restore recipes/tiny/shipped/ from the "
            "repository, or build a target here with `python -m recipes.tiny target=train`"
        ) from None


def shipped_digest(shipped_dir: Path | None = None) -> str:
    """Short digest of the shipped build (its manifest lists every file's checksum)."""
    return hashlib.sha256(json.dumps(read_manifest(shipped_dir), sort_keys=True).encode()).hexdigest()[:16]


def verify_shipped(shipped_dir: Path | None = None) -> dict[str, Any]:
    """The manifest, after checking that every shipped file is there with its recorded size and
    checksum; ValueError naming the first file that is not."""
    shipped_dir = Path(shipped_dir or SHIPPED_DIR)
    manifest = read_manifest(shipped_dir)
    for name, expected in sorted(manifest["files"].items()):
        path = shipped_dir / name
        if not path.is_file():
            raise ValueError(f"shipped tiny default: {path} is missing (restore it from the repository)")
        actual = file_entry(path)
        if actual != expected:
            raise ValueError(
                f"shipped tiny default: {path} differs from {MANIFEST} (found {actual}, expected {expected}): "
                "restore it from the repository (a Git LFS pointer or a checkout without binary files looks like this)"
            )
    return manifest


def unpack_shipped(dest: Path, shipped_dir: Path | None = None) -> dict[str, Any]:
    """Copy the verified shipped target into `dest/target` and its corpus into `dest/corpus`
    (decompressed). Returns the manifest."""
    shipped_dir = Path(shipped_dir or SHIPPED_DIR)
    manifest = verify_shipped(shipped_dir)
    for name in TARGET_FILES:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shipped_dir / name, dest / name)
    for name in CORPUS_FILES:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(shipped_dir / shipped_name(name), "rb") as src, open(dest / name, "wb") as out:
            shutil.copyfileobj(src, out)
    return manifest


def ship_build(build_dir: Path, shipped_dir: Path | None = None, *, check_defaults: bool = True) -> dict[str, Any]:
    """Replace the shipped build with the finished build in `build_dir` (made with target=train at
    the default training knobs, which target=shipped stands for). The corpus is gzipped with a
    fixed timestamp, so the same build always ships the same bytes; the new copy is written beside
    the old one and swapped in whole."""
    build_dir, shipped_dir = Path(build_dir), Path(shipped_dir or SHIPPED_DIR)
    record = check_shippable(build_dir, check_defaults)
    tmp = Path(temp_name(str(shipped_dir)))
    try:
        manifest = write_shipped(build_dir, record, tmp)
        replace_local_dir(tmp, shipped_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def check_shippable(build_dir: Path, check_defaults: bool = True) -> dict[str, Any]:
    """The build record of `build_dir`; ValueError naming what makes it unfit to ship."""
    missing = [name for name in ("build.json", *TARGET_FILES, *CORPUS_FILES) if not (build_dir / name).is_file()]
    if missing:
        raise ValueError(f"{build_dir} is not a finished tiny build: {', '.join(missing)} missing")
    record = json.loads((build_dir / "build.json").read_text())
    params = record["recipe"]["params"]
    if params.get("target", "train") != "train":  # builds from before the knob all trained
        raise ValueError(f"{build_dir} was not built with target=train: there is nothing new to ship")
    # A build record holds the precision 'auto' resolved to on its machine, not the knob: not compared.
    changed = training_knobs_off_default({k: v for k, v in params.items() if k != "precision"})
    if changed and check_defaults:
        raise ValueError(
            f"{build_dir} was trained with other settings than the defaults that target=shipped stands for: "
            + ", ".join(f"{k}={value!r} (default {default!r})" for k, (value, default) in changed.items())
        )
    return record


def write_shipped(build_dir: Path, record: dict[str, Any], dest: Path) -> dict[str, Any]:
    for name in TARGET_FILES + CORPUS_FILES:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
    for name in TARGET_FILES:
        shutil.copyfile(build_dir / name, dest / name)
    report = json.loads((dest / "target/tiny_report.json").read_text())
    for key in REPORT_KEYS_NOT_SHIPPED:
        report.pop(key, None)
    (dest / "target/tiny_report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    for name in CORPUS_FILES:
        with (
            open(build_dir / name, "rb") as src,
            open(dest / shipped_name(name), "wb") as raw,
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as out,
        ):
            shutil.copyfileobj(src, out)
    files = {shipped_name(name): file_entry(dest / shipped_name(name)) for name in TARGET_FILES + CORPUS_FILES}
    manifest = {"files": files, "reference_build": {k: record[k] for k in ("recipe", "built_on", "build_seconds")}}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest
