"""The measurements of the training-health report, one function per report section, each returning
plain dataclasses (no judging here: `report_alarms` compares them to the thresholds, and
`report_markdown` writes them out). Every result that can come out empty carries a `note` that
says why in words, so the report never prints nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from train.report.config import ReportConfig
from train.report.load import BucketPlan, Metrics, RunRecord
from train.report.selector import SelectorReport, selector_report
from train.report.stats import (
    Mixture,
    eta_squared,
    finite,
    fit_mixture2,
    linear_gain,
    longest_run,
    quantile,
    ranges,
    sarle_bc,
    smooth,
    trend_with_groups,
)

__all__ = ["RunAnalysis", "analyse_run", "smooth_window", "latest_window", "phase_of", "mean_of"]


def smooth_window(n: int, cfg: ReportConfig) -> int:
    """Steps in the smoothing window: the configured one, or 2% of the run (at least 5)."""
    return cfg.smooth_window if cfg.smooth_window > 0 else max(5, n // 50)


def latest_window(m: Metrics, cfg: ReportConfig) -> np.ndarray:
    """Row indices of the last trained (not skipped) steps: last_window_frac of them, at least min_window_steps."""
    valid = np.flatnonzero(m.valid)
    size = max(cfg.min_window_steps, math.ceil(cfg.last_window_frac * valid.size))
    return valid[-size:]


def first_window(m: Metrics, cfg: ReportConfig) -> np.ndarray:
    """The first trained steps, as many as the latest window holds (for before/after comparisons)."""
    valid = np.flatnonzero(m.valid)
    size = max(cfg.min_window_steps, math.ceil(cfg.last_window_frac * valid.size))
    return valid[:size]


def phase_of(m: Metrics, n_phases: int) -> tuple[np.ndarray, np.ndarray]:
    """(phase index per row, step edges): equal slices of the logged step range."""
    if m.n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(n_phases + 1)
    edges = np.linspace(m.step[0], m.step[-1] + 1, n_phases + 1)
    return np.clip(np.searchsorted(edges, m.step, side="right") - 1, 0, n_phases - 1), edges


# ----------------------------------------------------------------------------------------------
# Section 2: gradient norm by phase, and throughput by phase


@dataclass
class Phase:
    index: int
    first_step: int
    last_step: int
    n: int
    grad_median: float
    grad_p95: float
    grad_max: float
    clipped_share: float
    tok_s_median: float


@dataclass
class GradReport:
    phases: list[Phase]
    ratio: float  # median of the last phase / median of the first
    warmup_end_step: int | None
    clipped_after_warmup: float
    note: str = ""


def grad_report(m: Metrics, cfg: ReportConfig) -> GradReport:
    phase, edges = phase_of(m, cfg.n_phases)
    grad = m.grad_norm
    phases = []
    for i in range(cfg.n_phases):
        rows = phase == i
        g = finite(grad[rows])
        clip = m.clipped[rows & np.isfinite(grad)]
        phases.append(
            Phase(
                index=i + 1,
                first_step=int(math.ceil(edges[i])),
                last_step=int(math.ceil(edges[i + 1])) - 1,
                n=int(g.size),
                grad_median=quantile(g, 0.5),
                grad_p95=quantile(g, 0.95),
                grad_max=float(g.max()) if g.size else math.nan,
                clipped_share=float(clip.mean()) if clip.size and "clipped" in m.present else math.nan,
                tok_s_median=quantile(m.tok_s[rows & m.valid], 0.5),
            )
        )
    note = ""
    if "grad_norm" not in m.present or not np.isfinite(grad).any():
        note = "no finite grad_norm in the log: gradient analysis skipped."
    elif m.n < cfg.n_phases:
        note = f"only {m.n} step(s) for {cfg.n_phases} phases: some phases are empty."
    ratio = (
        phases[-1].grad_median / phases[0].grad_median
        if phases[0].n and phases[-1].n and phases[0].grad_median > 0
        else math.nan
    )
    warmup_end = None
    clipped_after = math.nan
    if np.isfinite(m.lr).any():
        # The learning rate peaks where warm-up ends.
        peak = int(np.nanargmax(m.lr))
        warmup_end = int(m.step[peak])
        after = (m.step > warmup_end) & np.isfinite(grad)
        if after.any() and "clipped" in m.present:
            clipped_after = float(m.clipped[after].mean())
    return GradReport(
        phases=phases, ratio=ratio, warmup_end_step=warmup_end, clipped_after_warmup=clipped_after, note=note
    )


# ----------------------------------------------------------------------------------------------
# Section 3: loss distribution over the latest window


@dataclass
class LossDistribution:
    n: int
    first_step: int | None
    mean: float = math.nan
    median: float = math.nan
    p10: float = math.nan
    p90: float = math.nan
    bc: float = math.nan
    mixture: Mixture | None = None
    bimodal: bool = False
    eta2: float = math.nan  # share of loss variance explained by bucket
    by_bucket: list[tuple[int, int, float, float]] = field(
        default_factory=list
    )  # bucket, n, mean, share in the high mode
    note: str = ""


def loss_distribution(m: Metrics, window: np.ndarray, cfg: ReportConfig) -> LossDistribution:
    loss = m.loss[window]
    if loss.size == 0:
        return LossDistribution(n=0, first_step=None, note="no step with a finite loss: loss distribution skipped.")
    out = LossDistribution(
        n=int(loss.size),
        first_step=int(m.step[window[0]]),
        mean=float(loss.mean()),
        median=float(np.median(loss)),
        p10=float(np.quantile(loss, 0.1)),
        p90=float(np.quantile(loss, 0.9)),
        bc=sarle_bc(loss),
        mixture=fit_mixture2(loss),
    )
    mix = out.mixture
    if mix is None:
        out.note = f"{loss.size} step(s) in the window: too few (or all equal) for a bimodality test."
        return out
    out.bimodal = bool(
        out.bc > cfg.bimodality_bc
        and mix.two_better
        and mix.separation > cfg.bimodality_separation
        and min(mix.weights) >= cfg.bimodality_min_weight
    )
    buckets = m.bucket[window]
    if (buckets >= 0).any() and np.unique(buckets[buckets >= 0]).size >= 2:
        out.eta2 = eta_squared(loss, buckets)
        for b in np.unique(buckets):
            rows = buckets == b
            out.by_bucket.append(
                (int(b), int(rows.sum()), float(loss[rows].mean()), float((mix.labels[rows] == 1).mean()))
            )
    else:
        out.note = "fewer than two buckets in the window: cannot tell whether modes line up with buckets."
    return out


# ----------------------------------------------------------------------------------------------
# Sections 4 and 5: by bucket, and batch composition


@dataclass
class BucketRow:
    id: int
    label: str
    n_window: int
    n_total: int
    loss: float
    acc: float
    acc1: float
    streak: float
    batch_share: float  # of all logged batches
    planned_share: float  # of the planned batches per epoch
    sample_share: float
    token_share: float
    pad_eff: float
    planned_pad_eff: float

    @property
    def empty(self) -> bool:
        return self.n_total == 0


@dataclass
class Composition:
    rows: list[BucketRow]
    longest_run: int
    longest_run_bucket: int
    longest_run_first_step: int | None
    pad_eff: float
    planned_pad_eff: float
    n_buckets_seen: int
    note: str = ""


def _share(values: list[float | None], i: int) -> float:
    if any(v is None for v in values) or not values or sum(values) <= 0:
        return math.nan
    return float(values[i] / sum(values))


def composition(run: RunRecord, window: np.ndarray) -> Composition:
    m, plan = run.metrics, run.plan
    planned = {b.id: b for b in plan.buckets} if plan else {}
    seen = sorted(set(int(b) for b in m.bucket if b >= 0))
    ids = sorted(set(planned) | set(seen))
    plan_list = [planned[i] for i in sorted(planned)]
    in_window = np.zeros(m.n, dtype=bool)
    in_window[window] = True
    acc_mean = m.acc_mean
    rows = []
    for bid in ids:
        b = planned.get(bid, BucketPlan(id=bid))
        all_rows = m.bucket == bid
        w = all_rows & in_window
        k = sorted(planned).index(bid) if bid in planned else None
        rows.append(
            BucketRow(
                id=bid,
                label=b.label,
                n_window=int(w.sum()),
                n_total=int(all_rows.sum()),
                loss=mean_of(m.loss[w]),
                acc=mean_of(acc_mean[w]),
                acc1=mean_of(m.acc[w, 0]) if m.acc.shape[1] else math.nan,
                streak=mean_of(m.streak[w]),
                batch_share=float(all_rows.mean()) if m.n else math.nan,
                planned_share=_share([p.batches for p in plan_list], k) if k is not None else math.nan,
                sample_share=_share([p.samples for p in plan_list], k) if k is not None else math.nan,
                token_share=_share([p.tokens for p in plan_list], k) if k is not None else math.nan,
                pad_eff=mean_of(m.pad_eff[all_rows]),
                planned_pad_eff=b.pad_eff if b.pad_eff is not None else math.nan,
            )
        )
    logged = m.bucket[m.bucket >= 0]
    length, value, start = longest_run(logged)
    first_step = int(m.step[m.bucket >= 0][start]) if length else None
    note = ""
    if not ids:
        note = "no bucket ids in the log and no data_plan.json: bucket analysis skipped."
    elif "bucket" not in m.present:
        note = "the log has no bucket ids: per-bucket numbers are empty; only the plan is shown."
    return Composition(
        rows=rows,
        longest_run=length,
        longest_run_bucket=value,
        longest_run_first_step=first_step,
        pad_eff=mean_of(m.pad_eff),
        planned_pad_eff=plan.pad_eff if plan and plan.pad_eff is not None else math.nan,
        n_buckets_seen=len(seen),
        note=note,
    )


def mean_of(x: np.ndarray) -> float:
    """Mean of the finite values, NaN when there are none."""
    values = finite(x)
    return float(values.mean()) if values.size else math.nan


# ----------------------------------------------------------------------------------------------
# Section 6: continuity, stalls, skipped steps, epochs, throughput


@dataclass
class Stall:
    step: int
    seconds: float
    typical: float
    ckpt_step: int | None  # the checkpoint save it follows, if any


@dataclass
class Continuity:
    first_step: int | None
    last_step: int | None
    missing: list[tuple[int, int]]
    n_missing: int
    missing_near_ckpt: list[tuple[int, int, int]]  # range and the checkpoint step it touches
    ckpt_steps: list[int]
    stalls: list[Stall]
    median_interval: float
    wall_seconds: float
    epoch_first: float
    epoch_last: float
    epoch_decreases: list[tuple[int, float, float]]  # step, epoch before, epoch at that step
    epoch_fractional: bool
    tok_s_median: float
    tok_s_p10: float
    tok_s_p90: float
    tok_s_cv: float
    fetch_median: float
    fetch_p95: float
    step_time_median: float
    notes: list[str] = field(default_factory=list)


def _near(step: int, marks: list[int], before: int, after: int) -> int | None:
    for mark in marks:
        if mark - before <= step <= mark + after:
            return mark
    return None


def continuity(m: Metrics, cfg: ReportConfig) -> Continuity:
    notes: list[str] = []
    if m.n == 0:
        notes.append("the log holds no step yet.")
    steps = m.step
    expected = np.arange(1, steps[-1] + 1) if m.n else np.zeros(0, dtype=np.int64)
    missing = ranges(np.setdiff1d(expected, steps))
    ckpt_steps = [int(s) for s in steps[m.ckpt]]
    near = [
        (a, b, mark)
        for a, b in missing
        if (mark := _near(a, ckpt_steps, 0, 2) or _near(b, ckpt_steps, 2, 0)) is not None
    ]
    stalls, median_interval = _stalls(m, cfg, ckpt_steps)
    time = m.time
    wall = float(np.nanmax(time) - np.nanmin(time)) if np.isfinite(time).sum() >= 2 else math.nan
    epoch = m.epoch
    ok = np.flatnonzero(np.isfinite(epoch))
    decreases = [
        (int(steps[j]), float(epoch[i]), float(epoch[j]))
        for i, j in zip(ok[:-1], ok[1:], strict=True)
        if epoch[j] < epoch[i] - 1e-9
    ]
    fractional = bool(ok.size and np.any(np.abs(epoch[ok] - np.round(epoch[ok])) > 1e-9))
    if "epoch" not in m.present:
        notes.append("epoch is not logged: epoch progression skipped.")
    elif ok.size >= 3 and not fractional:
        notes.append("epoch is logged only as whole numbers: the contract asks for a fraction.")
    if m.duplicates:
        shown = ", ".join(f"{a}–{b}" if a != b else str(a) for a, b in ranges(m.duplicates)[:5])
        notes.append(
            f"{len(m.duplicates)} step(s) were logged more than once ({shown}): a resume re-ran them; the later "
            "record is used."
        )
    for before, after in m.backward_jumps[:5]:
        notes.append(f"the log goes back from step {before} to step {after} (resume from an earlier checkpoint).")
    tok_s = m.tok_s[m.valid]
    tok_s_f = finite(tok_s)
    return Continuity(
        first_step=int(steps[0]) if m.n else None,
        last_step=int(steps[-1]) if m.n else None,
        missing=missing,
        n_missing=int(sum(b - a + 1 for a, b in missing)),
        missing_near_ckpt=near,
        ckpt_steps=ckpt_steps,
        stalls=stalls,
        median_interval=median_interval,
        wall_seconds=wall,
        epoch_first=float(epoch[ok[0]]) if ok.size else math.nan,
        epoch_last=float(epoch[ok[-1]]) if ok.size else math.nan,
        epoch_decreases=decreases,
        epoch_fractional=fractional,
        tok_s_median=quantile(tok_s_f, 0.5),
        tok_s_p10=quantile(tok_s_f, 0.1),
        tok_s_p90=quantile(tok_s_f, 0.9),
        tok_s_cv=float(tok_s_f.std() / tok_s_f.mean()) if tok_s_f.size >= 2 and tok_s_f.mean() > 0 else math.nan,
        fetch_median=quantile(m.fetch_frac, 0.5),
        fetch_p95=quantile(m.fetch_frac, 0.95),
        step_time_median=quantile(m.step_time, 0.5),
        notes=notes,
    )


def _stalls(m: Metrics, cfg: ReportConfig, ckpt_steps: list[int]) -> tuple[list[Stall], float]:
    """Wall-clock intervals between logged steps, per step, far above the typical one."""
    ok = np.flatnonzero(np.isfinite(m.time))
    if ok.size < 3:
        return [], math.nan
    dt = np.diff(m.time[ok])
    dsteps = np.maximum(np.diff(m.step[ok]), 1)
    per_step = dt / dsteps
    typical = float(np.median(per_step))
    stalls = []
    for k in np.flatnonzero((per_step > cfg.stall_factor * typical) & (dt - dsteps * typical > cfg.stall_min_seconds)):
        start, step = int(m.step[ok[k]]), int(m.step[ok[k + 1]])
        # A save that starts after step s delays the interval that ends at step s+1 (or s+2).
        ckpt = next((s for s in ckpt_steps if start - 1 <= s <= step - 1), None)
        stalls.append(Stall(step=step, seconds=float(dt[k]), typical=typical, ckpt_step=ckpt))
    return stalls, typical


# ----------------------------------------------------------------------------------------------
# Learning: block positions, flatness, resets, length dependence


@dataclass
class Reset:
    step: int
    loss: float
    best: float
    context: str


@dataclass
class Learning:
    position_latest: np.ndarray
    position_first: np.ndarray
    acc_gain_tail: float
    tail_first_step: int | None
    lr_end_share: float
    resets: list[Reset]
    length_spread: float
    length_levels: dict[int, float]  # trend-adjusted mean accuracy of each compared bucket
    length_identical: bool
    notes: list[str] = field(default_factory=list)


def learning(m: Metrics, window: np.ndarray, cfg: ReportConfig) -> Learning:
    notes = []
    with np.errstate(all="ignore"):
        latest = np.nanmean(m.acc[window], axis=0) if m.acc.shape[1] and window.size else np.zeros(0)
        early = first_window(m, cfg)
        first = np.nanmean(m.acc[early], axis=0) if m.acc.shape[1] and early.size else np.zeros(0)
    if latest.size == 0:
        notes.append("acc is not logged (or no step trained): accuracy by position skipped.")
    valid = np.flatnonzero(m.valid)
    gain, tail_first, tail = math.nan, None, valid
    if valid.size:
        cut = m.step[valid[-1]] - cfg.flat_frac * (m.step[valid[-1]] - m.step[valid[0]])
        tail = valid[m.step[valid] >= cut]
        tail_first = int(m.step[tail[0]])
        gain = _tail_gain(m, tail)
    lr = m.lr
    lr_end = (
        float(lr[np.flatnonzero(np.isfinite(lr))[-1]] / np.nanmax(lr))
        if np.isfinite(lr).any() and np.nanmax(lr) > 0
        else math.nan
    )
    levels, identical = _bucket_levels(m, tail, cfg.bucket_min_steps)
    spread = max(levels.values()) - min(levels.values()) if len(levels) >= 2 else math.nan
    if len(levels) < 2:
        notes.append(
            f"fewer than two buckets with at least {cfg.bucket_min_steps} steps in the last {cfg.flat_frac:.0%} of "
            "the run: accuracy across lengths not compared."
        )
    return Learning(
        position_latest=latest,
        position_first=first,
        acc_gain_tail=gain,
        tail_first_step=tail_first,
        lr_end_share=lr_end,
        resets=_resets(m, cfg),
        length_spread=spread,
        length_levels=levels,
        length_identical=identical,
        notes=notes,
    )


def _tail_gain(m: Metrics, tail: np.ndarray) -> float:
    """Accuracy gained across the tail, with each bucket's own level taken out when buckets are
    known (otherwise a schedule that ends on a short-context bucket would look like a plateau)."""
    buckets = m.bucket[tail]
    if (buckets >= 0).all() and np.unique(buckets).size >= 2:
        slope, _ = trend_with_groups(m.step[tail], m.acc_mean[tail], buckets)
        return slope * float(np.ptp(m.step[tail])) if math.isfinite(slope) else math.nan
    return linear_gain(m.step[tail], m.acc_mean[tail])


def _bucket_levels(m: Metrics, tail: np.ndarray, min_steps: int) -> tuple[dict[int, float], bool]:
    """Mean accuracy of each bucket with enough steps in the tail, adjusted for the trend within
    the tail, and whether the plain means are bit-identical (a logging bug rather than a model)."""
    acc = m.acc_mean
    rows = tail[(m.bucket[tail] >= 0) & np.isfinite(acc[tail])]
    ids, counts = np.unique(m.bucket[rows], return_counts=True)
    ids = [int(b) for b, n in zip(ids, counts, strict=True) if n >= min_steps]
    rows = rows[np.isin(m.bucket[rows], ids)]
    if len(ids) < 2:
        return {}, False
    identical = len({round(float(acc[rows][m.bucket[rows] == b].mean()), 12) for b in ids}) == 1
    _, levels = trend_with_groups(m.step[rows], acc[rows], m.bucket[rows])
    return levels, identical


def _resets(m: Metrics, cfg: ReportConfig) -> list[Reset]:
    """Places where the smoothed loss climbs well above its best so far, with what happened there."""
    valid = np.flatnonzero(m.valid)
    if valid.size < cfg.min_steps:
        return []
    steps, loss = m.step[valid], smooth(m.loss[valid], smooth_window(valid.size, cfg), centred=False)
    phase, _ = phase_of(m, cfg.n_phases)
    start = int(np.argmax(phase[valid] >= 1))
    best = np.minimum.accumulate(loss[start:])
    rising = loss[start:] > best * (1 + cfg.reset_rise)
    events = []
    for k in np.flatnonzero(rising & ~np.concatenate([[False], rising[:-1]]))[:5]:
        i = start + k
        events.append(
            Reset(
                step=int(steps[i]),
                loss=float(loss[i]),
                best=float(best[k]),
                context=_reset_context(m, int(steps[i]), smooth_window(valid.size, cfg)),
            )
        )
    return events


def _reset_context(m: Metrics, step: int, width: int) -> str:
    near = (m.step >= step - 2 * width) & (m.step <= step)
    what = []
    epochs = m.epoch[near]
    if np.isfinite(epochs).sum() >= 2 and np.floor(np.nanmin(epochs)) != np.floor(np.nanmax(epochs)):
        what.append(f"an epoch boundary (epoch {np.nanmin(epochs):.2f} → {np.nanmax(epochs):.2f})")
    if any(step - 2 * width <= after <= step for _, after in m.backward_jumps):
        what.append("a resume from checkpoint")
    if m.ckpt[near].any():
        what.append("a checkpoint save")
    return ", ".join(what) if what else "no epoch boundary, resume or checkpoint nearby"


# ----------------------------------------------------------------------------------------------
# One run


@dataclass
class RunAnalysis:
    run: RunRecord
    window: np.ndarray
    smooth: int
    grad: GradReport
    loss: LossDistribution
    comp: Composition
    cont: Continuity
    learn: Learning
    selector: SelectorReport | None = None  # DFlash2 runs

    @property
    def m(self) -> Metrics:
        return self.run.metrics

    def latest(self, values: np.ndarray) -> float:
        """Mean of a per-step column over the latest window."""
        return mean_of(values[self.window]) if self.window.size else math.nan


def analyse_run(run: RunRecord, cfg: ReportConfig) -> RunAnalysis:
    m = run.metrics
    window = latest_window(m, cfg)
    comp = composition(run, window)
    width = smooth_window(int(m.valid.sum()), cfg)
    return RunAnalysis(
        run=run,
        window=window,
        smooth=width,
        grad=grad_report(m, cfg),
        loss=loss_distribution(m, window, cfg),
        comp=comp,
        cont=continuity(m, cfg),
        learn=learning(m, window, cfg),
        selector=selector_report(m, window, width),
    )
