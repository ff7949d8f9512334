"""The DFlash2 section of the training-health report: the selector's loss, weight, coverage, teacher-forced
accuracy and served streak beside the unary one (`train.selector_loss` defines them), and the two
measurements its alarms judge: whether the selector's walk beats the unary top-1 over the run's later
half, and how far coverage fell from its best. A run without the selector keys (a DFlash run) has none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from train.report.load import Metrics
from train.report.stats import smooth

__all__ = ["SelectorReport", "selector_report"]


@dataclass
class SelectorReport:
    loss: float  # means over the latest window
    weight: float
    coverage: float
    accuracy: float  # teacher-forced, mean over block positions
    streak: float  # the served walk's
    unary_streak: float
    later_first_step: int  # the later half of the trained steps starts here
    gain_later: float  # mean of (selector streak - unary streak) over the later half
    later_steps: int  # steps of the later half with both streaks
    coverage_best: float  # the smoothed coverage's best ...
    coverage_best_step: int  # ... and where
    coverage_drop: float  # best - the latest window's mean


def _mean(values: np.ndarray) -> float:
    values = values[np.isfinite(values)]
    return float(values.mean()) if values.size else math.nan


def selector_report(m: Metrics, window: np.ndarray, width: int) -> SelectorReport | None:
    """The selector section of a run (None for a run without a selector); `width`: the smoothing window."""
    if "selector_streak" not in m.present:
        return None
    valid = np.flatnonzero(m.valid)
    later = valid[valid.size // 2 :]
    both = later[np.isfinite(m.selector_streak[later]) & np.isfinite(m.streak[later])]
    coverage = smooth(m.selector_coverage[valid], width, centred=False)
    best = int(np.nanargmax(coverage)) if np.isfinite(coverage).any() else None
    latest_coverage = _mean(m.selector_coverage[window])
    return SelectorReport(
        loss=_mean(m.selector_loss[window]),
        weight=_mean(m.selector_weight[window]),
        coverage=latest_coverage,
        accuracy=_mean(np.nanmean(m.selector_acc[window], axis=1)) if m.selector_acc.shape[1] else math.nan,
        streak=_mean(m.selector_streak[window]),
        unary_streak=_mean(m.streak[window]),
        later_first_step=int(m.step[later[0]]) if later.size else 0,
        gain_later=_mean(m.selector_streak[both] - m.streak[both]),
        later_steps=int(both.size),
        coverage_best=float(coverage[best]) if best is not None else math.nan,
        coverage_best_step=int(m.step[valid[best]]) if best is not None else 0,
        coverage_drop=float(coverage[best]) - latest_coverage if best is not None else math.nan,
    )
