"""`python -m recipes.smollm2 [key=value ...]` (`make smollm2`): fetch, check and convert the real target,
and write its prompt sets, unless they are built already."""

from __future__ import annotations

import sys

from common.config import ConfigError, parse_cli
from recipes.smollm2.build import build_smollm2, log
from recipes.smollm2.config import SmolConfig
from recipes.smollm2.pins import FetchError


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_cli(SmolConfig, sys.argv[1:] if argv is None else argv, section="smollm2")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        out = build_smollm2(cfg)
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log(f"target:  {out / 'target'}")
    log(f"prompts: {out / 'prompts'} (train.jsonl, chat_heldout.jsonl, humaneval.jsonl)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
