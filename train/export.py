"""`python -m train.export CHECKPOINT OUT_DIR [--dtype ...]`: the documented command, kept; the code
lives in `train.serve.export`. The options are read before torch loads (`--help` needs no torch).
"""

import sys

from train.serve.cli import export_parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    export_parser().parse_args(argv)  # --help and usage errors answer here
    from train.serve.export import main as export_main

    return export_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
