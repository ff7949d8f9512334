"""Command line for shard datasets.

    python -m shards inspect DIR                 provenance, counts, length histogram, bytes/token vs raw bf16
    python -m shards verify DIR [--no-checksums] every check (each sample against its checksum too); one line
                                                 per problem; exit 1 if any
    python -m shards show DIR SAMPLE [--tokenizer TOK_DIR] [--positions N]
                                                 one sample (position or sample id): tokens, top-k, per-tap stats
    python -m shards merge DIR NAME... [--out manifest.json]
                                                 combine per-rank manifests in DIR into one
    python -m shards transcode SRC DST encoding=ENC [projection=pca:rank=R|pca:variance=V|FILE] [key=value ...]
                                                 derive a storage tier (quantized and/or projected) from SRC;
                                                 resumable; verified at the end (`... transcode --help`: every key)

DIR is a local path, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX (docs/object-storage.md).

Exit status: 0 done; 1 verify (or transcode's final verify) found problems; 2 a user error (one
line: a bad argument, a dataset that cannot be read); 4 an I/O error such as a full disk (one line
naming the file; a transcode keeps what it committed and rerunning the same command resumes);
130 interrupted (Ctrl-C; a transcode resumes the same way).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from common.config import ConfigError, knob, parse_command
from common.interrupts import run_main
from common.locations import check_problem
from shards.describe import inspect_lines, show_lines, unchecked_shards
from shards.manifest import MANIFEST_NAME, merge_manifests
from shards.reader import ShardDataset
from shards.schema import ShardFormatError
from shards.transcode import TranscodeConfig, summary_lines, transcode
from shards.verify import verify_dataset


@dataclass(frozen=True)
class InspectConfig:
    """`python -m shards inspect DIR`: provenance, counts, length histogram, bytes per token."""

    dir: str = knob(help="dataset root (a local path, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX)", path="data_in")
    manifest: str = knob(MANIFEST_NAME, help="manifest file name inside DIR")


@dataclass(frozen=True)
class VerifyConfig:
    """`python -m shards verify DIR`: check checksums, schema, every sample, counts; exit 1 on any problem."""

    dir: str = knob(help="dataset root (a local path, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX)", path="data_in")
    manifest: str = knob(MANIFEST_NAME, help="manifest file name inside DIR")
    no_checksums: bool = knob(False, help="skip hashing whole files (faster; samples are still checked)")
    no_progress: bool = knob(False, help="no progress bar")


@dataclass(frozen=True)
class ShowConfig:
    """`python -m shards show DIR SAMPLE`: one sample: tokens, top-k of the first positions, per-tap statistics."""

    dir: str = knob(help="dataset root (a local path, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX)", path="data_in")
    sample: str = knob(help="position in the dataset (negative from the end) or a sample id")
    manifest: str = knob(MANIFEST_NAME, help="manifest file name inside DIR")
    tokenizer: str | None = knob(None, help="local tokenizer directory to decode tokens (no download)", path="local_in")
    positions: int = knob(8, help="how many positions of top-k to print", min=0)


@dataclass(frozen=True)
class MergeConfig:
    """`python -m shards merge DIR NAME...`: combine per-rank manifests into one."""

    dir: str = knob(help="dataset root holding the rank manifests", path="data_out")
    out: str = knob(MANIFEST_NAME, help="name of the merged manifest inside DIR")


COMMANDS = {
    "inspect": (InspectConfig, ["dir"]),
    "verify": (VerifyConfig, ["dir"]),
    "show": (ShowConfig, ["dir", "sample"]),
    "merge": (MergeConfig, ["dir"]),  # then the manifest names
    "transcode": (TranscodeConfig, []),  # SRC DST, then the settings
}


def parse_args(argv: list[str]) -> tuple[str, Any, list[str]]:
    """(command, its config, the words left over: merge's names, transcode's SRC and DST), read by
    the grammar of every entry point (`common.config.parse_command`)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        raise ConfigError(f"unknown command '{command}'; commands: {', '.join(COMMANDS)}")
    cls, positional = COMMANDS[command]
    usage = "usage: " + cls.__doc__.split(":")[0].strip("`") if cls.__doc__ else ""
    if command == "transcode":
        usage = "usage: python -m shards transcode SRC DST encoding=ENC [key=value ...]"
    if command in ("merge", "transcode"):
        cfg, left = parse_command(cls, rest, positional=positional, rest=True, usage=usage)
    else:
        cfg, left = parse_command(cls, rest, positional=positional, usage=usage), []
    if command == "merge" and not left:
        raise ConfigError("merge needs the names of the manifests to combine (python -m shards merge DIR NAME...)")
    if command == "transcode" and len(left) != 2:
        raise ConfigError(f"transcode needs SRC and DST, got {left}")
    for name, word, kind in (
        zip(("SRC", "DST"), left, ("data_in", "data_out"), strict=True) if command == "transcode" else ()
    ):
        problem = check_problem(word, kind)
        if problem:
            raise ConfigError(f"{name}: {problem}")
    return command, cfg, left


