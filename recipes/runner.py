"""The one step runner of every recipe (`make drafter`, `make demo`, `make tiers`, the data ladder):
every step is a stage's own command (`python -m extract ...`), run with this interpreter as a child
process (or in this process, `in_process`), in order, with its time printed as it ends; a failing
step stops the command naming it. A recipe plans its steps as groups of `Stage`s (each group needs
only what earlier groups wrote) and hands them to a `Runner`.

Resumable: a ledger (`stages.json` beside the outputs) records each step's command, the digests of
what it read (its input files by content, the records of the steps it needs, the target directory's
`target.identity.directory_digest`, its table of the config file) and, once it succeeded, the
digests of its records (the files it writes last: `regenerate.json`, `manifest.json`, the final
checkpoint's `state.json`, the export's files, the result JSON). A step is then

  skipped   when its records are there, complete and unchanged, and its command and inputs are the
            ones recorded: its output is what this command would make now;
  resumed   when it started with the same command and inputs but did not finish (run again as is:
            every stage continues where it stopped);
  redone    when its command or inputs changed, or its output was changed since: its outputs are
            removed first (a stage refuses to continue a dataset or run of other settings);
  run       when the ledger knows nothing of it (a stage whose output is there finds it done
            itself, or refuses other settings by name).

A changed setting thus reruns its own step and every step whose inputs changed with it, and no other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence

import xxhash

from common.io import atomic_write_text
from common.processes import run_child, run_side_by_side

_CHECKPOINT = re.compile(r"^step-(\d+)$")


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step: `python -m MODULE ARGS`, what marks it done, and what it depends on."""

    name: str
    module: str
    args: tuple[str, ...]
    records: tuple[str, ...] = ()  # files written last; complete = all there (a JSON's "complete" key true)
    clear: tuple[str, ...] = ()  # removed before it is redone with other settings
    needs: tuple[str, ...] = ()  # steps whose output it reads
    reads: tuple[str, ...] = ()  # files it reads besides those
    digests: tuple[tuple[str, str], ...] = ()  # (what, digest) of other inputs: the target directory, a config table
    training_run: str = ""  # a training run directory: done when its final checkpoint is there (never before)

    @property
    def argv(self) -> list[str]:
        return ["-m", self.module, *self.args]


def file_digest(path: str) -> str:
    """xxh3-128 of a file's bytes."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def final_checkpoint(run_dir: str) -> str | None:
    """The state.json of a training run's final checkpoint (step = the run's total_steps, run.json),
    or None: the trainer writes it last, so a run killed after an earlier checkpoint is not done."""
    try:
        with open(os.path.join(run_dir, "run.json")) as f:
            total = int(json.load(f)["total_steps"])
        names = os.listdir(os.path.join(run_dir, "checkpoints"))
    except (OSError, KeyError, ValueError, json.JSONDecodeError):
        return None
    steps = [int(m.group(1)) for m in map(_CHECKPOINT.match, names) if m]
    state = os.path.join(run_dir, "checkpoints", f"step-{max(steps, default=-1):08d}", "state.json")
    return state if steps and max(steps) >= total and os.path.isfile(state) else None


def _complete(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    if not path.endswith(".json"):
        return True
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False
    return not isinstance(data, dict) or data.get("complete", True) is True


def done_records(stage: Stage) -> dict[str, str] | None:
    """{record file: digest} when the step's output is complete, else None."""
    paths = list(stage.records)
    if stage.training_run:
        state = final_checkpoint(stage.training_run)
        if state is None:
            return None
        paths.append(state)
    if not all(_complete(p) for p in paths):
        return None
    return {p: file_digest(p) for p in paths}


