"""report.md and the one-screen summary of the training-health report.

Every section writes at least one line: a table with no rows is replaced by a sentence that says
why it is empty, and a bucket without steps is a row marked EMPTY, never a missing row.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

from train.report.alarms import Alarm, not_judged
from train.report.analysis import Phase, RunAnalysis
from train.report.compare import CommonPoint, ConfigDiff
from train.report.config import ReportConfig, config_rows

__all__ = ["render_markdown", "render_summary", "fmt", "table"]


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    if abs(x) >= 1e3:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"


def pct(x: float) -> str:
    return f"{100 * x:.1f}%" if math.isfinite(x) else "—"


def table(headers: list[str], rows: list[list[str]], empty: str) -> list[str]:
    """A markdown table, or `empty` in words when there is no row."""
    assert empty, "every table says why it is empty"
    if not rows:
        return [f"*{empty}*", ""]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out + [""]


def image(name: str, caption: str, plots: dict[str, str]) -> list[str]:
    if name in plots:
        return [f"![{caption}]({plots[name]})", ""]
    return [f"*(no plot {name}: plots=false)*", ""]


# ----------------------------------------------------------------------------------------------


def render_markdown(
    analyses: list[RunAnalysis],
    diffs: list[ConfigDiff],
    points: list[CommonPoint],
    alarms: list[Alarm],
    cfg: ReportConfig,
    plots: dict[str, str],
    command: str,
) -> str:
    first = analyses[0]
    lines = [f"# Training-health report: {first.run.name}", ""]
    lines += [f"Generated {datetime.now(UTC):%Y-%m-%d %H:%M UTC} by `{command}`.", ""]
    lines += [
        "Runs: "
        + ", ".join(
            f"`{a.run.path}`" + (" (first: compared against, plotted in detail)" if a is first else "")
            for a in analyses
        ),
        "",
    ]
    lines += ["## Summary", "", "```", *render_summary(analyses, alarms, cfg).splitlines(), "```", ""]
    lines += _alarms_section(analyses, alarms, cfg)
    lines += _reading_notes(analyses)
    lines += _curves_section(analyses, diffs, points, plots)
    for title, part in (
        ("2. Gradient norm by phase", _grad),
        ("3. Loss distribution over the latest window", _loss),
        ("4. By length bucket (latest window)", _buckets),
        ("5. Batch composition", _composition),
        ("6. Continuity, stalls, skipped steps, epochs, throughput", _continuity),
    ):
        lines += [f"## {title}", ""]
        for i, a in enumerate(analyses):
            if len(analyses) > 1:
                lines += [f"### {a.run.name}", ""]
            lines += part(a, cfg, _plots_of(plots, i))
    lines += _selector_section(analyses)
    lines += ["## Thresholds used", "", "Change any of them with `key=value` after the run directories.", ""]
    lines += table(["key", "value", "meaning"], [[k, f"`{v}`", h] for k, v, h in config_rows(cfg)], "no setting")
    return "\n".join(lines) + "\n"


def _plots_of(plots: dict[str, str], run_index: int) -> dict[str, str]:
    """The per-run plots of one run, under their plain names (`grad_norm_run2` -> `grad_norm`)."""
    if run_index == 0:
        return {key: file for key, file in plots.items() if "_run" not in key}
    suffix = f"_run{run_index + 1}"
    return {key.removesuffix(suffix): file for key, file in plots.items() if key.endswith(suffix)}


def _alarms_section(analyses: list[RunAnalysis], alarms: list[Alarm], cfg: ReportConfig) -> list[str]:
    lines = ["## Alarms", ""]
    if not alarms:
        lines += ["No alarm fired.", ""]
    for i, alarm in enumerate(alarms, 1):
        lines += [
            f"### {i}. {alarm.title} — {alarm.run} (`{alarm.code}`)",
            "",
            f"- **Evidence:** {alarm.evidence}",
            f"- **Usual cause:** {alarm.cause}",
            "",
        ]
    skipped = [(a.run.name, not_judged(a, cfg)) for a in analyses if not_judged(a, cfg)]
    for name, why in skipped:
        lines += [f"- Not judged for {name}: {why}"]
    return lines + ([""] if skipped else [])


def _reading_notes(analyses: list[RunAnalysis]) -> list[str]:
    lines = ["## Reading notes", ""]
    for a in analyses:
        notes = a.run.notes or ["every file was read completely."]
        lines += [f"- **{a.run.name}**: " + " ".join(notes)]
    return lines + [""]


def _curves_section(
    analyses: list[RunAnalysis], diffs: list[ConfigDiff], points: list[CommonPoint], plots: dict[str, str]
) -> list[str]:
    lines = ["## 1. Loss, accuracy and τ", ""]
    lines += [
        "Latest window = the last trained steps used for every 'latest' number below; accuracy = mean over block "
        "positions.",
        "",
    ]
    rows = []
    for a in analyses:
        m = a.m
        rows.append(
            [
                a.run.name,
                str(m.n),
                str(int(m.step[-1])) if m.n else "—",
                fmt(a.cont.epoch_last),
                str(a.window.size),
                fmt(a.latest(m.loss)),
                fmt(a.latest(m.acc_mean)),
                fmt(a.latest(m.acc[:, 0]) if m.acc.shape[1] else math.nan),
                fmt(a.latest(m.tau)),
                str(a.smooth),
            ]
        )
    lines += table(
        [
            "run",
            "steps logged",
            "last step",
            "epoch",
            "latest window (steps)",
            "loss",
            "accuracy",
            "acc @ pos 1",
            "τ",
            "smoothing (steps)",
        ],
        rows,
        "no run",
    )
    for i, a in enumerate(analyses):
        lines += image("curves", f"{a.run.name}: loss, accuracy and tau over steps", _plots_of(plots, i))
    if len(analyses) > 1:
        lines += ["### Comparison", ""]
        for p in points:
            at = f"step {p.at:.0f}" if p.axis == "step" else f"{p.at:,.0f} tokens"
            lines += [
                f"At equal {p.axis}{'s' if p.axis == 'step' else ''} ({at}, the furthest every run reached; mean "
                "of the last smoothing window before it):",
                "",
            ]
            lines += table(
                ["run", "loss", "accuracy", "τ"],
                [[r, fmt(l), fmt(c), fmt(t)] for r, l, c, t in p.values],
                p.note or "no run reached it",
            )
        lines += image("compare", "runs overlaid at equal steps and at equal tokens", plots)
        lines += ["Config differences against the first run:", ""]
        for d in diffs:
            rows = [
                [k, f"`{x!r}`", f"`{y!r}`", "unexpected" if k in d.unexpected else "ablated/ignored"]
                for k, x, y in d.differing
            ]
            lines += [f"**{d.run}**" + (f": {d.note}" if d.note else ""), ""]
            lines += table(
                ["key", "first run", d.run, "status"], rows, "no difference" if not d.note else "not compared"
            )
    else:
        lines += ["*One run: nothing to overlay (give several run directories to compare them).*", ""]
    lines += ["### Accuracy by block position", ""]
    width = max((a.learn.position_latest.size for a in analyses), default=0)
    rows = [
        [f"{a.run.name} (latest {a.window.size} steps)"]
        + [fmt(v, 2) for v in a.learn.position_latest]
        + ["—"] * (width - a.learn.position_latest.size)
        for a in analyses
        if a.learn.position_latest.size
    ]
    if analyses[0].learn.position_first.size:
        rows.append(
            [f"{analyses[0].run.name} (first {analyses[0].window.size} steps)"]
            + [fmt(v, 2) for v in analyses[0].learn.position_first]
            + ["—"] * (width - analyses[0].learn.position_first.size)
        )
    lines += table(
        ["run"] + [str(k) for k in range(1, width + 1)], rows, "no accuracy logged: accuracy by position skipped"
    )
    lines += image("positions", "accuracy by block position", plots)
    return lines


def _selector_section(analyses: list[RunAnalysis]) -> list[str]:
    """DFlash2 runs only: the selector beside the unary top-1 (train/selector_loss.py defines every number)."""
    runs = [a for a in analyses if a.selector is not None]
    if not runs:
        return []
    lines = ["## 7. DFlash2 selector", ""]
    lines += [
        "Latest window; the streaks are mean accepted lengths per block: the unary top-1's, and the served "
        "selector walk's. Coverage: share of the loss weight whose label is among the candidates (selector loss / "
        "coverage = mean cross-entropy over the covered rows). Gain: served minus unary streak, mean over the "
        "later half of the run.",
        "",
    ]
    rows = [
        [
            a.run.name,
            fmt(s.loss),
            fmt(s.weight),
            fmt(s.coverage),
            fmt(s.accuracy),
            fmt(s.unary_streak),
            fmt(s.streak),
            f"{s.gain_later:+.3f}" if math.isfinite(s.gain_later) else "—",
            f"{fmt(s.coverage_best)} (step {s.coverage_best_step})",
        ]
        for a in runs
        for s in [a.selector]
    ]
    headers = ["run", "selector loss", "weight", "coverage", "selector acc", "unary streak", "selector streak"]
    return lines + table(headers + ["gain (later half)", "best coverage"], rows, "no selector logged")


def _span(p: Phase) -> str:
    return f"{p.first_step}–{p.last_step}" if p.first_step <= p.last_step else "no step number"


def _grad(a: RunAnalysis, cfg: ReportConfig, plots: dict[str, str]) -> list[str]:
    g = a.grad
    if not any(p.n for p in g.phases):
        return [f"*{g.note or 'no step with a finite grad norm: gradient analysis skipped.'}*", ""]
    lines = [f"*{g.note}*", ""] if g.note else []
    rows = [
        [str(p.index), _span(p), str(p.n), fmt(p.grad_median), fmt(p.grad_p95), fmt(p.grad_max), pct(p.clipped_share)]
        if p.n
        else [str(p.index), _span(p), "0", "EMPTY: no step with a finite grad norm", "", "", ""]
        for p in g.phases
    ]
    lines += table(["phase", "steps", "n", "median", "p95", "max", "clipped"], rows, "no phase")
    lines += [
        f"Late/early median ratio: **{fmt(g.ratio)}** (alarm below {cfg.grad_collapse_ratio}). "
        + (
            f"Warm-up ends at step {g.warmup_end_step} (peak lr); clipped after it: {pct(g.clipped_after_warmup)}."
            if g.warmup_end_step is not None
            else "lr not logged: warm-up end unknown."
        ),
        "",
    ]
    return lines + image("grad_norm", "gradient norm by step and phase", plots)


def _loss(a: RunAnalysis, cfg: ReportConfig, plots: dict[str, str]) -> list[str]:
    d = a.loss
    if d.n == 0:
        return [f"*{d.note}*", ""]
    lines = [f"Steps {d.first_step}–{int(a.m.step[a.window[-1]])} ({d.n} trained steps).", ""]
    lines += table(
        ["mean", "median", "p10", "p90", "bimodality coeff.", "modes (mean, share)", "separation D", "bucket explains"],
        [
            [
                fmt(d.mean),
                fmt(d.median),
                fmt(d.p10),
                fmt(d.p90),
                fmt(d.bc, 2),
                f"{fmt(d.mixture.means[0])} ({pct(d.mixture.weights[0])}), {fmt(d.mixture.means[1])} "
                f"({pct(d.mixture.weights[1])})"
                if d.mixture
                else "—",
                fmt(d.mixture.separation, 2) if d.mixture else "—",
                pct(d.eta2),
            ]
        ],
        "no loss",
    )
    verdict = "**bimodal**" if d.bimodal else "not bimodal"
    lines += [
        f"Verdict: {verdict} (needs coefficient > {cfg.bimodality_bc}, two components better by BIC, separation > "
        f"{cfg.bimodality_separation}, smaller mode ≥ {pct(cfg.bimodality_min_weight)}).",
        "",
    ]
    if d.note:
        lines += [f"*{d.note}*", ""]
    split = {b: [str(b), str(n), fmt(mu), pct(s)] for b, n, mu, s in d.by_bucket}
    if split:
        for r in a.comp.rows:
            split.setdefault(r.id, [str(r.id), "0", "EMPTY: no step in the latest window", ""])
    lines += table(
        ["bucket", "steps", "mean loss", "share in the high mode"],
        [split[b] for b in sorted(split)],
        "per-bucket split not available (see the note above)",
    )
    return lines + image("loss_hist", "loss distribution over the latest window", plots)


def _buckets(a: RunAnalysis, cfg: ReportConfig, plots: dict[str, str]) -> list[str]:
    c = a.comp
    lines = [f"*{c.note}*", ""] if c.note and c.rows else []
    rows = []
    for r in c.rows:
        if r.empty:
            rows.append([r.label, "0", "0", "EMPTY: no batch from this bucket in the whole log", "", "", ""])
        elif r.n_window == 0:
            rows.append(
                [r.label, "0", str(r.n_total), f"EMPTY in the latest window ({r.n_total} step(s) earlier)", "", "", ""]
            )
        else:
            rows.append([r.label, str(r.n_window), str(r.n_total), fmt(r.loss), fmt(r.acc), fmt(r.acc1), fmt(r.streak)])
    lines += table(
        ["bucket", "steps (window)", "steps (all)", "loss", "accuracy", "acc @ pos 1", "streak"],
        rows,
        c.note or "no bucket",
    )
    spread = a.learn.length_spread
    levels = ", ".join(f"bucket {b} {fmt(v)}" for b, v in a.learn.length_levels.items())
    left_out = [str(r.id) for r in c.rows if r.id not in a.learn.length_levels]
    if left_out:
        levels += f" (left out, fewer than {cfg.bucket_min_steps} steps there: bucket {', '.join(left_out)})"
    lines += [
        f"Accuracy across lengths, from step {a.learn.tail_first_step} to the end, adjusted for the trend over "
        f"those steps: {levels}; spread {fmt(spread)} (alarm below {cfg.length_min_spread})."
        if math.isfinite(spread)
        else "Accuracy across lengths: " + " ".join(n for n in a.learn.notes if "bucket" in n),
        "",
    ]
    return lines + image("buckets", "buckets: shares, loss and accuracy, order of batches", plots)


def _composition(a: RunAnalysis, cfg: ReportConfig, plots: dict[str, str]) -> list[str]:  # noqa: ARG001 (a section: one signature)
    c = a.comp
    plan = a.run.plan
    lines = (
        []
        if plan
        else [
            "*data_plan.json is missing: planned shares, sample and token shares and planned padding efficiency "
            "are not shown.*",
            "",
        ]
    )
    if plan and plan.not_found:
        lines += [f"*data_plan.json has no {', '.join(plan.not_found)}: those columns show —.*", ""]
    rows = [
        [
            r.label + (" (EMPTY)" if r.empty else ""),
            str(r.n_total),
            pct(r.batch_share),
            pct(r.planned_share),
            pct(r.sample_share),
            pct(r.token_share),
            fmt(r.pad_eff),
            fmt(r.planned_pad_eff),
        ]
        for r in c.rows
    ]
    lines += table(
        [
            "bucket",
            "batches",
            "share of batches",
            "planned share",
            "share of samples",
            "share of tokens",
            "pad eff",
            "planned pad eff",
        ],
        rows,
        c.note or "no bucket",
    )
    if c.longest_run:
        lines += [
            f"Longest run of same-bucket batches: **{c.longest_run}** (bucket {c.longest_run_bucket}, from step "
            f"{c.longest_run_first_step}; alarm above {cfg.max_same_bucket_run})."
        ]
    else:
        lines += ["Longest run of same-bucket batches: not available (no bucket ids logged)."]
    if plan and plan.longest_run is not None:
        lines[-1] += f" The plan's first epoch has a longest run of {plan.longest_run}."
    budget = f"; token budget {plan.token_budget:g}" if plan and plan.token_budget else ""
    lines += [f"Padding efficiency: {fmt(c.pad_eff)} logged, {fmt(c.planned_pad_eff)} planned{budget}."]
    if plan and plan.excluded:
        lines += [
            "Samples left out by the data stream: " + ", ".join(f"{k}: {v}" for k, v in plan.excluded.items()) + "."
        ]
    lines += [""]
    return lines


def _continuity(a: RunAnalysis, cfg: ReportConfig, plots: dict[str, str]) -> list[str]:
    c = a.cont
    lines = [f"- {n}" for n in c.notes]
    if c.first_step is None:
        return lines + [""]
    shown = ", ".join(f"{x}–{y}" if x != y else str(x) for x, y in c.missing[:20]) + (
        " ..." if len(c.missing) > 20 else ""
    )
    lines += [
        f"- Steps {c.first_step}–{c.last_step}: {a.m.n} logged, {c.n_missing} missing"
        + (f" ({shown})" if c.missing else "")
        + "."
    ]
    lines += [
        "- Checkpoint saves after step(s): "
        f"{', '.join(map(str, c.ckpt_steps[:20]))}{' ...' if len(c.ckpt_steps) > 20 else ''}."
        if c.ckpt_steps
        else "- No checkpoint save flagged in the log."
    ]
    lines += [
        f"- Wall clock: {fmt(c.wall_seconds / 60)} min; typical interval {fmt(c.median_interval)} s per step; "
        f"median step_time {fmt(c.step_time_median)} s."
        if math.isfinite(c.wall_seconds)
        else "- Wall clock: not measured (fewer than two steps with a time)."
    ]
    lines += [
        f"- Throughput: median {fmt(c.tok_s_median)} tok/s (p10 {fmt(c.tok_s_p10)}, p90 {fmt(c.tok_s_p90)}, "
        f"coefficient of variation {fmt(c.tok_s_cv, 2)}); waiting for data: median {pct(c.fetch_median)}, p95 "
        f"{pct(c.fetch_p95)}."
        if math.isfinite(c.tok_s_median)
        else "- Throughput: tok_s not logged (or no step trained)."
    ]
    if math.isfinite(c.epoch_last):
        decreases = f"; it went down {len(c.epoch_decreases)} time(s)" if c.epoch_decreases else "; monotone"
        lines += [
            f"- Epoch: {fmt(c.epoch_first)} → {fmt(c.epoch_last)}{decreases}; "
            + ("fractional." if c.epoch_fractional else "not fractional (or too short to tell).")
        ]
    lines += [""]
    lines += ["Stalls:", ""]
    lines += table(
        ["before step", "seconds", "typical per step", "after checkpoint at"],
        [[str(s.step), fmt(s.seconds), fmt(s.typical), str(s.ckpt_step or "—")] for s in c.stalls],
        f"none (no interval above {cfg.stall_factor}× the typical one and {cfg.stall_min_seconds} s longer)"
        if math.isfinite(c.median_interval)
        else "not measured: fewer than 3 steps with a time",
    )
    lines += ["Skipped non-finite steps:", ""]
    lines += table(
        ["step", "reason", "samples"],
        [[str(s["step"]), str(s["reason"]), ", ".join(map(str, s["sample_ids"][:4])) or "—"] for s in a.m.skips],
        "none",
    )
    lines += ["Throughput by phase (median tok/s of trained steps):", ""]
    by_phase = (
        [[fmt(p.tok_s_median) if math.isfinite(p.tok_s_median) else "EMPTY" for p in a.grad.phases]]
        if math.isfinite(c.tok_s_median)
        else []
    )
    lines += table([str(p.index) for p in a.grad.phases], by_phase, "tok_s not logged: no throughput by phase")
    return lines + image("timing", "wall clock, throughput and epoch over steps", plots)


# ----------------------------------------------------------------------------------------------


def render_summary(analyses: list[RunAnalysis], alarms: list[Alarm], cfg: ReportConfig) -> str:
    """At most a screen: one block per run, then the alarms, one line each."""
    lines = []
    for a in analyses:
        m, c = a.m, a.cont
        if m.n == 0:
            lines += [f"{a.run.name}: no step logged yet."]
            continue
        lines += [
            f"{a.run.name}: steps {c.first_step}–{c.last_step}, epoch {fmt(c.epoch_last)}, "
            f"{fmt(c.wall_seconds / 60)} min",
            f"  latest {a.window.size} steps: loss {fmt(a.latest(m.loss))}  acc {fmt(a.latest(m.acc_mean))}  acc@1 "
            f"{fmt(a.latest(m.acc[:, 0]) if m.acc.shape[1] else math.nan)}  τ {fmt(a.latest(m.tau))}",
            f"  grad norm late/early {fmt(a.grad.ratio)}  clipped after warm-up {pct(a.grad.clipped_after_warmup)} "
            f" |  buckets {len(a.comp.rows)} (empty: "
            f"{', '.join(str(r.id) for r in a.comp.rows if r.empty) or 'none'}), longest same-bucket run "
            f"{a.comp.longest_run}, pad eff {fmt(a.comp.pad_eff)}",
            f"  {c.n_missing} missing, {len(m.skips)} skipped, {len(c.stalls)} stalls, {fmt(c.tok_s_median)} tok/s",
        ]
        if a.selector is not None:
            sel = a.selector
            lines += [
                f"  selector: streak {fmt(sel.streak)} against unary {fmt(sel.unary_streak)}, coverage "
                f"{fmt(sel.coverage)}, loss {fmt(sel.loss)} at weight {fmt(sel.weight)}"
            ]
        if not_judged(a, cfg):
            lines += [f"  not judged: {not_judged(a, cfg)}"]
        if a.run.notes:
            lines += [f"  ({len(a.run.notes)} reading note(s) in report.md)"]
    lines += [f"ALARMS ({len(alarms)}):" if alarms else "No alarm."]
    for alarm in alarms[:12]:
        lines += [f"  ! [{alarm.run}] {alarm.title}: {_short(alarm.evidence)}"]
    if len(alarms) > 12:
        lines += [f"  ... and {len(alarms) - 12} more in report.md"]
    return "\n".join(lines)


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