def _transcode(cfg: TranscodeConfig, src: str, dst: str) -> int:
    result = transcode(src, dst, cfg)
    print("\n".join(summary_lines(src, dst, result)))
    return 1 if result["problems"] else 0


def _load_tokenizer(path: str | None):
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


def _verify(args) -> int:
    problems = verify_dataset(args.dir, args.manifest, checksums=not args.no_checksums, progress=not args.no_progress)
    for problem in problems:
        print(problem)
    if problems:
        print(f"FAILED: {len(problems)} problem(s) in {args.dir}")
        return 1
    ds = ShardDataset(args.dir, args.manifest, verify_samples=False)  # only for the summary line
    print(
        f"OK: {len(ds)} samples, {ds.manifest['counts']['tokens']} tokens in {len(ds.shards)} shards"
        + ("" if args.no_checksums else ", checksums match")
        + (
            ""
            if ds.manifest.get("complete")
            else "; note: the manifest is not marked complete (a writer is running, was killed, or stopped on an error)"
        )
    )
    unchecked = unchecked_shards(ds.shards)
    if unchecked:
        print(
            f"note: {len(unchecked)} of {len(ds.shards)} shards were written before per-sample checksums (format "
            "version 1): "
            "training reads their samples unchecked"
            + ("" if args.no_checksums else "; their whole-file checksums match")
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    command = "?"
    try:
        command, args, words = parse_args(list(sys.argv[1:] if argv is None else argv))
        if command == "verify":
            return _verify(args)
        if command == "transcode":
            return _transcode(args, *words)
        if command == "inspect":
            # its checksum line says it
            lines = inspect_lines(ShardDataset(args.dir, args.manifest, verify_samples=False))
        elif command == "show":
            lines = show_lines(
                ShardDataset(args.dir, args.manifest), args.sample, _load_tokenizer(args.tokenizer), args.positions
            )
        else:
            merged = merge_manifests(args.dir, [os.path.basename(n) for n in words], args.out)
            counts = merged["counts"]
            lines = [
                f"merged {len(words)} manifests into {args.out}: {len(merged['shards'])} shards, "
                f"{counts['samples']} samples, {counts['tokens']} tokens, complete: {merged['complete']}"
            ]
    except (ValueError, KeyError, IndexError, FileNotFoundError, ShardFormatError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk, EIO: what was committed stays, a rerun resumes
        after = (
            " Shards committed before it are intact; rerun the same command to resume."
            if command == "transcode"
            else ""
        )
        print(f"shards {command}: I/O error, stopping: {err}.{after}", file=sys.stderr)
        return 4
    except KeyboardInterrupt:
        after = " Rerun the same command to resume." if command == "transcode" else ""
        print(f"shards {command}: interrupted.{after}", file=sys.stderr)
        return 130
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("shards", main))
