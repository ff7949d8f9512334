"""Ctrl-C and SIGTERM, answered the same way by every command: one line naming how it was stopped,
the documented exit status (128 + the signal: 130 for Ctrl-C, 143 for SIGTERM, 129 for a hang-up),
no traceback.

Every entry point ends in `sys.exit(run_main(LABEL, main))`: a KeyboardInterrupt from anywhere in
`main` (a stage may catch it first to say what a rerun resumes) becomes that line and status. The
commands that start other commands as children (the drafter command, the demo, the tier comparison,
the data ladder: `common.processes`) also take SIGTERM and SIGHUP (`spawns=True`): each signal
becomes `Stopped`, a KeyboardInterrupt, so the `finally` blocks run and stop the children's
process groups before the line is printed; a second signal while it stops is ignored. The stage
commands keep SIGTERM's default (the process ends at once; every stage resumes after a kill).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

SIGNAL_NAMES: dict[int, str] = {
    signal.SIGINT: "interrupted (Ctrl-C)",
    signal.SIGTERM: "stopped by SIGTERM",
    signal.SIGHUP: "hung up",
}


class Stopped(KeyboardInterrupt):
    """A stop signal turned into an exception, so that every `finally` runs (children stopped, locks released)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, frame) -> None:  # noqa: ARG001 (a signal handler's signature)
    # The first signal stops the command; those that follow (Ctrl-C pressed twice, SIGTERM after
    # SIGINT) must not interrupt the stopping of the children.
    for sig in SIGNAL_NAMES:
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


def handle_stop_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP raise `Stopped` in the main thread (a no-op elsewhere)."""
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNAL_NAMES:
            signal.signal(sig, _stop)


def signal_of(exc: KeyboardInterrupt) -> int:
    return getattr(exc, "signum", signal.SIGINT)


def exit_status(exc: KeyboardInterrupt) -> int:
    """128 + the signal that stopped the command (130 for a plain KeyboardInterrupt: Ctrl-C)."""
    return 128 + int(signal_of(exc))


def how(exc: KeyboardInterrupt) -> str:
    """'interrupted (Ctrl-C)', 'stopped by SIGTERM' or 'hung up'."""
    return SIGNAL_NAMES.get(signal_of(exc), f"stopped by signal {signal_of(exc)}")


def run_main(label: str, main: Callable[[], int | None], *, spawns: bool = False, after: str = "") -> int:
    """`main()`'s exit status; stopped by a signal: one line on stderr ("LABEL: stopped by SIGTERM; AFTER")
    and 128 + the signal. `spawns`: also take SIGTERM and SIGHUP (commands that start children)."""
    if spawns:
        handle_stop_signals()
    try:
        code = main()
    except KeyboardInterrupt as exc:
        print(f"{label}: {how(exc)}" + (f"; {after}" if after else ""), file=sys.stderr, flush=True)
        return exit_status(exc)
    return code if isinstance(code, int) else 0
