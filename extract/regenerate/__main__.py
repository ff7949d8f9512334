"""`python -m extract.regenerate [CONFIG] key=value ...`: answer a corpus again with the target.

    python -m extract.regenerate configs/qwen3.6-27b.toml corpus=prompts.jsonl out=data/regen \\
        backend=server 'urls=["http://127.0.0.1:8000/v1"]'          # vLLM / SGLang / transformers serve
    python -m extract.regenerate configs/tiny.toml corpus=x.jsonl out=/tmp/r backend=local
    torchrun --nproc-per-node 8 -m extract.regenerate CONFIG backend=local ...   # a share per GPU
    python -m extract.regenerate --help                              # every key with its help

Reads the `[regenerate]` table of CONFIG (extract/regenerate/config.py). Rerunning the same command
resumes: finished records are skipped. A run that stops unfinished (an I/O error, a server that
refused every request or went away: 401/403/404, or `max_consecutive_failures` records in a row;
records that failed every retry; Ctrl-C) keeps what was finished in the journal; rerun the same
command to finish the rest. Exit statuses: docs/ARCHITECTURE.md, "Exit status".
"""

from __future__ import annotations

import logging
import sys

from common.config import ConfigError, parse_cli
from common.interrupts import run_main
from extract.regenerate.config import RegenerateConfig


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_cli(RegenerateConfig, argv, section="regenerate")
    except ConfigError as err:
        print(f"regenerate: {err}", file=sys.stderr)
        return 2
    from extract.regenerate import run as R

    try:
        summary = R.run(cfg)
    except ValueError as err:
        print(f"regenerate: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(
            f"regenerate: I/O error, stopping: {err}. Finished records are in the journal; rerun the same command "
            "to resume.",
            file=sys.stderr,
        )
        return 4
    except KeyboardInterrupt:
        print(
            "regenerate: interrupted; finished records are in the journal: rerun the same command to resume.",
            file=sys.stderr,
        )
        return 130
    if summary.get("rank", 0) != 0:
        return 0 if summary.get("stopped") is None and not summary["counts"]["failed"] else 4
    print(R.format_summary(summary), flush=True)
    if summary.get("stopped") or not summary.get("complete"):
        print("regenerate: not finished; rerun the same command to finish the rest", file=sys.stderr)
        return 4
    counts = summary["counts"] if summary.get("already_complete") else summary["corpus_counts"]
    if counts["stored"] == 0:
        reasons = (
            ", ".join(f"{k} {v}" for k, v in sorted(counts.get("rejected_by_reason", {}).items()))
            or "the corpus holds no records"
        )
        print(f"regenerate: no record could be stored ({reasons}); see {cfg.out}/rejects.jsonl", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("regenerate", main))
