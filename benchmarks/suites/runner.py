"""How a suite's parts run: each stage's commands side by side as child processes (`common.processes`), each
under the deadline the part has left (`benchmarks.suites.deadline`), their logs gathered into the suite's one log.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import TextIO

from benchmarks.suites.deadline import TIMED_OUT
from benchmarks.suites.plan import Stage
from common.processes import log_tail, run_side_by_side

LOG_LINES = 3000  # of each step's log in the suite's log (progress bars collapsed): the log must come back whole


@dataclasses.dataclass
class Context:
    """What a part's commands and collector need to know."""

    suite: str
    scale: str  # "gpu" (one H100 or H200, the budget of one device command) or "smoke" (a CPU, seconds)
    out: Path  # the output folder: the record and the log, nothing else (the device host returns 8 files)
    work: Path  # scratch: the parts' own outputs and logs
    wheels: Path  # the carried wheels; the SmolLM2 build reads its pinned data wheels from here too
    options: dict[str, str]  # key=value words of the command line, for the suite
    log: SuiteLog
    state: dict = dataclasses.field(default_factory=dict)  # what a part leaves for later parts
    env: dict = dataclasses.field(default_factory=lambda: dict(os.environ))
    allowed_s: float = 0.0  # the seconds the part now running may take (its commands' deadline)

    def path(self, name: str) -> str:
        return str(self.work / name)


class SuiteLog:
    """The suite's one log: what it prints, and the end of every step's own log as the step ends."""

    def __init__(self, path: Path):
        self.file: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the suite's life; close())

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.file.write(text + "\n")
        self.file.flush()

    def add_step(self, name: str, path: str) -> None:
        self.file.write(f"\n----- {name} ({path})\n{log_tail(path, LOG_LINES)}\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def run_stages(ctx: Context, part: str, stages: list[Stage], seconds: float, jobs: int = 0) -> dict:
    """Run `stages` in order, each stage's commands side by side (`jobs` at a time; 0: all), all within
    `seconds`; stop at the first failure. Returns {"status": "ok" | "timed out" | "failed: ...", "seconds",
    "steps": [...]}."""
    started = time.monotonic()
    steps: list[dict] = []
    status = "ok"
    for stage in stages:
        left = seconds - (time.monotonic() - started)
        if left < 1:
            status = "timed out"
            break
        commands = {f"{part}: {name}": argv for name, argv in stage}
        wrapped = [
            (name, ["-m", "benchmarks.suites.deadline", f"{left:.0f}", "--", *a]) for name, a in commands.items()
        ]
        ended = run_side_by_side(
            wrapped, str(ctx.work / "logs"), max_running=jobs or len(wrapped), env=ctx.env, show_tail=0
        )
        for e in ended:
            steps.append(
                {
                    "name": e.name,
                    "command": "python " + " ".join(commands[e.name]),
                    "exit": e.exit,
                    "seconds": e.seconds,
                }
            )
            ctx.log.add_step(e.name, e.log)
        failed = [e for e in ended if e.exit != 0]
        if failed:
            first = failed[0]
            status = "timed out" if first.exit == TIMED_OUT else f"failed: {first.name} exit {first.exit}"
            break
    return {"status": status, "seconds": round(time.monotonic() - started, 1), "steps": steps}
