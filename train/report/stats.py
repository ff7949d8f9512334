"""Small numeric tools for the training-health report (numpy only): NaN-aware smoothing and
quantiles, Sarle's bimodality coefficient, a two-component Gaussian mixture fitted by EM, the share
of variance explained by a grouping, runs of equal values, and a linear trend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "smooth",
    "finite",
    "quantile",
    "sarle_bc",
    "Mixture",
    "fit_mixture2",
    "eta_squared",
    "longest_run",
    "linear_gain",
    "trend_with_groups",
    "ranges",
]


def finite(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x[np.isfinite(x)]


def quantile(x: np.ndarray, q: float) -> float:
    """Quantile of the finite values, NaN when there are none."""
    values = finite(x)
    return float(np.quantile(values, q)) if values.size else math.nan


def smooth(x: np.ndarray, window: int, *, centred: bool = True) -> np.ndarray:
    """Moving average that skips NaN (a skipped step does not drag the curve to zero); centred for
    plots, trailing (`centred=False`) where an event must not show up before it happens."""
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0 or window <= 1:
        return x.copy()
    ok = np.isfinite(x)
    sums = np.concatenate([[0.0], np.cumsum(np.where(ok, x, 0.0))])
    counts = np.concatenate([[0], np.cumsum(ok)])
    half = window // 2 if centred else window - 1
    idx = np.arange(x.size)
    lo = np.clip(idx - half, 0, x.size)
    hi = np.clip(idx - half + window, 0, x.size)
    n = counts[hi] - counts[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (sums[hi] - sums[lo]) / np.maximum(n, 1), np.nan)


def sarle_bc(x: np.ndarray) -> float:
    """Sarle's bimodality coefficient (g² + 1) / (k + 3(n-1)²/((n-2)(n-3))) with sample-corrected
    skewness g and excess kurtosis k; above 5/9 hints at bimodality (or strong skew). NaN if n < 4."""
    x = finite(x)
    n = x.size
    if n < 4 or np.std(x) == 0:
        return math.nan
    d = x - x.mean()
    m2, m3, m4 = (d**2).mean(), (d**3).mean(), (d**4).mean()
    g = math.sqrt(n * (n - 1)) / (n - 2) * m3 / m2**1.5
    k = (n - 1) / ((n - 2) * (n - 3)) * ((n + 1) * (m4 / m2**2 - 3) + 6)
    return float((g**2 + 1) / (k + 3 * (n - 1) ** 2 / ((n - 2) * (n - 3))))


@dataclass
class Mixture:
    """Two Gaussian components, sorted by mean, and how much better they explain the data than one."""

    weights: tuple[float, float]
    means: tuple[float, float]
    sds: tuple[float, float]
    bic_one: float
    bic_two: float
    labels: np.ndarray  # component (0 = low mean, 1 = high mean) each value most likely belongs to

    @property
    def separation(self) -> float:
        """Ashman's D: > 2 means the two components are cleanly separated."""
        return math.sqrt(2) * abs(self.means[1] - self.means[0]) / math.sqrt(self.sds[0] ** 2 + self.sds[1] ** 2)

    @property
    def two_better(self) -> bool:
        return self.bic_two < self.bic_one


def _normal_pdf(x: np.ndarray, mean: float, sd: float) -> np.ndarray:
    return np.exp(-0.5 * ((x - mean) / sd) ** 2) / (sd * math.sqrt(2 * math.pi))


