"""Scenario 5's signal family (issue 54): commands stopped by the signals users and schedulers send,
each in real processes.

- drafter: `python -m recipes.drafter` (what `make drafter` runs) gets SIGTERM (as `make` forwards it,
  or a scheduler sends it) or Ctrl-C (SIGINT to its process group, as a terminal sends it) while its
  first step's process runs. It must exit 128 + the signal with one line on stderr that says so and
  that rerunning resumes, no traceback, and the step's process and everything in its process group
  must be gone; the same command again must resume that step ("resuming where it stopped").
- ctrl_c: each stage command given Ctrl-C while it loads torch (seen in /proc/PID/maps): exit 130,
  one line, no traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.reliability.late_checks import chat_prompts
from tests.reliability.world import REPO, World, child_env

STEP_MODULE = "extract.regenerate"


def start(args: list[str], work: Path, name: str) -> tuple[subprocess.Popen, Path, Path]:
    """`python ARGS` in a session of its own (a signal to its group reaches it as a terminal's would, and
    never this process); its stdout and stderr in files."""
    out, err = work / f"{name}.out", work / f"{name}.err"
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=child_env(),
        stdout=out.open("w"),
        stderr=err.open("w"),
        start_new_session=True,
    )
    return proc, out, err


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_for(condition, proc: subprocess.Popen, timeout: float) -> bool:
    """True once `condition()` holds; False if `proc` ended or `timeout` passed first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    return False


def stop(proc: subprocess.Popen) -> None:
    """End a case's processes whatever happened (the test's own clean-up)."""
    for pid in [proc.pid, *children_of(proc.pid)]:
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)
    proc.wait()


def one_line(stderr: str, label: str, code: int, status: int, says: tuple[str, ...]) -> list[str]:
    """What keeps a stopped command's answer from being one line and its status."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    problems = [] if code == status else [f"exit {code}, not {status}"]
    if "Traceback" in stderr or "KeyboardInterrupt" in stderr:
        problems.append(f"a traceback reached the user: ...{stderr.strip()[-400:]}")
    if not last.startswith(f"{label}: ") or not all(word in last for word in says):
        problems.append(f"the last line is not {label}'s one line saying {says}: {last[:300]!r}")
    return problems


def drafter_args(world: World, out: Path) -> list[str]:
    prompts = out.parent / "drafter-prompts.jsonl"
    if not prompts.exists():
        chat_prompts(world, prompts, 24)
    return [
        "-m",
        "recipes.drafter",
        f"target={world.target_dir}",
        f"prompts={prompts}",
        f"out={out}",
        "scale=smoke",
        "device=cpu",
    ]


def stop_drafter(world: World, work: Path, sig: int, name: str, *, resumed: bool = False) -> list[str]:
    """Start the drafter command, `sig` it while its step's process runs; what went wrong."""
    out = work / "drafter-out"
    proc, stdout, stderr = start(drafter_args(world, out), work, name)
    try:
        running = lambda: [p for p in children_of(proc.pid) if STEP_MODULE in cmdline(p)]  # noqa: E731
        said = lambda: not resumed or "resuming where it stopped" in stdout.read_text()  # noqa: E731
        if not wait_for(lambda: running() and said(), proc, timeout=300):
            return [f"no step process came up (exit {proc.poll()}): {stderr.read_text()[-600:]}"]
        step = running()[0]
        step_group = os.getpgid(step)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # a terminal's Ctrl-C: the foreground process group
        else:
            os.kill(proc.pid, sig)  # make forwards SIGTERM to its child, the command, alone
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            return [f"still running 60 s after {signal.Signals(sig).name}"]
        time.sleep(0.2)
        text = stderr.read_text()
        says = ("interrupted" if sig == signal.SIGINT else "stopped", "rerun")
        problems = one_line(text, "drafter", code, 128 + sig, says)
        if os.path.exists(f"/proc/{step}") and STEP_MODULE in cmdline(step):
            problems.append(f"the step's process {step} still runs after the command stopped")
        if group_alive(step_group):
            problems.append(f"processes of the step's process group {step_group} still run")
        if resumed and "resuming where it stopped" not in stdout.read_text():
            problems.append("the rerun did not resume the stopped step")
        return problems
    finally:
        stop(proc)


def drafter_cases(world: World, tally, work: Path) -> None:
    """SIGTERM while step 1 runs, then the same command again (it must resume the step) stopped by Ctrl-C."""
    work.mkdir(parents=True, exist_ok=True)
    problems = stop_drafter(world, work, signal.SIGTERM, "drafter-term")
    tally.add("signals:drafter SIGTERM", not problems, f"SIGTERM to the drafter command: {'; '.join(problems)}")
    problems = stop_drafter(world, work, signal.SIGINT, "drafter-int", resumed=True)
    tally.add("signals:drafter Ctrl-C, rerun", not problems, f"Ctrl-C to its rerun: {'; '.join(problems)}")


def stage_commands(world: World, work: Path) -> dict[str, tuple[str, list[str]]]:
    """{name: (the label its line starts with, python arguments that reach the loading of torch)}."""
    missing = str(work / "missing")
    return {
        "extract": ("extract", ["-m", "extract", str(world.extract_config(work / "x-out"))]),
        "regenerate": (
            "regenerate",
            [
                "-m",
                "extract.regenerate",
                f"target={world.target_dir}",
                f"corpus={world.corpus}",
                f"out={work / 'r-out'}",
                "backend=local",
            ],
        ),
        "train": ("train", ["-m", "train", *world.train_args(work / "runs", "ctrl-c")]),
        "eval": ("eval", ["-m", "train.eval", missing, "--data", str(world.baseline)]),
        "export": ("export", ["-m", "train.serve.export", missing, str(work / "export")]),
        "specdecode": (
            "specdecode",
            ["-m", "train.serve.specdecode", "--target", str(world.target_dir), "--drafter", missing],
        ),
    }


def torch_loading(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def ctrl_c_at_start(world: World, tally, work: Path, names: list[str] | None = None) -> None:
    """Each stage command given Ctrl-C while torch loads: exit 130, one line, no traceback."""
    work.mkdir(parents=True, exist_ok=True)
    for name, (label, args) in stage_commands(world, work).items():
        if names is not None and name not in names:
            continue
        proc, _, stderr = start(args, work, f"ctrl-c-{name}")
        try:
            if not wait_for(lambda proc=proc: torch_loading(proc.pid), proc, timeout=120):
                problems = [f"never loaded torch (exit {proc.poll()}): {stderr.read_text()[-300:]}"]
            else:
                os.killpg(proc.pid, signal.SIGINT)
                code = proc.wait(timeout=60)
                problems = one_line(stderr.read_text(), label, code, 130, ("interrupted",))
        except subprocess.TimeoutExpired:
            problems = ["still running 60 s after Ctrl-C"]
        finally:
            stop(proc)
        tally.add(f"signals:Ctrl-C {name}", not problems, f"Ctrl-C while {name} loads torch: {'; '.join(problems)}")


def run_all(world: World, tally, work: Path, full: bool = True) -> None:
    drafter_cases(world, tally, work / "drafter")
    ctrl_c_at_start(world, tally, work / "ctrl-c", None if full else ["extract", "eval"])
