"""`python -m benchmarks.suites.deadline SECONDS -- ARGS...`: run `python ARGS` in its own process group and stop
it, with everything it started, after SECONDS (SIGTERM, then SIGKILL 10 s later); exit status 124 then, as
coreutils' `timeout` gives. A SIGTERM to this process reaches the group too. Standard library only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

TIMED_OUT = 124


def stop(child: subprocess.Popen) -> None:
    """SIGTERM to the child's group, SIGKILL if it is still there 10 s later."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m benchmarks.suites.deadline SECONDS -- ARGS...", file=sys.stderr)
        return 2
    seconds = float(argv[0])
    child = subprocess.Popen([sys.executable, *argv[2:]], start_new_session=True)
    signal.signal(signal.SIGTERM, lambda *_: (stop(child), sys.exit(143)))
    try:
        return child.wait(timeout=max(seconds, 0.1))
    except subprocess.TimeoutExpired:
        print(
            f"deadline: stopped after {seconds:.0f} s (the suite's budget for this step)", file=sys.stderr, flush=True
        )
        stop(child)
        return TIMED_OUT


if __name__ == "__main__":
    raise SystemExit(main())
