"""`python -m extract [CONFIG] key=value ...`: run the target over a corpus and write shards.

    python -m extract configs/tiny.toml                        # the built-in tiny default (CPU)
    python -m extract configs/qwen3.6-27b.toml out_dir=/data/x  # real target, one GPU
    torchrun --nproc-per-node 8 -m extract configs/qwen3.6-27b.toml
    python -m extract --help                                    # every key with its help

Reads the `[extract]` table of CONFIG; see extract/config.py. A user error (a bad config, a corpus
or output path that cannot work, a resume with changed settings, another process writing the same
dataset) stops it before the target loads, in one line. After an I/O error or Ctrl-C every shard
committed stays in the dataset, and rerunning the same command resumes (said only when something
was committed). Exit statuses: docs/ARCHITECTURE.md, "Exit status".
"""

from __future__ import annotations

import logging
import sys

from common.config import ConfigError, parse_cli
from common.interrupts import run_main
from common.objstore import StoreUnreachable
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
    from extract.ranks import Ranks
    from extract.summary import format_summary, no_samples_reason

    ranks = None
    try:
        ranks = Ranks.from_env()
        summaries = pipeline.run(cfg, ranks=ranks)
    except ValueError as err:  # user errors: config, corpus, target, resume refusals, a second writer, on_error=fail
        print(f"extract: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # full disk, I/O errors: the manifest still lists only complete shards
        if isinstance(err, StoreUnreachable):  # what the manifest listed cannot be read now; it stays
            after = "Shards committed before it stay in the dataset; rerun the same command to resume."
        elif ranks is not None and pipeline.has_committed_work(cfg, ranks):
            after = "Shards committed before it are intact; rerun the same command to resume."
        else:
            after = "Nothing had been committed yet; fix the cause and rerun."
        print(f"extract: I/O error, stopping: {err}. {after}", file=sys.stderr)
        return 4
    except KeyboardInterrupt:
        print(
            "extract: interrupted; shards committed before it are intact: rerun the same command to resume.",
            file=sys.stderr,
        )
        return 130
    if ranks.rank != 0:
        return 0
    for name, summary in summaries.items():
        print(("" if name is None else f"[{name}]\n") + format_summary(summary), flush=True)
    empty = [(name, summary) for name, summary in summaries.items() if summary["complete"] and not summary["samples"]]
    for name, summary in empty:
        print(f"extract: {'' if name is None else f'[{name}] '}{no_samples_reason(summary)}", file=sys.stderr)
    return 3 if empty else 0


if __name__ == "__main__":
    raise SystemExit(run_main("extract", main))
