"""Comparing runs for the training-health report: each compared run's config (and shards) against
the first run's, and every run's smoothed loss, accuracy and τ where all of them have been.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from common.config import flatten_dotted
from train.report.analysis import RunAnalysis, mean_of
from train.report.config import ReportConfig
from train.report.load import RunRecord, matches_any

__all__ = ["ConfigDiff", "compare_configs", "CommonPoint", "compare_at_common"]


@dataclass
class ConfigDiff:
    run: str
    differing: list[tuple[str, object, object]]  # key, value in the first run, value here
    unexpected: list[str]  # differing keys that are neither ablated nor ignored
    note: str = ""


def compare_configs(runs: list[RunRecord], cfg: ReportConfig) -> list[ConfigDiff]:
    """Each compared run's config against the first run's."""
    base = runs[0]
    diffs = []
    for run in runs[1:]:
        if base.config is None or run.config is None:
            missing = base.name if base.config is None else run.name
            diffs.append(
                ConfigDiff(
                    run=run.name,
                    differing=[],
                    unexpected=[],
                    note=f"config.json of {missing} is missing: configs not compared.",
                )
            )
            continue
        a, b = _comparable(base), _comparable(run)
        differing = [
            (k, a.get(k, "<absent>"), b.get(k, "<absent>"))
            for k in sorted(set(a) | set(b))
            if a.get(k, "<absent>") != b.get(k, "<absent>")
        ]
        unexpected = [
            k for k, _, _ in differing if not matches_any(k, cfg.ablated) and not matches_any(k, cfg.config_ignore)
        ]
        note = ""
        if cfg.ablated and not any(matches_any(k, cfg.ablated) for k, _, _ in differing):
            note = f"{run.name} does not differ from {base.name} in any ablated key ({', '.join(cfg.ablated)})."
        diffs.append(ConfigDiff(run=run.name, differing=differing, unexpected=unexpected, note=note))
    return diffs


def _comparable(run: RunRecord) -> dict[str, object]:
    """The flattened config, plus the data provenance from run.json (other shards = another experiment)."""
    values = flatten_dotted(run.config)
    info = flatten_dotted(run.run_info or {}, "run.")
    values.update({k: v for k, v in info.items() if "manifest" in k or "shards" in k})
    return values


@dataclass
class CommonPoint:
    axis: str  # "step" or "tokens"
    at: float
    values: list[tuple[str, float, float, float]]  # run, loss, acc, tau (smoothed, at the point)
    note: str = ""


def compare_at_common(analyses: list[RunAnalysis], axis: str) -> CommonPoint:
    """Smoothed loss, accuracy and τ of every run at the furthest step (or token count) all reached."""
    ends = []
    for a in analyses:
        x = a.m.step.astype(np.float64) if axis == "step" else a.m.tokens
        ends.append(float(np.nanmax(x)) if np.isfinite(x).any() else math.nan)
    if not all(np.isfinite(ends)):
        return CommonPoint(
            axis=axis, at=math.nan, values=[], note=f"a run logs no {axis}: comparison at equal {axis} skipped."
        )
    at = min(ends)
    values = []
    for a in analyses:
        x = a.m.step.astype(np.float64) if axis == "step" else a.m.tokens
        valid = a.m.valid & np.isfinite(x) & (x <= at)
        if not valid.any():
            values.append((a.run.name, math.nan, math.nan, math.nan))
            continue
        rows = np.flatnonzero(valid)
        last = rows[-a.smooth :]
        values.append((a.run.name, mean_of(a.m.loss[last]), mean_of(a.m.acc_mean[last]), mean_of(a.m.tau[last])))
    return CommonPoint(axis=axis, at=at, values=values)
