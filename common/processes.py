"""The project's own commands run as child processes side by side, each writing its own log
(`run_side_by_side`), for stages whose steps need only what earlier stages wrote: the demo's offline
evaluations and export, the tier comparison's trainings, evaluations and decodings. Small models
are bound by kernel launches and leave a GPU mostly idle, so several processes share one well.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence


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
    pending, running, finished, failed = list(steps), [], {}, False
    while pending or running:
        while pending and not failed and len(running) < max_running:
            name, args = pending.pop(0)
            path = os.path.join(log_dir, log_name(name))
            command = "python " + " ".join(args)
            print(f"    started {name}: {command}  (log {path})", flush=True)
            log = open(path, "w")
            process = subprocess.Popen([sys.executable, *args], env=env, stdout=log, stderr=subprocess.STDOUT)
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
        running = still
    return [finished[name] for name, _ in steps if name in finished]
