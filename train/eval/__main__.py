"""`python -m train.eval CHECKPOINT [CHECKPOINT2] --data SHARDS [--out PATH] [--config FILE] [key=value ...]`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from common.config import ConfigError, parse_command
from common.interrupts import run_main
from train.eval.config import EvalConfig
from train.eval.render import render_report

_USAGE = """usage:
  python -m train.eval CHECKPOINT [CHECKPOINT2] --data SHARDS [--out PATH] [--config FILE] [key=value ...]

CHECKPOINT: a checkpoint directory (runs/NAME/checkpoints/step-XXXXXXXX) or a run directory (its
latest checkpoint). With two, both are evaluated on the same blocks and compared (ratio second/first).
--config FILE (or a first argument CONFIG.toml) reads the [eval] table of a TOML/JSON file; key=value
or --key value overrides it."""


def parse_args(argv: Sequence[str]) -> tuple[list[str], EvalConfig]:
    """(checkpoints, config) from the command line (the grammar of every entry point,
    `common.config.parse_command`); ConfigError (a ValueError) on bad input."""
    cfg, checkpoints = parse_command(EvalConfig, argv, section="eval", rest=True, usage=_USAGE)
    if not checkpoints:
        raise ConfigError("no checkpoint given (python -m train.eval CHECKPOINT --data SHARDS)")
    return checkpoints, cfg


def main(argv: Sequence[str] | None = None) -> int:
    """Evaluate; returns the exit status (docs/ARCHITECTURE.md, "Exit status")."""
    try:
        checkpoints, cfg = parse_args(sys.argv[1:] if argv is None else argv)
        from train.eval.run import evaluate_checkpoints  # torch loads here, after --help and the checks

        report, out = evaluate_checkpoints(checkpoints, cfg)
    except ValueError as exc:
        print(f"eval: {exc}", file=sys.stderr)
        return 2
    print(render_report(report))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("eval", main))
