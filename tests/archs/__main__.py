"""`python -m tests.archs --table`: run the architecture matrix on every family the installed
transformers has and rewrite docs/architectures.md from its outcomes (about a minute on one core).
`python -m tests.archs NAME ...` runs the named families and prints their rows only."""

from __future__ import annotations

import sys

import torch

from tests.archs.families import ALL, by_name
from tests.archs.table import PAGE, render, run_matrix


def main(argv: list[str]) -> int:
    if argv == ["--table"]:
        PAGE.write_text(render(run_matrix([f for f in ALL if f.available])), encoding="utf-8")
        print(f"wrote {PAGE}")
        return 0
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    run_matrix([by_name(name) for name in argv])
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)  # as in the tests: the targets are tiny, and threads only wait on each other
    raise SystemExit(main(sys.argv[1:]))
