"""`python -m train.specdecode --target DIR --drafter DIR [...]`: the documented command, kept; the
code lives in `train.serve.specdecode_run`. The options are read before torch loads (`--help` needs no torch).
"""

import sys

from common.config import ConfigError
from train.serve.cli import parse_specdecode_args, usage_error


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:  # --help and usage errors answer here, before torch loads
        parse_specdecode_args(argv)
    except ConfigError as exc:
        return usage_error("train.specdecode", exc)
    from train.serve.specdecode_run import main as specdecode_main

    return specdecode_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
