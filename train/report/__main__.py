"""`python -m train.report RUN_DIR [RUN_DIR ...] [key=value ...]`: the training-health report of runs."""

from __future__ import annotations

import shlex
import sys

from common.interrupts import run_main
from train.report.config import parse_report_args
from train.report.make import make_report, newest_run


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        run_words, cfg = parse_report_args(argv)
        if not run_words:
            run_words = [newest_run()]
            print(f"no run given: reporting the newest one, {run_words[0]}")
        report = make_report(run_words, cfg, command="python -m train.report " + shlex.join(argv))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.summary)
    print(
        f"\nwrote {report.out_dir / 'report.md'}"
        + (f" and {len(report.plots)} plot(s): {', '.join(report.plots.values())}" if report.plots else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("report", main))
