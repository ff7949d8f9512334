"""Ctrl-C ends every stage command with one line and status 130, not a KeyboardInterrupt traceback
(issue 28); the line says that rerunning the same command resumes. Every command answers Ctrl-C
through one mechanism, and a command running steps stops their process groups on Ctrl-C or SIGTERM
(issue 54; the real drafter command: tests/reliability/signal_cases.py)."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.paths import REPO, child_pythonpath
from tests.reliability.cli import call_main


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("stage", ["extract", "regenerate", "train", "transcode"])
def test_ctrl_c_ends_with_one_line_and_status_130(stage, monkeypatch, tmp_path):
    if stage == "extract":
        from extract import pipeline
        from extract.__main__ import main
        from extract.ranks import Ranks

        monkeypatch.setattr(pipeline, "run", interrupt)
        monkeypatch.setattr(Ranks, "from_env", classmethod(lambda cls: cls()))
        args = [f"target={tmp_path}", f"corpus={tmp_path}", f"out_dir={tmp_path / 'out'}"]
    elif stage == "regenerate":
        from extract.regenerate import run as R
        from extract.regenerate.__main__ import main

        monkeypatch.setattr(R, "run", interrupt)
        args = [f"target={tmp_path}", f"corpus={tmp_path}", f"out={tmp_path / 'out'}"]
    elif stage == "train":
        import train.loop
        from train.__main__ import main

        monkeypatch.setattr(train.loop, "train", interrupt)
        args = [f"data.shards={tmp_path}", f"out_dir={tmp_path / 'runs'}"]
    else:
        import shards.__main__ as cli

        monkeypatch.setattr(cli, "transcode", interrupt)
        main, args = cli.main, ["transcode", str(tmp_path / "a"), str(tmp_path / "b"), "encoding=fp8"]
    code, stderr = call_main(main, args)
    assert code == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    lines = [line for line in stderr.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and "rerun" in lines[0].lower(), stderr


def entry_points() -> list[Path]:
    """Every module of the tree that runs as a command (`if __name__ == "__main__":`)."""
    roots = ("common", "shards", "extract", "train", "recipes", "benchmarks")
    return sorted(
        p for root in roots for p in (REPO / root).rglob("*.py") if 'if __name__ == "__main__":' in p.read_text()
    )


def test_every_command_answers_ctrl_c_through_run_main():
    """One mechanism for every command (issue 54): its `__main__` block is `raise SystemExit(run_main(...))`;
    the GPU suites' deadline keeps its own handler (it forwards SIGTERM to the suite it times)."""
    wrong = []
    for path in entry_points():
        guard = ast.parse(path.read_text()).body[-1]
        call = guard.body[-1].exc if isinstance(guard, ast.If) and isinstance(guard.body[-1], ast.Raise) else None
        called = getattr(getattr(call, "args", [None])[0], "func", None) if isinstance(call, ast.Call) else None
        if getattr(called, "id", None) != "run_main" and path.name != "deadline.py":
            wrong.append(str(path.relative_to(REPO)))
    assert len(entry_points()) > 30 and not wrong, wrong


PARENT = """
import sys
from common.interrupts import run_main
from common.processes import run_child, run_side_by_side
side_by_side = sys.argv[1] == "side"
step = ["-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "print('ready', flush=True); time.sleep(120)"]
def main():
    if side_by_side:
        run_side_by_side([("a", step), ("b", step)], sys.argv[2], max_running=2, show_tail=0)
    else:
        run_child(step)
sys.exit(run_main("parent", main, spawns=True, after="rerunning resumes"))
"""


def _descendants(pid: int) -> list[int]:
    from tests.reliability.signal_cases import children_of

    found, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        found += kids
        todo += kids
    return found


@pytest.mark.parametrize("how", ["one", "side"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_parent_stops_its_steps_and_their_children_with_one_line(tmp_path, how, sig):
    """SIGTERM (or Ctrl-C) to a command running steps: each step's whole process group goes (a step's own
    child too), the command says so in one line and exits 128 + the signal."""
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT, how, str(tmp_path / "logs")],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": child_pythonpath()},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    steps = 2 if how == "side" else 1
    deadline = time.monotonic() + 60
    while len(_descendants(proc.pid)) < 2 * steps and time.monotonic() < deadline:  # each step and its child
        time.sleep(0.05)
    below = _descendants(proc.pid)
    assert len(below) == 2 * steps, proc.poll()
    (os.killpg if sig == signal.SIGINT else os.kill)(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert err.strip().splitlines() == [
        f"parent: {'interrupted (Ctrl-C)' if sig == signal.SIGINT else 'stopped by SIGTERM'}; rerunning resumes"
    ]
    time.sleep(0.2)
    assert not [p for p in below if os.path.exists(f"/proc/{p}") and "sleep" in Path(f"/proc/{p}/cmdline").read_text()]
