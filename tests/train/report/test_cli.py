"""`python -m train.report`: writes report.md and readable PNGs into the first run directory,
prints a short summary, lists its thresholds, and takes key=value overrides."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

from tests.train.report.fixtures.synth import SKEWED_SAMPLES, Synth, write_run
from train.report.__main__ import main
from train.report.config import ReportConfig, parse_report_args
from train.report.plots import PER_RUN

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report_cli")
    healthy = write_run(root / "healthy", Synth(n_steps=400))
    sick = write_run(root / "sick", Synth(n_steps=300, samples=SKEWED_SAMPLES, config_changes={"loss.gamma": 5.0}))
    return healthy, sick


def _pngs(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("*.png")}


def _linked(markdown: str) -> set[str]:
    return set(re.findall(r"\]\(([^)]+\.png)\)", markdown))


def test_one_run_writes_report_and_every_plot(two_runs, capsys):
    healthy, _ = two_runs
    # Overlays left by an earlier report of several runs must go: report.md no longer describes them.
    for stale in ("report_compare.png", "report_curves_run2.png"):
        (healthy / stale).write_bytes(b"old")
    assert main([str(healthy)]) == 0
    out = capsys.readouterr().out
    assert "No alarm." in out and "report.md" in out and len(out.splitlines()) <= 25
    expected = {f"report_{name}.png" for name in PER_RUN} | {"report_positions.png"}
    assert _pngs(healthy) == expected
    markdown = (healthy / "report.md").read_text()
    assert _linked(markdown) == expected
    for name in expected:
        image = imread(healthy / name)
        assert image.shape[0] >= 400 and image.shape[1] >= 700
        assert image[..., :3].std() > 0.05  # not a blank canvas


def test_several_runs_overlay_and_get_their_own_plots(two_runs, tmp_path, capsys):
    healthy, sick = two_runs
    assert main([str(healthy), str(sick), "ablated=loss.gamma", f"out={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "[sick] one length bucket dominates" in out and "config" not in out.split("ALARMS")[1]
    markdown = (tmp_path / "report.md").read_text()
    pngs = _pngs(tmp_path)
    assert {"report_compare.png", "report_positions.png"} <= pngs
    assert {f"report_{name}_run2.png" for name in PER_RUN} <= pngs
    assert _linked(markdown) == pngs
    assert not _pngs(sick)  # the report lives in one place only


def test_every_threshold_is_listed_in_the_report(two_runs):
    healthy, _ = two_runs
    assert main([str(healthy), "plots=false", "grad_collapse_ratio=0.125"]) == 0
    markdown = (healthy / "report.md").read_text()
    for field in dataclasses.fields(ReportConfig):
        assert f"| {field.name} | " in markdown
    assert "| grad_collapse_ratio | `0.125` |" in markdown


def test_out_and_plots_false(two_runs, tmp_path):
    healthy, _ = two_runs
    assert main([str(healthy), f"out={tmp_path / 'elsewhere'}", "plots=false"]) == 0
    assert (tmp_path / "elsewhere" / "report.md").is_file() and not _pngs(tmp_path / "elsewhere")


def test_overrides_are_parsed_and_checked(capsys):
    runs, cfg = parse_report_args(["runs/a", "runs/b", "ablated=loss.gamma,optim.lr", "stall_factor=5"])
    assert runs == ["runs/a", "runs/b"] and cfg.ablated == ["loss.gamma", "optim.lr"] and cfg.stall_factor == 5.0
    assert parse_report_args(["x", 'ablated=["a.b"]'])[1].ablated == ["a.b"]
    assert main(["runs/a", "grad_colapse_ratio=0.1"]) == 2
    assert "unknown config key 'grad_colapse_ratio'" in capsys.readouterr().err
    assert main(["runs/a", "grad_collapse_ratio=2"]) == 2
    assert "'grad_collapse_ratio': 2.0 is above the maximum 1.0" in capsys.readouterr().err


def test_help_lists_the_keys(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    assert "grad_collapse_ratio" in capsys.readouterr().out


def test_missing_run_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path / "gone")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_no_run_given_reports_the_newest_under_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    old = write_run(tmp_path / "runs" / "old", Synth(n_steps=60))
    new = write_run(tmp_path / "runs" / "new", Synth(n_steps=60))
    os.utime(old / "metrics.jsonl", (1, 1))
    assert main(["plots=false"]) == 0
    assert "reporting the newest one, runs/new" in capsys.readouterr().out
    assert (new / "report.md").is_file() and not (old / "report.md").exists()
    # A bare run name is looked up under runs/, as `make train RUN=name` creates it.
    assert main(["old", "plots=false"]) == 0 and (old / "report.md").is_file()


def test_module_entry_point(two_runs):
    healthy, _ = two_runs
    done = subprocess.run(
        [sys.executable, "-m", "train.report", str(healthy), "plots=false"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "healthy: steps 1–400" in done.stdout
