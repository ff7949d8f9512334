"""`python -m recipes.tiny [CONFIG] [key=value ...]` (`make tiny`): build the tiny default unless a
matching build is cached.
"""

from __future__ import annotations

import os
import sys

from common.config import ConfigError, parse_cli
from common.interrupts import run_main
from recipes.tiny.build import build_tiny
from recipes.tiny.compute import log
from recipes.tiny.config import TinyConfig
from recipes.tiny.regenerate import REGEN_FILES


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Spinning OpenMP threads waste most of the CPU when cores are shared: 100 training steps took
    # 78 s with the default wait policy against 20 s passive on 2 busy cores. Read when torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        cfg = parse_cli(TinyConfig, argv, section="tiny")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        out = build_tiny(cfg)
    except ValueError as exc:  # a damaged or missing shipped file: the message names it
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log(f"target:  {out / 'target'}  (report: {out / 'target' / 'tiny_report.json'})")
    log(f"corpus:  {out / 'corpus' / 'train.jsonl'}  {out / 'corpus' / 'heldout.jsonl'}  (real text)")
    log(f"         {out / REGEN_FILES['train']}  {out / REGEN_FILES['heldout']}  (target-regenerated answers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("tiny", main, spawns=True))
