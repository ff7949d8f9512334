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

DIR is a local path or any URI pyarrow.fs resolves (s3://..., gs://..., hdfs://...).
"""

from __future__ import annotations

import argparse
import os
import sys

from common.config import describe, load_config
from shards.describe import inspect_lines, show_lines, unchecked_shards
from shards.manifest import MANIFEST_NAME, merge_manifests
from shards.reader import ShardDataset
from shards.schema import ShardFormatError
from shards.transcode import TranscodeConfig, summary_lines, transcode
from shards.verify import verify_dataset


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m shards", description="Inspect, verify, show and merge shard datasets."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="provenance, counts, length histogram, bytes per token")
    p.add_argument("dir")
    p.add_argument("--manifest", default=MANIFEST_NAME)
    p = sub.add_parser("verify", help="check checksums, schema, every sample, counts; exit 1 on any problem")
    p.add_argument("dir")
    p.add_argument("--manifest", default=MANIFEST_NAME)
    p.add_argument(
        "--no-checksums", action="store_true", help="skip hashing whole files (faster; samples are still checked)"
    )
    p.add_argument("--no-progress", action="store_true")
    p = sub.add_parser("show", help="one sample: tokens, top-k of the first positions, per-tap hidden statistics")
    p.add_argument("dir")
    p.add_argument("sample", help="position in the dataset (negative from the end) or a sample id")
    p.add_argument("--manifest", default=MANIFEST_NAME)
    p.add_argument("--tokenizer", help="local tokenizer directory to decode tokens (no download)")
    p.add_argument("--positions", type=int, default=8, help="how many positions of top-k to print")
    p = sub.add_parser("merge", help="combine per-rank manifests into one")
    p.add_argument("dir")
    p.add_argument("names", nargs="+", help="manifest file names inside DIR (paths are reduced to their base name)")
    p.add_argument("--out", default=MANIFEST_NAME)
    p = sub.add_parser(
        "transcode",
        help="derive a cheaper dataset (quantized and/or projected) from SRC, without the target",
        description="key=value settings:\n" + describe(TranscodeConfig),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument(
        "settings", nargs="*", help="key=value: encoding=... (required), projection=..., calibration_samples=..., ..."
    )
    return parser


def _transcode(args) -> int:
    cfg = load_config(TranscodeConfig, None, args.settings)
    result = transcode(args.src, args.dst, cfg)
    print("\n".join(summary_lines(args.src, args.dst, result)))
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
    args = _parser().parse_args(argv)
    try:
        if args.command == "verify":
            return _verify(args)
        if args.command == "transcode":
            return _transcode(args)
        if args.command == "inspect":
            lines = inspect_lines(
                ShardDataset(args.dir, args.manifest, verify_samples=False)
            )  # its checksum line says it
        elif args.command == "show":
            lines = show_lines(
                ShardDataset(args.dir, args.manifest), args.sample, _load_tokenizer(args.tokenizer), args.positions
            )
        else:
            merged = merge_manifests(args.dir, [os.path.basename(n) for n in args.names], args.out)
            counts = merged["counts"]
            lines = [
                f"merged {len(args.names)} manifests into {args.out}: {len(merged['shards'])} shards, "
                f"{counts['samples']} samples, {counts['tokens']} tokens, complete: {merged['complete']}"
            ]
    except (ValueError, KeyError, IndexError, FileNotFoundError, ShardFormatError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
