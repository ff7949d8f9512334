"""The project's own commands run as child processes: one at a time (`run_child`), or side by side,
each writing its own log (`run_side_by_side`), for stages whose steps need only what earlier stages
wrote: the demo's offline evaluations and export, the tier comparison's trainings, evaluations and
decodings. Small models are bound by kernel launches and leave a GPU mostly idle, so several
processes share one well.

Each child runs in a process group of its own, and whatever stops the parent while children run (an
error, Ctrl-C or SIGTERM turned into an exception by `common.interrupts`) stops those groups first:
SIGTERM, then SIGKILL after `STOP_GRACE_S` (the stages resume after a kill). So no step keeps running
detached from a command that was stopped, and its own children (data loader workers, a launcher's
ranks) go with it. A parent killed outright (SIGKILL: nothing of it runs) takes its children along
on Linux, where each child asks the kernel for SIGKILL when its parent dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

STOP_GRACE_S = 10.0


@dataclasses.dataclass
class Finished:
    """One command's end: its exit status, wall time and log."""

    name: str
    command: str
    exit: int
    seconds: float
    log: str


def log_name(name: str) -> str:
    """A file name for a step's log: 'offline evaluation (humaneval)' -> 'offline_evaluation_humaneval.log'."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") + ".log"


def log_tail(path: str, lines: int = 60) -> str:
    """The last `lines` lines of a log as a terminal would have shown them (a progress bar's redraws,
    separated by carriage returns, leave only their last state)."""
    with open(path, errors="replace", newline="") as f:  # newline="": keep the carriage returns
        shown = [line.rsplit("\r", 1)[-1] for line in f.read().split("\n")]
    shown = [line for line in shown if line.strip()]
    return "\n".join((["..."] if len(shown) > lines else []) + shown[-lines:])


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _death_signal_setter() -> Callable[[], None] | None:
    """What a child runs before exec to be killed with its parent (Linux; None elsewhere), looked up
    here: between fork and exec the child should only make the call."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # the C library this interpreter is linked with
    # A group of its own is out of reach of a kill of the parent's group.
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start_child(args: Sequence[str], **popen) -> subprocess.Popen:
    """`python ARGS` with this interpreter, in a process group of its own (stopped by `stop_children`),
    killed with this process on Linux."""
    popen.setdefault("preexec_fn", _death_signal_setter())
    return subprocess.Popen([sys.executable, *args], process_group=0, **popen)


def stop_children(children: Sequence[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the process group of each child still running, SIGKILL to those left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        running = [c for c in children if c.poll() is None]
        for child in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, sig)
        deadline = time.monotonic() + (wait_s or 0)
        while wait_s and any(c.poll() is None for c in running) and time.monotonic() < deadline:
            time.sleep(0.05)
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=5)


def run_child(args: Sequence[str], env: dict[str, str] | None = None) -> int:
    """`python ARGS` to its end, its exit status; the child's group is stopped if this process is (an
    exception, Ctrl-C, SIGTERM through `common.interrupts`) before it ends."""
    child = start_child(args, env=env)
    try:
        return child.wait()
    except BaseException:
        stop_children([child])
        raise


def run_side_by_side(
    steps: Sequence[tuple[str, list[str]]],
    log_dir: str,
    *,
    max_running: int,
    env: dict[str, str] | None = None,
    on_success: Callable[[str], None] | None = None,
    show_tail: int = 60,
) -> list[Finished]:
    """Run `python ARGS` for every (name, ARGS) of `steps`, at most `max_running` at a time and in order,
    each with stdout and stderr in `log_dir`/NAME.log; print a line as each starts and its log's end as
    it ends (`show_tail` lines; 0: only the line). `on_success(name)` runs as soon as a step ends well
    (what makes it count as done for a resumed run), so a later failure or kill keeps it. After a
    failure no new step starts; those running finish. Returns every started step's end, in `steps`'
    order."""
    if max_running < 1:
        raise ValueError(f"max_running must be at least 1, got {max_running}")
    os.makedirs(log_dir, exist_ok=True)
    running: list = []
    try:
        return _side_by_side(steps, log_dir, max_running, env, on_success, show_tail, running)
    except BaseException:
        stop_children([entry[4] for entry in running])
        raise


def _side_by_side(steps, log_dir, max_running, env, on_success, show_tail, running: list) -> list[Finished]:
    pending, finished, failed = list(steps), {}, False
    while pending or running:
        while pending and not failed and len(running) < max_running:
            name, args = pending.pop(0)
            path = os.path.join(log_dir, log_name(name))
            command = "python " + " ".join(args)
            print(f"    started {name}: {command}  (log {path})", flush=True)
            log = open(path, "w")  # noqa: SIM115 (open while the child runs; closed when it ends)
            process = start_child(args, env=env, stdout=log, stderr=subprocess.STDOUT)
            running.append((name, command, path, log, process, time.time()))
        if failed:
            pending.clear()
        still = []
        for name, command, path, log, process, started in running:
            code = process.poll()
            if code is None:
                still.append((name, command, path, log, process, started))
                continue
            log.close()
            finished[name] = Finished(name, command, code, round(time.time() - started, 1), path)
            tail = f", the end of its log:\n{log_tail(path, show_tail)}" if show_tail else ""
            print(f"\n--- {name}: exit {code} after {finished[name].seconds:.1f} s{tail}", flush=True)
            if code != 0:
                failed = True
            elif on_success is not None:
                on_success(name)
        if len(still) == len(running) and still:
            time.sleep(0.2)
        running[:] = still
    return [finished[name] for name, _ in steps if name in finished]
