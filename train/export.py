"""`python -m train.export CHECKPOINT OUT_DIR [key=value | --key value ...]`: the documented command, kept; the code
lives in `train.serve.export`. The options are read before torch loads (`--help` needs no torch).
"""

import sys

from common.config import ConfigError
from train.serve.cli import parse_export_args, usage_error


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:  # --help and usage errors answer here, before torch loads
        parse_export_args(argv)
    except ConfigError as exc:
        return usage_error("train.export", exc)
    from train.serve.export import main as export_main

    return export_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
