"""`ReportConfig`: every threshold the training-health report judges by, as named config values.

Set on the command line as `key=value` after the run directories:

    python -m train.report runs/a runs/b ablated=loss.gamma,optim.lr grad_collapse_ratio=0.1

The report lists the values it used, so a reader can tell what "far below" or "flat" meant.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from common.config import config_to_dict, knob, parse_command

__all__ = ["ReportConfig", "parse_report_args", "config_rows"]

# Keys whose value is a list but which people naturally type comma-separated (`ablated=a,b`).
_LIST_KEYS = ("ablated", "config_ignore")


@dataclass(frozen=True)
class ReportConfig:
    # --- windows and smoothing
    smooth_window: int = knob(
        0, help="steps in the smoothing window of the curves; 0 = automatic (2% of the logged steps, at least 5)", min=0
    )
    last_window_frac: float = knob(
        0.1,
        help="share of the logged steps that forms the 'latest window' (loss distribution, buckets, block positions)",
        min=0.01,
        max=1.0,
    )
    min_window_steps: int = knob(
        20, help="the latest window holds at least this many steps (fewer only if the log is shorter)", min=1
    )
    min_steps: int = knob(
        50,
        help="trend and learning alarms (collapse, flatness, bimodality, positions, lengths, resets) are not "
        "judged on logs with fewer steps",
        min=2,
    )
    n_phases: int = knob(
        10, help="number of equal training phases (by step) for the gradient-norm and throughput tables", min=2, max=100
    )
    # --- gradient norm
    grad_collapse_ratio: float = knob(
        0.25,
        help="alarm when the median grad norm of the last phase is below this share of the first phase's",
        min=0.0,
        max=1.0,
    )
    # --- loss distribution
    bimodality_bc: float = knob(
        0.555,
        help="Sarle's bimodality coefficient above which the loss distribution counts as possibly bimodal (5/9 "
        "for a uniform distribution)",
        min=0.0,
        max=1.0,
    )
    bimodality_separation: float = knob(
        2.0,
        help="Ashman's D of the two-component Gaussian mixture above which the two modes count as cleanly separated",
        min=0.0,
    )
    bimodality_min_weight: float = knob(
        0.1,
        help="the smaller mixture component must hold at least this share of the steps to count as a mode",
        min=0.0,
        max=0.5,
    )
    bucket_alignment: float = knob(
        0.5,
        help="share of the loss variance explained by the length bucket (eta squared) above which the modes 'line "
        "up with buckets'",
        min=0.0,
        max=1.0,
    )
    # --- buckets and batch composition
    dominance_share: float = knob(
        0.45, help="alarm when one bucket produces more than this share of the batches ...", min=0.0, max=1.0
    )
    dominance_ratio: float = knob(2.0, help="... and at least this many times its share of the samples", min=1.0)
    max_same_bucket_run: int = knob(
        3, help="alarm when more than this many consecutive batches come from one bucket", min=1
    )
    plan_share_tolerance: float = knob(
        0.1,
        help="alarm when a bucket's share of the logged batches differs from its share of the planned batches "
        "(data_plan.json) by more than this",
        min=0.0,
        max=1.0,
    )
    bucket_min_steps: int = knob(
        5,
        help="a bucket needs this many steps in the latest window to take part in the across-lengths comparison",
        min=1,
    )
    length_min_spread: float = knob(
        0.01,
        help="alarm when the mean accuracy of the best and worst length bucket differ by less than this (context "
        "not used)",
        min=0.0,
        max=1.0,
    )
    # --- learning
    flat_frac: float = knob(
        0.3, help="share of the run, at its end, over which accuracy must still be rising", min=0.05, max=1.0
    )
    flat_min_gain: float = knob(
        0.005,
        help="alarm when mean accuracy gains less than this over the last flat_frac of the run (linear fit)",
        min=0.0,
        max=1.0,
    )
    position_min_drop: float = knob(
        0.05,
        help="alarm when accuracy at the last block position is within this of the accuracy at position 1 "
        "(context not used)",
        min=0.0,
        max=1.0,
    )
    reset_rise: float = knob(
        0.3,
        help="alarm when the smoothed loss climbs this share above its best value so far (after the first phase): "
        "a 'reset'",
        min=0.0,
    )
    # --- DFlash2's selector (runs that log it)
    selector_min_gain: float = knob(
        0.0,
        help="alarm when the selector's served streak beats the unary top-1's by no more than this, on average over "
        "the later half of the run (a selector that adds nothing)",
    )
    coverage_max_drop: float = knob(
        0.05,
        help="alarm when the selector's coverage (share of the loss weight whose label is a candidate) fell more than "
        "this below its best (smoothed) value",
        min=0.0,
        max=1.0,
    )
    # --- continuity and timing
    max_missing_steps: int = knob(0, help="alarm when more than this many step numbers are absent from the log", min=0)
    max_skipped_steps: int = knob(0, help="alarm when more than this many steps were skipped as non-finite", min=0)
    stall_factor: float = knob(
        3.0, help="a step whose wall-clock interval exceeds this many times the median interval is a stall ...", min=1.0
    )
    stall_min_seconds: float = knob(
        0.5, help="... provided it also exceeds the median by at least this many seconds", min=0.0
    )
    max_fetch_frac: float = knob(
        0.1, help="alarm when the median share of step time spent waiting for data exceeds this", min=0.0, max=1.0
    )
    # --- comparing runs
    ablated: list[str] = knob(
        factory=list,
        help="config keys the compared runs are meant to differ in (dotted, shell-style wildcards allowed), e.g. "
        "ablated=loss.gamma,optim.lr",
    )
    config_ignore: list[str] = knob(
        factory=lambda: ["run_name", "out_dir", "resume", "stop_after", "log", "checkpoint", "distributed"],
        help="config keys (or whole tables) that may differ between compared runs without an alarm: bookkeeping "
        "that does not change what is trained (distributed: how many GPUs and micro-steps compute the same "
        "steps)",
    )
    # --- output
    out: str | None = knob(
        None, help="directory for report.md and the plots; default: the first run directory", path="dir_out"
    )
    plots: bool = knob(True, help="write PNG plots (false: report.md and the summary only)")


def _listify(word: str) -> str:
    """`ablated=a.b,c.d` -> `ablated=["a.b","c.d"]`, so list keys can be typed without TOML quoting."""
    key, _, raw = word.partition("=")
    raw = raw.strip()
    if key.strip() in _LIST_KEYS and not raw.startswith("["):
        items = [item.strip() for item in raw.split(",") if item.strip()]
        return key + "=" + "[" + ",".join(f'"{item}"' for item in items) + "]"
    return word


def parse_report_args(argv: list[str]) -> tuple[list[str], ReportConfig]:
    """Split a command line into run directories (plain words) and a ReportConfig (key=value or
    --key value words: the grammar of every entry point, `common.config.parse_command`)."""
    setting = lambda word: "=" in word and not word.startswith("-") and not os.path.isdir(word)  # noqa: E731
    words = [_listify(word) if setting(word) else word for word in argv]  # a run directory may hold '='
    usage = "usage: python -m train.report RUN_DIR [RUN_DIR ...] [key=value | --key value ...]"
    cfg, runs = parse_command(ReportConfig, words, rest=True, usage=usage)
    return runs, cfg


def config_rows(cfg: ReportConfig) -> list[tuple[str, str, str]]:
    """(key, value, help) for every setting, for the report's 'Thresholds used' table."""
    values = config_to_dict(cfg)
    return [(f.name, repr(values[f.name]), f.metadata.get("help", "")) for f in dataclasses.fields(cfg)]