class Ledger:
    """stages.json: per step, its command, its inputs' digests, its state and its records' digests."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path) as f:
                self.entries = json.load(f)
        except (OSError, json.JSONDecodeError):
            self.entries = {}

    def inputs(self, stage: Stage) -> dict:
        ups = {name: (self.entries.get(name) or {}).get("records") for name in stage.needs}
        files = {p: file_digest(p) if os.path.isfile(p) else None for p in stage.reads}
        return {"steps": ups, "files": files, "digests": dict(stage.digests)}

    def decide(self, stage: Stage) -> tuple[str, dict | None]:
        """('skip' | 'resume' | 'redo' | 'run', the records when complete)."""
        entry, records = self.entries.get(stage.name), done_records(stage)
        if entry is None:
            return "run", records
        now, recorded = self.inputs(stage), entry.get("inputs") or {}
        if "digests" not in recorded:  # a ledger written before the digests existed: compared without them
            now.pop("digests")
        same = entry.get("args") == stage.argv and recorded == now
        if same and records is not None and entry.get("state") == "done" and entry.get("records") == records:
            return "skip", records
        if same and records is None:
            return "resume", None
        return "redo", records

    def mark(self, stage: Stage, state: str, records: dict | None = None) -> None:
        self.entries[stage.name] = {
            "args": stage.argv,
            "inputs": self.inputs(stage),
            "state": state,
            "records": records,
        }
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.entries, indent=1) + "\n")


def run_in_process(argv: Sequence[str]) -> int:
    """`python -m MODULE ARGS` in this process: the command's `main(ARGS)` (every stage's entry point
    has one), its exit status returned (also one it raises as SystemExit)."""
    name, args = argv[1], list(argv[2:])
    spec = importlib.util.find_spec(name)
    entry = importlib.import_module(f"{name}.__main__" if spec and spec.submodule_search_locations else name)
    try:
        code = entry.main(args)
    except SystemExit as exc:
        code = exc.code
    return code if isinstance(code, int) else (0 if code is None else 1)


def step(
    timings: dict[str, float],
    name: str,
    args: list[str],
    env: dict[str, str] | None = None,
    *,
    label: str = "demo",
    in_process: bool = False,
    position: str = "",
) -> None:
    """Run one step; record and print its time as it ends (also when it fails, which stops the command).
    `position` ("[3/8] ") leads its first line."""
    print(f"\n=== {position}{name}: python {' '.join(args)}", flush=True)
    start = time.time()
    code = run_in_process(args) if in_process else run_child(args, env)
    timings[name] = time.time() - start
    # Said as each step ends, so a run cut short (a lost machine, a time limit) still shows where the time went.
    print(f"=== {name}: {timings[name]:.1f} s ({label} so far {sum(timings.values()):.1f} s)", flush=True)
    if code != 0:
        raise SystemExit(f"{label}: step '{name}' failed (exit {code}); its output is above")


def steps_together(
    timings: dict[str, float],
    group: list[tuple[str, list[str]]],
    env: dict[str, str] | None,
    log_dir: str,
    *,
    label: str = "demo",
    on_success: Callable[[str], None] | None = None,
    max_running: int = 0,
    show_tail: int = 60,
) -> None:
    """The steps of `group` as processes side by side (`max_running` at a time, 0: all), each writing
    to its own log in `log_dir` (their progress bars would interleave), its end printed as it ends with
    its log's last `show_tail` lines (`on_success(name)` as soon as a step ends well). The group's wall
    time is recorded under the steps' names joined by ' + ', so the command's total stays the sum of
    its timings."""
    name = " + ".join(n for n, _ in group)
    print(f"\n=== {name}, side by side (logs in {log_dir}/)", flush=True)
    start = time.time()
    at_once = max_running or len(group)
    ended = run_side_by_side(group, log_dir, max_running=at_once, env=env, on_success=on_success, show_tail=show_tail)
    timings[name] = time.time() - start
    print(f"=== {name}: {timings[name]:.1f} s ({label} so far {sum(timings.values()):.1f} s)", flush=True)
    failed = [f"'{e.name}' (exit {e.exit}, log {e.log})" for e in ended if e.exit != 0]
    if failed:
        raise SystemExit(f"{label}: step {', '.join(failed)} failed; its log's end is above")


@dataclasses.dataclass
class Runner:
    """Runs groups of steps in order against a ledger. A group of several steps runs side by side
    when `side_by_side` (a GPU: small launch-bound processes share it; `max_running` at a time, 0:
    the whole group, each ending with its log's last `show_tail` lines), else one after another."""

    ledger: Ledger
    env: dict[str, str] | None = None
    label: str = "drafter"
    in_process: bool = False
    side_by_side: bool = False
    log_dir: str = "logs"
    max_running: int = 0
    show_tail: int = 60
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    status: dict[str, str] = dataclasses.field(default_factory=dict)

    def run(self, groups: list[list[Stage]], stop_after: str = "") -> bool:
        """Every group in order; False when it stopped after the step named `stop_after`."""
        total, index = sum(len(g) for g in groups), 0
        for group in groups:
            todo = []
            for s in group:
                index += 1
                if self._prepare(s, f"[{index}/{total}] "):
                    todo.append((s, f"[{index}/{total}] "))
            if len(todo) > 1 and self.side_by_side and not self.in_process:
                by_name = {s.name: s for s, _ in todo}
                steps = [(s.name, s.argv) for s, _ in todo]
                finished = lambda name, by_name=by_name: self._finished(by_name[name])  # noqa: E731
                at_once = {"max_running": self.max_running, "show_tail": self.show_tail}
                steps_together(
                    self.timings, steps, self.env, self.log_dir, label=self.label, on_success=finished, **at_once
                )
            else:
                for s, position in todo:
                    kwargs = {"label": self.label, "in_process": self.in_process, "position": position}
                    step(self.timings, s.name, s.argv, self.env, **kwargs)
                    self._finished(s)
            if stop_after and group[-1].name == stop_after:
                return False
        return True

    def seconds(self, name: str) -> float:
        """A step's time; steps run side by side share their group's (recorded as 'a + b + c')."""
        return round(next((t for key, t in self.timings.items() if name in key.split(" + ")), 0.0), 1)

    def summary(self) -> dict[str, dict]:
        """{step: {"status": ran | skipped | resumed | redone, "seconds": s}}, in the order they came."""
        return {name: {"status": status, "seconds": self.seconds(name)} for name, status in self.status.items()}

    def _prepare(self, stage: Stage, position: str) -> bool:
        """Decide the step; say a skip, resume or redo; clear what a redo replaces. True when it must run."""
        decision, records = self.ledger.decide(stage)
        self.status[stage.name] = {"skip": "skipped", "resume": "resumed", "redo": "redone", "run": "ran"}[decision]
        if decision == "skip":
            where = ", ".join(stage.records) or stage.training_run
            print(f"\n=== {position}{stage.name}: done with the same command and inputs, skipped ({where})", flush=True)
            self.ledger.mark(stage, "done", records)
            return False
        if decision != "run":
            why = "resuming where it stopped" if decision == "resume" else "its settings or inputs changed: redoing it"
            print(f"\n=== {position}{stage.name}: {why}", flush=True)
        if decision == "redo":
            for path in stage.clear:
                _remove(path)
        self.ledger.mark(stage, "started")
        return True

    def _finished(self, stage: Stage) -> None:
        records = done_records(stage)
        if records is None and (stage.records or stage.training_run):
            print(f"{self.label}: '{stage.name}' ended well but its output is not complete; it runs again next time")
        self.ledger.mark(stage, "done" if records is not None else "started", records)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
