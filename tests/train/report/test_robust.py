"""Training-health report on awkward inputs: a log of one step or none, a run killed mid-line,
no data_plan.json, null losses, resumed runs, runs of different lengths, missing directories;
empty buckets are shown as EMPTY; and the alarms not covered by test_alarms.py."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from tests.train.report.fixtures.synth import Synth, write_run
from train.report.config import ReportConfig
from train.report.load import load_run, read_data_plan
from train.report.make import analyse, make_report

CFG = ReportConfig(plots=False)
SECTIONS = ["## Alarms", "## Reading notes", "## 1.", "## 2.", "## 3.", "## 4.", "## 5.", "## 6.", "## Thresholds used"]


def _sections_say_something(markdown: str) -> None:
    """Every section of report.md exists and holds at least one line of text."""
    for title in SECTIONS:
        assert title in markdown, title
    parts = re.split(r"^## ", markdown, flags=re.M)[1:]
    for part in parts:
        body = [line for line in part.splitlines()[1:] if line.strip()]
        assert body, f"section '{part.splitlines()[0]}' is empty"


def _rewrite(run, edit) -> None:
    """Apply `edit(record)` to every record of a run's metrics.jsonl."""
    path = run / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(edit(r) or r) + "\n" for r in records))


@pytest.mark.parametrize("n_steps", [1, 3])
def test_tiny_logs_are_reported_without_judging_trends(tmp_path, n_steps):
    run = write_run(tmp_path / "tiny", Synth(n_steps=n_steps))
    report = make_report([str(run)], CFG)
    assert report.alarms == []
    assert f"only {n_steps} trained step(s)" in report.markdown and "not judged" in report.summary
    _sections_say_something(report.markdown)


def test_an_empty_log_says_so(tmp_path):
    run = tmp_path / "empty"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    report = make_report([str(run)], CFG)
    assert "no step logged yet" in report.summary
    assert "the log holds no step yet" in report.markdown
    _sections_say_something(report.markdown)


def test_plots_survive_a_one_step_log(tmp_path):
    run = write_run(tmp_path / "one", Synth(n_steps=1))
    report = make_report([str(run)], dataclasses.replace(CFG, plots=True))
    assert report.plots and all((run / f).stat().st_size > 1000 for f in report.plots.values())


def test_missing_data_plan_is_named_with_what_is_skipped(tmp_path):
    run = write_run(tmp_path / "noplan", Synth(write_plan=False))
    report = make_report([str(run)], CFG)
    note = next(n for n in report.analyses[0].run.notes if "data_plan.json" in n)
    assert "missing" in note and "planned" in note
    assert "data_plan.json is missing" in report.markdown
    # Buckets still come from the log.
    assert [r.id for r in report.analyses[0].comp.rows] == [0, 1, 2, 3]
    assert report.alarms == []


def test_a_line_cut_by_a_kill_is_ignored_and_named(tmp_path):
    spec = Synth(n_steps=120, truncate_last_line=True)
    run = load_run(str(write_run(tmp_path / "killed", spec)))
    assert run.metrics.n == spec.n_steps - 1
    assert any("last line" in n and "incomplete" in n for n in run.notes)


def test_an_unreadable_middle_line_is_skipped_and_counted(tmp_path):
    run = write_run(tmp_path / "garbled", Synth(n_steps=100))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[49] = lines[49][:20]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    loaded = load_run(str(run))
    assert loaded.metrics.n == 99
    assert any("line" in n and "50" in n for n in loaded.notes)
    # The lost line is a missing step, and the report says so.
    assert [a.code for a in analyse([str(run)], CFG)[3]] == ["step_gaps"]


def test_null_losses_on_skipped_steps_do_not_break_anything(tmp_path):
    spec = Synth(n_steps=30, nan_steps=tuple(range(1, 31)))
    report = make_report([str(write_run(tmp_path / "allnan", spec))], CFG)
    assert [a.code for a in report.alarms] == ["skipped_steps"]
    assert "no step with a finite loss" in report.markdown
    _sections_say_something(report.markdown)


def test_a_resume_that_relogs_steps_keeps_the_later_records(tmp_path):
    run = write_run(tmp_path / "resumed", Synth(n_steps=300))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    relogged = [json.dumps({**json.loads(line), "loss": 9.0}) for line in lines[200:250]]
    (run / "metrics.jsonl").write_text("\n".join(lines[:250] + relogged + lines[250:]) + "\n")
    loaded = load_run(str(run))
    assert loaded.metrics.n == 300 and loaded.metrics.duplicates == list(range(201, 251))
    assert (loaded.metrics.loss[200:250] == 9.0).all()
    report = make_report([str(run)], CFG)
    assert "logged more than once" in report.markdown and "goes back from step 250 to step 201" in report.markdown


