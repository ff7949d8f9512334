"""common.processes: commands side by side keep their own logs, run at most `max_running` at once,
mark each success as it happens, and start nothing new after a failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.processes import log_tail, run_side_by_side


def test_a_log_tail_shows_a_progress_bar_in_its_last_state(tmp_path):
    path = tmp_path / "step.log"
    path.write_bytes(b"start\nbar 0\rbar 1\rbar 2\ndone\n" + b"".join(b"line %d\n" % i for i in range(100)))
    assert log_tail(str(path), lines=3) == "...\nline 97\nline 98\nline 99"
    assert log_tail(str(path), lines=200).split("\n")[:3] == ["start", "bar 2", "done"]


def test_at_most_max_running_at_once_each_with_its_own_log(tmp_path, capsys):
    # Each step prints when it ran. Two slots: steps 0 and 1 start together; step 2 only once step 0
    # has ended, beside the longer step 1, so it overlaps step 1 and never step 0.
    sleeps = [0.2, 1.5, 0.2]
    steps = [
        (f"step {i}", ["-c", f"import time; a = time.time(); time.sleep({t}); print('ran', a, time.time(), {i})"])
        for i, t in enumerate(sleeps)
    ]
    marked: list[str] = []
    ended = run_side_by_side(steps, str(tmp_path), max_running=2, on_success=marked.append)
    assert [e.name for e in ended] == ["step 0", "step 1", "step 2"] and all(e.exit == 0 for e in ended)
    assert sorted(marked) == ["step 0", "step 1", "step 2"]
    spans = []
    for e in ended:
        _, a, b, i = Path(e.log).read_text().split()
        spans.append((float(a), float(b)))
        assert e.log.endswith(f"step_{i}.log")

    def overlap(x, y):
        return spans[x][0] < spans[y][1] and spans[y][0] < spans[x][1]

    assert overlap(0, 1) and overlap(1, 2) and not overlap(0, 2)
    assert "started step 2" in capsys.readouterr().out


def test_nothing_new_starts_after_a_failure_and_the_running_steps_finish(tmp_path):
    steps = [
        ("fails", ["-c", "raise SystemExit(3)"]),
        ("running", ["-c", "import time; time.sleep(0.5); print('finished')"]),
        ("never", ["-c", "print('should not run')"]),
    ]
    marked: list[str] = []
    ended = run_side_by_side(steps, str(tmp_path), max_running=2, on_success=marked.append, show_tail=0)
    assert [(e.name, e.exit) for e in ended] == [("fails", 3), ("running", 0)]
    assert marked == ["running"] and "finished" in Path(ended[1].log).read_text()
    assert not (tmp_path / "never.log").exists()


def test_zero_slots_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_running"):
        run_side_by_side([("a", ["-c", "pass"])], str(tmp_path), max_running=0)
