"""How a suite runs its parts (benchmarks.suites.runner, .deadline): a stage's commands side by side, a deadline
that stops a command with everything it started, a failure that stops the later stages, and the steps' logs
gathered into the suite's one log."""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.suites import deadline
from benchmarks.suites.runner import Context, SuiteLog, run_stages


def context(tmp_path: Path) -> Context:
    (tmp_path / "out").mkdir()
    log = SuiteLog(tmp_path / "out" / "x.log")
    return Context("x", "smoke", tmp_path / "out", tmp_path / "work", tmp_path / "wheels", {}, log)


def test_a_stage_runs_side_by_side_and_the_next_one_after_it(tmp_path):
    ctx = context(tmp_path)
    marker = tmp_path / "done"
    write = f"import pathlib; pathlib.Path({str(marker)!r}).write_text('yes')"
    stages = [[("a", ["-c", "print('from a')"]), ("b", ["-c", "print('from b')"])], [("c", ["-c", write])]]
    result = run_stages(ctx, "part", stages, seconds=60)
    ctx.log.close()
    assert result["status"] == "ok" and marker.read_text() == "yes"
    assert [s["name"] for s in result["steps"]] == ["part: a", "part: b", "part: c"]
    assert all(s["exit"] == 0 for s in result["steps"]) and result["steps"][0]["command"] == "python -c print('from a')"
    log = (ctx.out / "x.log").read_text()
    assert "----- part: a" in log and "from a" in log and "from b" in log


def test_a_failure_stops_the_later_stages(tmp_path):
    ctx = context(tmp_path)
    stages = [[("bad", ["-c", "raise SystemExit(3)"])], [("never", ["-c", "print('ran')"])]]
    result = run_stages(ctx, "part", stages, seconds=60)
    assert result["status"] == "failed: part: bad exit 3"
    assert [s["name"] for s in result["steps"]] == ["part: bad"]


def test_the_deadline_stops_a_command_and_what_it_started(tmp_path):
    ctx = context(tmp_path)
    child = tmp_path / "child.pid"
    # The command starts a grandchild that would outlive it; the deadline's group kill must take both.
    code = (
        "import subprocess, sys, time, pathlib; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"pathlib.Path({str(child)!r}).write_text(str(p.pid)); time.sleep(60)"
    )
    started = time.monotonic()
    result = run_stages(ctx, "part", [[("slow", ["-c", code])]], seconds=3)
    assert time.monotonic() - started < 30
    assert result["status"] == "timed out" and result["steps"][0]["exit"] == deadline.TIMED_OUT
    pid = int(child.read_text())
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_the_deadline_passes_a_commands_own_exit_status(tmp_path, capsys):
    assert deadline.main(["5", "--", "-c", "raise SystemExit(7)"]) == 7
    assert deadline.main(["5"]) == 2 and "usage" in capsys.readouterr().err
