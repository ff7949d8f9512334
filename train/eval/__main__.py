"""`python -m train.eval CHECKPOINT [CHECKPOINT2] --data SHARDS [--out PATH] [--config FILE] [key=value ...]`."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from common.config import ConfigError, describe, load_config
from train.eval.config import EvalConfig
from train.eval.render import render_report

_USAGE = """usage:
  python -m train.eval CHECKPOINT [CHECKPOINT2] --data SHARDS [--out PATH] [--config FILE] [key=value ...]

CHECKPOINT: a checkpoint directory (runs/NAME/checkpoints/step-XXXXXXXX) or a run directory (its
latest checkpoint). With two, both are evaluated on the same blocks and compared (ratio second/first).
--config FILE reads the [eval] table of a TOML/JSON file; key=value overrides it.

keys:
"""


def parse_args(argv: Sequence[str]) -> tuple[list[str], EvalConfig]:
    """(checkpoints, config) from the command line; ConfigError (a ValueError) on bad input."""
    argv = list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(_USAGE + describe(EvalConfig))
        raise SystemExit(0)
    checkpoints, overrides, values, config_file = [], [], {}, None
    flags = {"--data": "data", "--out": "out"}
    i = 0
    while i < len(argv):
        word = argv[i]
        flag, eq, inline = word.partition("=")
        if flag in flags or flag == "--config":
            if eq:
                value = inline
            elif i + 1 < len(argv):
                i += 1
                value = argv[i]
            else:
                raise ConfigError(f"{flag} needs a value")
            if flag == "--config":
                config_file = value
            else:
                values[flags[flag]] = value  # a path exactly as given, whatever characters it holds
        elif word.startswith("--"):
            raise ConfigError(
                f"unknown option '{word}' (options: --data, --out, --config; other settings as key=value)"
            )
        elif "=" in word and not os.path.exists(word):  # a checkpoint path may hold '='
            overrides.append(word)
        else:
            checkpoints.append(word)
        i += 1
    if not checkpoints:
        raise ConfigError("no checkpoint given (python -m train.eval CHECKPOINT --data SHARDS)")
    return checkpoints, load_config(EvalConfig, config_file, overrides, section="eval", values=values)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 done, 2 a usage, config or data error (the message names the key, file or field)."""
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
    sys.exit(main())
