"""`python -m extract [CONFIG] key=value ...`: run the target over a corpus and write shards.

    python -m extract configs/tiny.toml                        # the built-in tiny default (CPU)
    python -m extract configs/qwen3.6-27b.toml out_dir=/data/x  # real target, one GPU
    torchrun --nproc-per-node 8 -m extract configs/qwen3.6-27b.toml
    python -m extract --help                                    # every key with its help

Reads the `[extract]` table of CONFIG; see extract/config.py. User errors (bad config, missing
files, a resume with changed settings) print one line naming the problem and exit with status 2;
an I/O error (full disk, EIO) prints one line and exits with status 4: every shard committed before
it stays in the dataset, and rerunning the same command resumes.
"""

from __future__ import annotations

import logging
import sys

from common.config import ConfigError, parse_cli
from extract.config import ExtractConfig


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_cli(ExtractConfig, argv, section="extract")
    except ConfigError as err:
        print(f"extract: {err}", file=sys.stderr)
        return 2
    from extract import pipeline

    try:
        ranks = pipeline.Ranks.from_env()
        summaries = pipeline.run(cfg, ranks=ranks)
    except ValueError as err:  # user errors: config, corpus, target, resume refusals, on_error=fail
        print(f"extract: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # full disk, I/O errors: the manifest still lists only complete shards
        print(f"extract: I/O error, stopping: {err}. Shards committed before it are intact; rerun the same command to resume.", file=sys.stderr)
        return 4
    if ranks.rank == 0:
        for name, summary in summaries.items():
            print(("" if name is None else f"[{name}]\n") + pipeline.format_summary(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
