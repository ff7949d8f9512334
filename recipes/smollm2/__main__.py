"""`python -m recipes.smollm2 [key=value ...]` (`make smollm2`): fetch, check and convert the real target,
and write its prompt sets, unless they are built already; after an I/O error, rerunning the same
command finishes the build. Exit statuses: docs/ARCHITECTURE.md, "Exit status"."""

from __future__ import annotations

import sys

from common.config import ConfigError, parse_cli
from common.interrupts import run_main
from recipes.smollm2.build import build_smollm2, log
from recipes.smollm2.config import SmolConfig


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_cli(SmolConfig, sys.argv[1:] if argv is None else argv, section="smollm2")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        out = build_smollm2(cfg)
    except ValueError as exc:  # FetchError included: a download, a pinned file, a setting
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk, a folder that changed under the build: rerunning resumes
        print(f"error: I/O error, stopping: {exc}; rerunning the same command finishes the build", file=sys.stderr)
        return 4
    log(f"target:  {out / 'target'}")
    log(f"prompts: {out / 'prompts'} (train.jsonl, chat_heldout.jsonl, humaneval.jsonl)")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("smollm2", main, spawns=True, after="rerunning the same command finishes the build"))