def fit_mixture2(x: np.ndarray, iterations: int = 200) -> Mixture | None:
    """EM fit of a two-component 1-D Gaussian mixture (started from the lower and upper quartiles);
    None for fewer than 8 values or constant data."""
    x = finite(x)
    n = x.size
    if n < 8 or np.std(x) == 0:
        return None
    floor = 1e-3 * float(np.std(x))  # keeps a component from collapsing onto one point
    w = np.array([0.5, 0.5])
    mu = np.quantile(x, [0.25, 0.75]).astype(np.float64)
    sd = np.full(2, float(np.std(x)) / 2 + floor)
    for _ in range(iterations):
        dens = np.stack([w[j] * _normal_pdf(x, mu[j], sd[j]) for j in range(2)]) + 1e-300
        resp = dens / dens.sum(axis=0)
        nk = resp.sum(axis=1) + 1e-12
        w = nk / n
        mu_new = (resp @ x) / nk
        sd = np.sqrt((resp * (x[None, :] - mu_new[:, None]) ** 2).sum(axis=1) / nk) + floor
        if np.allclose(mu_new, mu, rtol=0, atol=1e-9 * (1 + np.abs(mu).max())):
            mu = mu_new
            break
        mu = mu_new
    order = np.argsort(mu)
    w, mu, sd = w[order], mu[order], sd[order]
    dens = np.stack([w[j] * _normal_pdf(x, mu[j], sd[j]) for j in range(2)]) + 1e-300
    loglik_two = float(np.log(dens.sum(axis=0)).sum())
    loglik_one = float(np.log(_normal_pdf(x, x.mean(), float(np.std(x))) + 1e-300).sum())
    return Mixture(
        weights=(float(w[0]), float(w[1])),
        means=(float(mu[0]), float(mu[1])),
        sds=(float(sd[0]), float(sd[1])),
        bic_one=-2 * loglik_one + 2 * math.log(n),
        bic_two=-2 * loglik_two + 5 * math.log(n),
        labels=np.argmax(dens, axis=0),
    )


def eta_squared(values: np.ndarray, groups: np.ndarray) -> float:
    """Share of the variance of `values` explained by `groups` (0: none, 1: groups are the values)."""
    values = np.asarray(values, dtype=np.float64)
    groups = np.asarray(groups)
    ok = np.isfinite(values)
    values, groups = values[ok], groups[ok]
    total = float(((values - values.mean()) ** 2).sum()) if values.size else 0.0
    if values.size < 2 or total == 0:
        return math.nan
    between = sum(
        values[groups == g].size * (values[groups == g].mean() - values.mean()) ** 2 for g in np.unique(groups)
    )
    return float(between / total)


def longest_run(seq: np.ndarray) -> tuple[int, int, int]:
    """(length, value, start index) of the longest run of equal consecutive values; (0, -1, -1) if empty."""
    seq = np.asarray(seq)
    if seq.size == 0:
        return 0, -1, -1
    change = np.flatnonzero(np.diff(seq) != 0) + 1
    starts = np.concatenate([[0], change])
    lengths = np.diff(np.concatenate([starts, [seq.size]]))
    best = int(np.argmax(lengths))
    return int(lengths[best]), int(seq[starts[best]]), int(starts[best])


def linear_gain(x: np.ndarray, y: np.ndarray) -> float:
    """Change of y across the span of x according to a least-squares line (NaN pairs dropped)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 3 or np.ptp(x[ok]) == 0:
        return math.nan
    slope = np.polyfit(x[ok], y[ok], 1)[0]
    return float(slope * np.ptp(x[ok]))


def trend_with_groups(x: np.ndarray, y: np.ndarray, groups: np.ndarray) -> tuple[float, dict[int, float]]:
    """Least-squares fit y ~ level[group] + slope * x: (slope, level of each group at the mean x).

    Separates 'later steps are better' from 'this bucket is better' when buckets are not spread
    evenly in time (a bucket-by-bucket schedule), which plain per-group means would mix up."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    groups = np.asarray(groups)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y, groups = x[ok], y[ok], groups[ok]
    ids = [int(g) for g in np.unique(groups)]
    if x.size < len(ids) + 2 or np.ptp(x) == 0:
        return math.nan, {g: float(y[groups == g].mean()) for g in ids}
    design = np.column_stack([(groups == g).astype(np.float64) for g in ids] + [x - x.mean()])
    coef = np.linalg.lstsq(design, y, rcond=None)[0]
    return float(coef[-1]), {g: float(c) for g, c in zip(ids, coef[:-1], strict=True)}


def ranges(values: list[int] | np.ndarray) -> list[tuple[int, int]]:
    """Sorted integers as inclusive ranges: [3, 4, 5, 9] -> [(3, 5), (9, 9)]."""
    out: list[tuple[int, int]] = []
    for v in sorted(int(v) for v in values):
        if out and v == out[-1][1] + 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return out
