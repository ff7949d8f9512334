"""PNG plots of the training-health report (matplotlib, Agg, no pyplot state).

Each function draws one figure from the analyses and writes it atomically into the output
directory; a panel with nothing to draw says so inside the axes instead of staying blank.
Raw per-step values are thin and pale, smoothed curves bold on top of them.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from train.report.analysis import RunAnalysis
from train.report.stats import finite, smooth

__all__ = ["render_plots", "plot_file", "PER_RUN"]

PER_RUN = ("curves", "grad_norm", "loss_hist", "buckets", "timing")  # one figure per run
SHARE_COLORS = ["#08519c", "#6baed6", "#525252", "#bdbdbd"]
ORDER_STEPS = 200  # batches shown in the 'order of batches' panel
LOG_SPAN = 20.0  # max/min ratio above which a positive quantity is drawn on a log axis
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"]


def plot_file(name: str, run_index: int = 0) -> str:
    """report_NAME.png for the first run (and overlays), report_NAME_runK.png for compared run K."""
    return f"report_{name}.png" if run_index == 0 else f"report_{name}_run{run_index + 1}.png"


def render_plots(analyses: list[RunAnalysis], out_dir: Path) -> dict[str, str]:
    """Draw every plot that applies; returns {key: file name}, key = plot name or NAME_runK.

    Plots of ours left from an earlier report (e.g. of more runs) are removed, so the directory
    never shows a figure that report.md does not describe."""
    for old in out_dir.glob("report_*.png"):
        old.unlink(missing_ok=True)
    drawers = {"curves": _curves, "grad_norm": _grad, "loss_hist": _loss_hist, "buckets": _buckets, "timing": _timing}
    written = {}
    for i, a in enumerate(analyses):
        for name in PER_RUN:
            key = name if i == 0 else f"{name}_run{i + 1}"
            written[key] = _save(drawers[name](a), out_dir / plot_file(name, i))
    written["positions"] = _save(_positions(analyses), out_dir / plot_file("positions"))
    if len(analyses) > 1:
        written["compare"] = _save(_compare(analyses), out_dir / plot_file("compare"))
    return written


def _save(fig: Figure, path: Path) -> str:
    FigureCanvasAgg(fig)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
    return path.name


def _nothing(ax: Axes, why: str) -> None:
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, fontsize=10, color="0.4", wrap=True)


def _y_scale(ax: Axes, values: np.ndarray) -> str:
    """Log scale when the values span more than LOG_SPAN (a collapse or a stall must stay visible
    next to normal values), linear otherwise; log labels read 0.2, 0.5, 1 rather than 2×10⁻¹."""
    v = finite(np.asarray(values, dtype=np.float64))
    v = v[v > 0]
    if v.size < 2 or v.max() / v.min() < LOG_SPAN:
        ax.set_ylim(bottom=0)  # a linear axis from zero shows how large a change is
        return "linear"
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda x, _: f"{x:g}" if f"{x:.0e}"[0] in "25" else ""))
    return "log"


def _raw_and_smooth(ax: Axes, x: np.ndarray, y: np.ndarray, window: int, color: str, label: str) -> bool:
    ok = np.isfinite(x) & np.isfinite(y)
    if not ok.any():
        return False
    marker = "o" if ok.sum() < 5 else None  # a line through one point is invisible
    ax.plot(x[ok], y[ok], color=color, lw=0.6, alpha=0.3, label=f"{label} raw")
    ax.plot(
        x[ok], smooth(y[ok], window), color=color, lw=2.0, marker=marker, label=f"{label} smoothed ({window} steps)"
    )
    return True


# ----------------------------------------------------------------------------------------------


def _curves(a: RunAnalysis) -> Figure:
    m = a.m
    fig = Figure(figsize=(10, 9), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True)
    fig.suptitle(f"{a.run.name}: loss, accuracy and τ over steps")
    panels = [
        (axes[0], [(m.loss, "loss", COLORS[0])], "loss (weighted CE)"),
        (
            axes[1],
            [(m.acc_mean, "acc, mean of positions", COLORS[2])]
            + ([(m.acc[:, 0], "acc @ pos 1", COLORS[3])] if m.acc.shape[1] else []),
            "accuracy",
        ),
        (
            axes[2],
            [(m.tau, "τ" + (", unary top-1" if a.selector else ""), COLORS[1])]
            + ([(1 + m.selector_streak, "τ, DFlash2 selector's walk", COLORS[4])] if a.selector else []),
            "τ = 1 + mean accepted streak",
        ),
    ]
    valid = m.valid
    for ax, series, ylabel in panels:
        drawn = [
            _raw_and_smooth(ax, m.step[valid].astype(float), y[valid], a.smooth, color, label)
            for y, label, color in series
        ]
        if any(drawn):
            ax.legend(loc="best", fontsize=8)
        else:
            _nothing(ax, f"no {ylabel} logged")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        for s in m.skips[:50]:
            ax.axvline(s["step"], color="red", alpha=0.3, lw=0.8)
    axes[1].set_ylim(0, 1)
    axes[-1].set_xlabel("step" + (" (red lines: skipped non-finite steps)" if m.skips else ""))
    return fig


def _compare(analyses: list[RunAnalysis]) -> Figure:
    fig = Figure(figsize=(12, 9), layout="constrained")
    axes = fig.subplots(3, 2, sharex="col")
    fig.suptitle("runs overlaid (smoothed): at equal steps (left) and at equal tokens (right)")
    for col, axis in enumerate(("step", "tokens")):
        for row, (name, ylabel) in enumerate(
            (("loss", "loss"), ("acc_mean", "accuracy (mean of positions)"), ("tau", "τ"))
        ):
            ax = axes[row, col]
            drawn = False
            for i, a in enumerate(analyses):
                m = a.m
                x = (m.step.astype(float) if axis == "step" else m.tokens)[m.valid]
                y = (m.acc_mean if name == "acc_mean" else m.cols[name])[m.valid]
                ok = np.isfinite(x) & np.isfinite(y)
                if ok.any():
                    ax.plot(x[ok], smooth(y[ok], a.smooth), color=COLORS[i % len(COLORS)], lw=1.8, label=a.run.name)
                    drawn = True
            if drawn:
                ax.legend(fontsize=8, loc="best")
            else:
                _nothing(ax, f"no {ylabel} against {axis}")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[-1, col].set_xlabel("step" if axis == "step" else "tokens seen (real, cumulative)")
    return fig


def _positions(analyses: list[RunAnalysis]) -> Figure:
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    drawn = False
    for i, a in enumerate(analyses):
        latest = a.learn.position_latest
        if latest.size:
            ax.plot(
                np.arange(1, latest.size + 1),
                latest,
                "o-",
                color=COLORS[i % len(COLORS)],
                lw=1.8,
                label=f"{a.run.name}: latest {a.window.size} steps",
            )
            drawn = True
    first = analyses[0].learn.position_first
    if first.size:
        ax.plot(
            np.arange(1, first.size + 1),
            first,
            "s--",
            color="0.5",
            lw=1.2,
            label=f"{analyses[0].run.name}: first {analyses[0].window.size} steps",
        )
    if drawn:
        ax.legend(fontsize=8)
        ax.set_xticks(np.arange(1, analyses[0].learn.position_latest.size + 1))
    else:
        _nothing(ax, "no accuracy logged")
    ax.set_ylim(0, 1)
    ax.set_xlabel("block position k (predicts the token at anchor + k)")
    ax.set_ylabel("accuracy")
    ax.set_title("accuracy by block position")
    ax.grid(alpha=0.3)
    return fig


def _grad(a: RunAnalysis) -> Figure:
    m, g = a.m, a.grad
    fig = Figure(figsize=(10, 8), layout="constrained")
    top, bottom = fig.subplots(2, 1)
    fig.suptitle(f"{a.run.name}: gradient norm before clipping")
    ok = np.isfinite(m.grad_norm) & (m.grad_norm > 0)
    if ok.any():
        x, y = m.step[ok].astype(float), m.grad_norm[ok]
        top.plot(x, y, color=COLORS[0], lw=0.6, alpha=0.3, label="raw")
        top.plot(x, smooth(y, a.smooth), color=COLORS[0], lw=2.0, label=f"smoothed ({a.smooth} steps)")
        clipped = ok & m.clipped
        if clipped.any():
            top.plot(m.step[clipped], m.grad_norm[clipped], "o", ms=3, color=COLORS[4], label="clipped steps")
        for p in g.phases[1:]:
            if p.first_step <= p.last_step:
                top.axvline(p.first_step, color="0.7", lw=0.6, ls=":")
        if g.warmup_end_step is not None:
            top.axvline(
                g.warmup_end_step, color=COLORS[1], lw=1, ls="--", label=f"warm-up end (step {g.warmup_end_step})"
            )
        top_scale = _y_scale(top, y)
        top.legend(fontsize=8)
    else:
        top_scale = "linear"
        _nothing(top, "no finite grad_norm logged")
    top.set_xlabel("step (dotted lines: phase boundaries)")
    top.set_ylabel(f"grad norm ({top_scale} scale)")
    top.grid(alpha=0.3, which="both")
    phases = [p for p in g.phases if p.n]
    if phases:
        idx = np.array([p.index for p in phases])
        # Markers, not bars: on a log axis a bar's length depends on where the axis happens to start.
        bottom.plot(idx, [p.grad_median for p in phases], "o-", color=COLORS[0], lw=2, label="median")
        bottom.plot(idx, [p.grad_p95 for p in phases], "v", color=COLORS[1], label="p95")
        bottom.plot(idx, [p.grad_max for p in phases], "^", color="k", label="max")
        bottom_scale = _y_scale(bottom, np.array([[p.grad_median, p.grad_max] for p in phases]).ravel())
        bottom.set_ylabel(f"grad norm ({bottom_scale} scale)")
        share = bottom.twinx()
        share.bar(
            idx, [100 * p.clipped_share for p in phases], 0.5, color=COLORS[4], alpha=0.3, label="clipped steps (%)"
        )
        share.set_ylabel("clipped steps (%)")
        share.set_ylim(0, 100)
        bottom.set_zorder(share.get_zorder() + 1)
        bottom.patch.set_visible(False)
        handles = bottom.get_legend_handles_labels()
        extra = share.get_legend_handles_labels()
        fig.legend(handles[0] + extra[0], handles[1] + extra[1], fontsize=8, loc="outside lower center", ncol=4)
        bottom.set_title(
            f"by phase (tenth of the run): late/early median ratio {g.ratio:.2f}"
            if math.isfinite(g.ratio)
            else "by phase"
        )
    else:
        _nothing(bottom, "no phase holds a finite grad norm")
    bottom.set_xticks(np.arange(1, len(g.phases) + 1))
    bottom.set_xlabel("phase")
    bottom.grid(alpha=0.3, which="both")
    return fig


def _loss_hist(a: RunAnalysis) -> Figure:
    d, m = a.loss, a.m
    fig = Figure(figsize=(11, 5), layout="constrained")
    ax = fig.subplots()
    loss = m.loss[a.window]
    buckets = m.bucket[a.window]
    if loss.size == 0:
        _nothing(ax, "no finite loss in the latest window")
        return fig
    bins = np.histogram_bin_edges(loss, bins=min(40, max(5, loss.size // 5)))
    groups = sorted(set(int(b) for b in buckets))
    ax.hist(
        [loss[buckets == b] for b in groups],
        bins=bins,
        stacked=True,
        color=[COLORS[(b + 2) % len(COLORS)] if b >= 0 else "0.6" for b in groups],
        label=[f"bucket {b}" if b >= 0 else "bucket unknown" for b in groups],
        alpha=0.85,
    )
    if d.mixture is not None:
        xs = np.linspace(bins[0], bins[-1], 300)
        width = bins[1] - bins[0]
        for w, mu, sd in zip(d.mixture.weights, d.mixture.means, d.mixture.sds, strict=True):
            ax.plot(
                xs,
                loss.size * width * w * np.exp(-0.5 * ((xs - mu) / sd) ** 2) / (sd * math.sqrt(2 * math.pi)),
                "k--",
                lw=1.2,
            )
        ax.plot([], [], "k--", label=f"2-component mixture fit (separation D = {d.mixture.separation:.1f})")
    for value, label, style in (
        (d.mean, "mean", "-"),
        (d.median, "median", ":"),
        (d.p10, "p10", "-."),
        (d.p90, "p90", "-."),
    ):
        ax.axvline(value, color=COLORS[1], ls=style, lw=1.2, label=f"{label} {value:.3g}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: the tails matter
    ax.set_xlabel("loss per step")
    ax.set_ylabel("steps")
    ax.set_title(
        f"{a.run.name}: loss over the last {loss.size} trained steps ({'bimodal' if d.bimodal else 'not bimodal'}; "
        f"bimodality coeff. {d.bc:.2f})"
    )
    ax.grid(alpha=0.3)
    return fig


def _buckets(a: RunAnalysis) -> Figure:
    rows = a.comp.rows
    fig = Figure(figsize=(12, 8), layout="constrained")
    (shares, acc), (loss, order) = fig.subplots(2, 2)
    fig.suptitle(f"{a.run.name}: length buckets")
    if not rows:
        for ax in (shares, acc, loss):
            _nothing(ax, "no bucket ids logged and no data_plan.json")
    else:
        x = np.arange(len(rows))
        labels = [f"{r.id}\nEMPTY" if r.empty else str(r.id) for r in rows]
        series = [
            ("batches (logged)", [r.batch_share for r in rows]),
            ("batches (planned)", [r.planned_share for r in rows]),
            ("samples (plan)", [r.sample_share for r in rows]),
            ("tokens (plan)", [r.token_share for r in rows]),
        ]
        width = 0.2
        # Greys and blues here: the bucket colours of the other panels mean buckets, these mean quantities.
        for i, ((label, values), color) in enumerate(zip(series, SHARE_COLORS, strict=True)):
            shares.bar(
                x + (i - 1.5) * width,
                [100 * v if math.isfinite(v) else 0 for v in values],
                width,
                label=label + ("" if any(math.isfinite(v) for v in values) else ": unknown"),
                color=color,
            )
        shares.set_xticks(x, labels)
        shares.set_ylabel("share (%)")
        shares.set_xlabel("bucket")
        shares.set_title("share of batches, samples and tokens")
        shares.legend(fontsize=8)
        for ax, name, ylabel in ((acc, "acc", "accuracy (mean of positions)"), (loss, "loss", "loss")):
            values = [getattr(r, name) for r in rows]
            ax.bar(
                x,
                [v if math.isfinite(v) else 0 for v in values],
                color=[COLORS[(r.id + 2) % len(COLORS)] for r in rows],
            )
            for xi, r, v in zip(x, rows, values, strict=True):
                ax.text(
                    xi,
                    v if math.isfinite(v) else 0,
                    f"n={r.n_window}" if r.n_window else "EMPTY",
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
            ax.set_xticks(x, labels)
            ax.set_xlabel("bucket")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{ylabel} by bucket, latest {a.window.size} steps")
            finite_values = finite(np.array(values))
            if finite_values.size:
                ax.set_ylim(0, finite_values.max() * 1.15)
    for ax in (shares, acc, loss):
        ax.grid(alpha=0.3, axis="y")
    m = a.m
    seen = np.flatnonzero(m.bucket >= 0)
    if seen.size:
        # Show the stretch around the longest same-bucket run: the worst place of the schedule.
        run_at = int(np.searchsorted(m.step[seen], a.comp.longest_run_first_step or m.step[seen[0]]))
        lo = max(0, min(run_at - ORDER_STEPS // 4, seen.size - ORDER_STEPS))
        shown = seen[lo : lo + ORDER_STEPS]
        for b in sorted(set(int(v) for v in m.bucket[shown])):
            ticks = shown[m.bucket[shown] == b]
            order.plot(m.step[ticks], m.bucket[ticks], "|", ms=12, mew=1.5, color=COLORS[(b + 2) % len(COLORS)])
        first, last = int(m.step[shown[0]]), int(m.step[shown[-1]])
        if a.comp.longest_run_first_step is not None:
            run_end = min(a.comp.longest_run_first_step + a.comp.longest_run - 1, last)
            order.axvspan(a.comp.longest_run_first_step - 0.5, run_end + 0.5, color="0.85", zorder=0)
        ids = sorted(set(int(b) for b in m.bucket[seen]) | {r.id for r in rows})
        order.set_yticks(ids)
        order.set_ylim(min(ids) - 0.5, max(ids) + 0.5)
        order.set_xlim(first - 1, last + 1)
        order.set_title(
            f"order of batches, steps {first}–{last} (one tick per batch;\ngrey: the longest same-bucket run, "
            f"{a.comp.longest_run} batches)",
            fontsize=10,
        )
    else:
        _nothing(order, "no bucket ids logged")
    order.set_xlabel("step")
    order.set_ylabel("bucket")
    order.grid(alpha=0.3)
    return fig


def _timing(a: RunAnalysis) -> Figure:
    m, c = a.m, a.cont
    fig = Figure(figsize=(10, 9), layout="constrained")
    interval, speed, epoch = fig.subplots(3, 1, sharex=True)
    fig.suptitle(f"{a.run.name}: wall clock, throughput, epoch")
    ok = np.flatnonzero(np.isfinite(m.time))
    if ok.size >= 2:
        interval.plot(
            m.step[ok[1:]], np.diff(m.time[ok]), color=COLORS[0], lw=0.8, label="seconds between consecutive log lines"
        )
        if c.stalls:
            interval.plot(
                [s.step for s in c.stalls], [s.seconds for s in c.stalls], "o", color=COLORS[1], label="stall"
            )
        for i, s in enumerate(c.ckpt_steps[:100]):
            interval.axvline(s, color="0.6", ls=":", lw=0.8, label="checkpoint save" if i == 0 else None)
        scale = _y_scale(interval, np.diff(m.time[ok]))
        interval.set_ylabel(f"interval (s, {scale} scale)")
        interval.legend(fontsize=8)
    else:
        _nothing(interval, "fewer than two steps with a time")
        interval.set_ylabel("interval (s)")
    interval.grid(alpha=0.3, which="both")
    if not _raw_and_smooth(speed, m.step[m.valid].astype(float), m.tok_s[m.valid], a.smooth, COLORS[2], "tok/s"):
        _nothing(speed, "tok_s not logged")
    else:
        speed.legend(fontsize=8)
        speed.set_ylim(bottom=0)
    speed.set_ylabel("real tokens / s")
    speed.grid(alpha=0.3)
    fine = np.isfinite(m.epoch)
    if fine.any():
        epoch.plot(m.step[fine], m.epoch[fine], color=COLORS[3], lw=1.5, label="epoch")
        for i, (lo, hi) in enumerate(c.missing[:100]):
            epoch.axvspan(lo - 0.5, hi + 0.5, color=COLORS[1], alpha=0.25, label="missing steps" if i == 0 else None)
        if m.skips:
            epoch.plot(
                [s["step"] for s in m.skips],
                np.interp([s["step"] for s in m.skips], m.step[fine], m.epoch[fine]),
                "x",
                color=COLORS[1],
                label="skipped step",
            )
        epoch.legend(fontsize=8)
    else:
        _nothing(epoch, "epoch not logged")
    epoch.set_ylabel("epoch")
    epoch.set_xlabel("step")
    epoch.grid(alpha=0.3)
    return fig
