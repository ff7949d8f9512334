"""The training-health report as a library: `analyse` (everything the report says, nothing written) and
`make_report` (report.md and the plots written into the first run directory, or `out=DIR`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.io import atomic_write_text
from train.report.alarms import Alarm, find_alarms
from train.report.analysis import RunAnalysis, analyse_run
from train.report.compare import CommonPoint, ConfigDiff, compare_at_common, compare_configs
from train.report.config import ReportConfig
from train.report.load import load_run
from train.report.markdown import render_markdown, render_summary
from train.report.plots import render_plots

__all__ = ["Report", "analyse", "make_report", "newest_run", "ReportConfig"]


@dataclass
class Report:
    analyses: list[RunAnalysis]
    diffs: list[ConfigDiff]
    points: list[CommonPoint]
    alarms: list[Alarm]
    out_dir: Path
    plots: dict[str, str]  # plot name -> file name inside out_dir
    markdown: str
    summary: str

    @property
    def alarm_codes(self) -> set[str]:
        return {a.code for a in self.alarms}


def analyse(
    run_words: list[str], cfg: ReportConfig
) -> tuple[list[RunAnalysis], list[ConfigDiff], list[CommonPoint], list[Alarm]]:
    """Everything the report says, without writing anything."""
    if not run_words:
        raise ValueError(
            "give at least one run directory: python -m train.report RUN_DIR [RUN_DIR ...] [key=value ...]"
        )
    runs = [load_run(word) for word in run_words]
    analyses = [analyse_run(run, cfg) for run in runs]
    diffs = compare_configs(runs, cfg)
    points = [compare_at_common(analyses, axis) for axis in ("step", "tokens")] if len(runs) > 1 else []
    return analyses, diffs, points, find_alarms(analyses, diffs, cfg)


def make_report(
    run_words: list[str], cfg: ReportConfig | None = None, command: str = "python -m train.report"
) -> Report:
    """Analyse the runs and write report.md and the plots; returns what was written."""
    cfg = cfg or ReportConfig()
    analyses, diffs, points, alarms = analyse(run_words, cfg)
    out_dir = Path(cfg.out) if cfg.out else analyses[0].run.path
    out_dir.mkdir(parents=True, exist_ok=True)
    plots: dict[str, str] = {}
    if cfg.plots:
        plots = render_plots(analyses, out_dir)
    markdown = render_markdown(analyses, diffs, points, alarms, cfg, plots, command)
    atomic_write_text(str(out_dir / "report.md"), markdown)
    return Report(
        analyses=analyses,
        diffs=diffs,
        points=points,
        alarms=alarms,
        out_dir=out_dir,
        plots=plots,
        markdown=markdown,
        summary=render_summary(analyses, alarms, cfg),
    )


def newest_run(root: Path = Path("runs")) -> str:
    """The most recently written run under runs/, for `make report` without RUN."""
    logs = sorted(root.glob("*/metrics.jsonl"), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    if not logs:
        raise ValueError(
            "no run given and no runs/*/metrics.jsonl found: python -m train.report RUN_DIR [RUN_DIR ...] "
            "[key=value ...]"
        )
    return str(logs[-1].parent)