def test_runs_of_different_lengths_are_compared_where_both_reached(tmp_path):
    long = write_run(tmp_path / "long", Synth(n_steps=600))
    short = write_run(tmp_path / "short", Synth(n_steps=250))
    report = make_report([str(long), str(short)], CFG)
    by_step = next(p for p in report.points if p.axis == "step")
    assert by_step.at == 250 and [v[0] for v in by_step.values] == ["long", "short"]
    assert all(v == v for row in by_step.values for v in row[1:])  # no NaN
    assert report.alarms == []


def test_a_missing_run_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"run directory '.*nowhere' does not exist"):
        make_report([str(tmp_path / "nowhere")], CFG)
    (tmp_path / "nolog").mkdir()
    with pytest.raises(ValueError, match="has no metrics.jsonl"):
        make_report([str(tmp_path / "nolog")], CFG)


def test_a_planned_bucket_without_samples_is_reported_empty(tmp_path):
    run = write_run(tmp_path / "planned_empty", Synth(empty_plan_buckets=1))
    report = make_report([str(run)], CFG)
    rows = report.analyses[0].comp.rows
    assert [r.id for r in rows] == [0, 1, 2, 3, 4] and rows[4].empty
    assert "bucket 4 (2049–∞ tok) | 0 | 0 | EMPTY" in report.markdown
    assert "(empty: 4)" in report.summary


def test_a_bucket_with_samples_but_no_batch_yet_is_reported_empty(tmp_path):
    # Three steps of an interleaved schedule never reach the shortest bucket.
    run = write_run(tmp_path / "early", Synth(n_steps=3))
    report = make_report([str(run)], CFG)
    empty = [r for r in report.analyses[0].comp.rows if r.empty]
    assert empty, [r.n_total for r in report.analyses[0].comp.rows]
    for r in empty:
        assert f"| {r.label} | 0 | 0 | EMPTY" in report.markdown


def test_a_bucket_empty_in_the_latest_window_says_so(tmp_path):
    run = write_run(tmp_path / "blocked", Synth(schedule="blocked"))
    report = make_report([str(run)], CFG)
    gone = [r for r in report.analyses[0].comp.rows if r.n_window == 0 and r.n_total > 0]
    assert gone
    assert f"EMPTY in the latest window ({gone[0].n_total} step(s) earlier)" in report.markdown
    assert f"| {gone[0].id} | 0 | EMPTY: no step in the latest window |" in report.markdown  # loss split by bucket


def test_a_stream_that_does_not_follow_its_plan_fires_plan_mismatch(tmp_path):
    run = write_run(tmp_path / "offplan", Synth())
    plan = json.loads((run / "data_plan.json").read_text())
    plan["buckets"][0]["batches_per_epoch"] *= 4
    (run / "data_plan.json").write_text(json.dumps(plan))
    assert [a.code for a in analyse([str(run)], CFG)[3]] == ["plan_mismatch"]


def test_an_epoch_that_goes_backwards_fires(tmp_path):
    run = write_run(tmp_path / "epochs", Synth(n_steps=200))
    _rewrite(run, lambda r: {**r, "epoch": r["epoch"] - 0.5} if r["step"] > 150 else r)
    alarms = analyse([str(run)], CFG)[3]
    assert [a.code for a in alarms] == ["epoch_backwards"] and "step 151" in alarms[0].evidence


def test_waiting_for_data_fires_fetch_bound(tmp_path):
    run = write_run(tmp_path / "starved", Synth(n_steps=200))
    _rewrite(run, lambda r: {**r, "fetch_frac": min(1.0, 2 * CFG.max_fetch_frac)})
    assert [a.code for a in analyse([str(run)], CFG)[3]] == ["fetch_bound"]


def test_a_log_without_most_keys_names_what_is_missing(tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 1.0 / i}) + "\n" for i in range(1, 80)))
    report = make_report([str(run)], CFG)
    note = next(n for n in report.analyses[0].run.notes if "metrics.jsonl has no" in n)
    for key in ("acc", "grad_norm", "bucket", "time", "epoch", "tokens"):
        assert key in note
    _sections_say_something(report.markdown)


def test_data_plan_as_parallel_lists_with_inner_cut_points():
    plan = read_data_plan(
        {
            "boundaries": [512, 2048],
            "samples_per_bucket": [10, 20, 30],
            "batches_per_bucket": [1, 2, 3],
            "token_budget": 49152,
        }
    )
    assert [(b.lo, b.hi) for b in plan.buckets] == [(0.0, 512.0), (512.0, 2048.0), (2048.0, float("inf"))]
    assert [b.samples for b in plan.buckets] == [10, 20, 30] and plan.token_budget == 49152
    assert plan.not_found == ["tokens per bucket", "planned padding efficiency"]


def test_data_plan_that_is_not_an_object_is_named():
    assert read_data_plan([1, 2]).not_found == ["a JSON object at the top level"]
