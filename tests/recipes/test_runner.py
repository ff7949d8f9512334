"""recipes.runner, the orchestration of the drafter command and the demos, on stand-in steps (a
module that writes its output from its input): what is skipped, resumed, redone or run, and what a
changed setting or input reruns."""

from __future__ import annotations

import json
import textwrap

import pytest

from recipes.runner import Ledger, Runner, Stage, final_checkpoint

FAKE = """
import json, os, sys

def main(argv):
    args = dict(a.split("=", 1) for a in argv)
    out = args["out"]
    os.makedirs(os.path.dirname(out), exist_ok=True)
    partial = out + ".partial"
    resumed = os.path.exists(partial)
    if os.path.exists(args.get("fail_once", "/nonexistent")):
        os.remove(args["fail_once"])
        open(partial, "w").close()
        return 3
    source = open(args["in"]).read() if "in" in args else ""
    with open(out, "w") as f:
        json.dump({"value": args.get("value"), "input": source, "resumed": resumed, "complete": True}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def steps(tmp_path, monkeypatch):
    (tmp_path / "fake_step.py").write_text(textwrap.dedent(FAKE))
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(a_value="1", fail_b=""):
        a, b, c = (str(tmp_path / d / "out.json") for d in "abc")
        b_args = (f"in={a}", f"out={b}", *([f"fail_once={fail_b}"] if fail_b else []))
        return [
            [Stage("A", "fake_step", (f"out={a}", f"value={a_value}"), records=(a,), clear=(str(tmp_path / "a"),))],
            [Stage("B", "fake_step", b_args, records=(b,), clear=(str(tmp_path / "b"),), needs=("A",))],
            [Stage("C", "fake_step", (f"out={c}", "value=1"), records=(c,), clear=(str(tmp_path / "c"),))],
        ]

    return make


def run(tmp_path, groups) -> dict[str, str]:
    runner = Runner(Ledger(str(tmp_path / "stages.json")), in_process=True)
    runner.run(groups)
    return runner.status


def test_a_rerun_skips_and_a_changed_setting_reruns_its_step_and_the_steps_reading_it(tmp_path, steps):
    assert run(tmp_path, steps()) == {"A": "ran", "B": "ran", "C": "ran"}
    assert run(tmp_path, steps()) == {"A": "skipped", "B": "skipped", "C": "skipped"}
    assert run(tmp_path, steps(a_value="2")) == {"A": "redone", "B": "redone", "C": "skipped"}
    assert json.loads((tmp_path / "b/out.json").read_text())["input"] == (tmp_path / "a/out.json").read_text()
    (tmp_path / "b/out.json").write_text('{"complete": true, "edited": 1}')  # changed since it was made
    assert run(tmp_path, steps(a_value="2")) == {"A": "skipped", "B": "redone", "C": "skipped"}


def test_a_step_cut_short_resumes_with_its_partial_output_and_a_redo_clears_it(tmp_path, steps):
    marker = tmp_path / "fail"
    marker.write_text("")
    with pytest.raises(SystemExit, match="step 'B' failed \\(exit 3\\)"):
        run(tmp_path, steps(fail_b=str(marker)))
    assert run(tmp_path, steps(fail_b=str(marker))) == {"A": "skipped", "B": "resumed", "C": "ran"}
    assert json.loads((tmp_path / "b/out.json").read_text())["resumed"] is True  # its partial output was kept
    marker.write_text("")
    (tmp_path / "b/out.json").unlink()
    with pytest.raises(SystemExit):
        run(tmp_path, steps(fail_b=str(marker)))
    assert run(tmp_path, steps()) == {"A": "skipped", "B": "redone", "C": "skipped"}  # other args: cleared first
    assert json.loads((tmp_path / "b/out.json").read_text())["resumed"] is False


def test_output_the_ledger_does_not_know_is_left_to_the_step_itself(tmp_path, steps):
    (tmp_path / "c").mkdir()
    (tmp_path / "c/keep.txt").write_text("made before")  # e.g. a dataset extraction finds complete itself
    assert run(tmp_path, steps())["C"] == "ran" and (tmp_path / "c/keep.txt").exists()


def test_a_training_run_is_done_at_its_final_checkpoint(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"total_steps": 20}))
    (tmp_path / "checkpoints/step-00000010").mkdir(parents=True)
    (tmp_path / "checkpoints/step-00000010/state.json").write_text("{}")
    assert final_checkpoint(str(tmp_path)) is None
    (tmp_path / "checkpoints/step-00000020.tmp-1").mkdir()
    assert final_checkpoint(str(tmp_path)) is None
    (tmp_path / "checkpoints/step-00000020").mkdir()
    (tmp_path / "checkpoints/step-00000020/state.json").write_text("{}")
    assert final_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoints/step-00000020/state.json")


def test_side_by_side_runs_a_group_a_few_at_a_time_and_a_failure_names_its_step(tmp_path, steps):
    """A group of independent steps as processes, `max_running` at a time, each with its own log; each
    is recorded done as it ends, so a failure of another keeps it."""
    from tests.paths import child_pythonpath

    a, _, c = steps()
    (tmp_path / "fail").write_text("")
    d = str(tmp_path / "d" / "out.json")
    bad = Stage("D", "fake_step", (f"out={d}", f"fail_once={tmp_path / 'fail'}"), records=(d,))
    env = {"PYTHONPATH": child_pythonpath(str(tmp_path))}
    runner = Runner(Ledger(str(tmp_path / "stages.json")), env=env, side_by_side=True, max_running=2, show_tail=0)
    runner.log_dir = str(tmp_path / "logs")
    with pytest.raises(SystemExit, match="step 'D'"):
        runner.run([[a[0], c[0], bad]])
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["A.log", "C.log", "D.log"]
    assert run(tmp_path, [[a[0], c[0]]]) == {"A": "skipped", "C": "skipped"}
