"""Alarms of the training-health report: each compares one measurement with a named threshold of
`ReportConfig` and, when it trips, says in plain words what was seen (the evidence) and what
usually causes it. Learning-related alarms need `min_steps` trained steps; below that they are
listed as not judged instead of firing on noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from train.report.analysis import RunAnalysis
from train.report.compare import ConfigDiff
from train.report.config import ReportConfig

__all__ = ["Alarm", "find_alarms", "run_alarms", "config_alarms", "not_judged", "ALARM_CODES"]


@dataclass
class Alarm:
    code: str
    run: str
    title: str
    evidence: str
    cause: str


CAUSES = {
    "bucket_dominance": "Token-budget batching over a skewed length mix: long sequences fill a batch with few "
    "samples, so the longest bucket takes most optimizer steps and its loss dominates every "
    "per-step average (a bimodal loss). Balance the mix (cap or resample long "
    "sequences) or weight steps per sample. If the plan gives a different share, the stream "
    "is not following its plan.",
    "bucket_runs": "Batches ordered bucket by bucket instead of interleaved (stride interleaving missing, or a "
    "shuffle of batches that ignores buckets): the model sees one length regime at a time, so loss "
    "and accuracy swing with the bucket and Adam's moments adapt to one regime.",
    "plan_mismatch": "The data stream is not following data_plan.json: a bucket drains early or late "
    "(interleaving bug), batches are dropped, or the plan was written for other shards or "
    "another token budget.",
    "grad_collapse": "The task became trivial (labels leaking from the context, e.g. a label shift that lets the "
    "drafter copy), the loss is normalised by a growing count, or part of the model stopped "
    "receiving gradient (detached or frozen). With no clipping after warm-up, the drop is real "
    "and not a clipping artefact.",
    "loss_bimodal_buckets": "The length buckets train on different problems: one bucket's batches are broken "
    "(truncation, shifted labels, padding counted in the loss), or the loss is averaged "
    "per batch so short and long batches weigh differently. The mean loss then mixes two "
    "populations and hides progress.",
    "loss_bimodal": "Two populations of batches not explained by length: mixed data sources of very different "
    "difficulty, a share of batches with wrong labels or masks, or a nondeterministic bug.",
    "step_gaps": "Lines dropped by the logger while a checkpoint is written (logging from the saving thread), a "
    "crash and resume that lost the end of the log, or steps counted but not logged.",
    "stalls": "Right after checkpoint saves: a save done on the training thread (it should be copied to CPU and "
    "written in a background thread). Elsewhere: a data loader that ran dry (high share waiting for "
    "data), other processes on the same host or GPU, or a restart.",
    "skipped_steps": "bf16 overflow in attention or the loss, a corrupt shard (non-finite hidden states), a "
    "learning-rate spike, or a batch with no loss-masked token (0/0). Check the listed samples "
    "with `python -m shards verify`.",
    "acc_flat": "The learning rate decayed to (near) zero too early, the drafter has reached its capacity, or it "
    "is fitting labels it cannot predict (a label shift). If the learning rate is still high, suspect "
    "a bug rather than convergence.",
    "position_flat": "The drafter does not treat block positions differently: labels misaligned with positions "
    "(every position equally hard), position ids not applied to the block, or a drafter that "
    "predicts one frequent token everywhere.",
    "length_blind": "Accuracy should grow with the context available; equal accuracy across lengths means the "
    "context is not used (attention mask hides it, wrong taps, projection skipped) or the metric "
    "is not computed per bucket at all (bit-identical values point at the logging).",
    "loss_reset": "A resume that restored the model but not the optimizer, scheduler or data position; a "
    "learning-rate schedule restarting each epoch; or a data order that repeats. An epoch boundary "
    "or checkpoint next to it is listed in the evidence.",
    "epoch_backwards": "The data position was not restored on resume, or the epoch is computed from a counter "
    "that restarts.",
    "fetch_bound": "Data loading (reading, zstd decoding, host-to-device copies) is slower than the step: more "
    "prefetch, pinned memory, a faster disk or a lower compression level.",
    "selector_no_gain": "DFlash2's selector proposes the unary top-1 (its successor codes stayed near zero) or "
    "worse: its loss weight is 0 or warmed up too late (loss.selector_weight, selector_warmup_ratio), its "
    "predecessors are misaligned with the labels (each block position must get the label of the position before), or "
    "the run is too short for the codes to learn. A DFlash drafter would serve as well.",
    "coverage_falling": "The unary top-k holds the label less and less often: a selector weight so large that the "
    "backbone trades the DFlash term for the selector's (train it with a lower loss.selector_weight or a ramp), a "
    "learning rate too high late in the run, or a shift in the data stream.",
    "config_drift": "A comparison that changes more than one thing at a time cannot attribute the difference. "
    "Re-run with only the ablated keys changed, or name every intended key with ablated=KEY,KEY.",
}
ALARM_CODES = tuple(CAUSES)

TITLES = {
    "bucket_dominance": "one length bucket dominates the batches",
    "bucket_runs": "long runs of batches from the same bucket",
    "plan_mismatch": "batch mix differs from the data plan",
    "grad_collapse": "gradient norm collapsed",
    "loss_bimodal_buckets": "loss is bimodal and the modes line up with length buckets",
    "loss_bimodal": "loss is bimodal",
    "step_gaps": "steps missing from the log",
    "stalls": "wall-clock stalls",
    "skipped_steps": "steps skipped as non-finite",
    "acc_flat": "accuracy flat over the last part of the run",
    "position_flat": "accuracy at the last block position is close to position 1",
    "length_blind": "accuracy identical across sequence lengths",
    "loss_reset": "loss 'reset': the smoothed loss climbed back up",
    "epoch_backwards": "epoch went backwards",
    "fetch_bound": "training waits for data",
    "selector_no_gain": "the selector never beats the unary top-1",
    "coverage_falling": "the selector's coverage is falling",
    "config_drift": "compared run differs in more than the ablated keys",
}


def _alarm(code: str, run: str, evidence: str) -> Alarm:
    return Alarm(code=code, run=run, title=TITLES[code], evidence=evidence, cause=CAUSES[code])


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if math.isfinite(x) else "unknown"


def trained_steps(a: RunAnalysis) -> int:
    return int(a.m.valid.sum())


def not_judged(a: RunAnalysis, cfg: ReportConfig) -> str:
    """Why the learning alarms were not judged for this run, or '' when they were."""
    n = trained_steps(a)
    if n < cfg.min_steps:
        return (
            f"only {n} trained step(s) (min_steps = {cfg.min_steps}): bucket shares, gradient collapse, "
            "bimodality, flatness, positions, lengths, resets and the selector are not judged."
        )
    return ""


def run_alarms(a: RunAnalysis, cfg: ReportConfig) -> list[Alarm]:
    out = _continuity_alarms(a, cfg) + _bucket_run_alarms(a, cfg)
    if not not_judged(a, cfg):
        # Shares and trends of a short log are noise.
        out += _bucket_share_alarms(a, cfg) + _learning_alarms(a, cfg) + _selector_alarms(a, cfg)
    return out


def _selector_alarms(a: RunAnalysis, cfg: ReportConfig) -> list[Alarm]:
    s = a.selector
    if s is None:
        return []
    out = []
    if s.later_steps and s.gain_later <= cfg.selector_min_gain:
        out.append(
            _alarm(
                "selector_no_gain",
                a.run.name,
                f"from step {s.later_first_step} to the end ({s.later_steps} steps), the served walk's streak minus "
                f"the unary top-1's is {s.gain_later:+.4f} on average (selector_min_gain = {cfg.selector_min_gain}); "
                f"latest window: selector {s.streak:.3f}, unary {s.unary_streak:.3f}, selector weight {s.weight:g}.",
            )
        )
    if math.isfinite(s.coverage_drop) and s.coverage_drop > cfg.coverage_max_drop:
        out.append(
            _alarm(
                "coverage_falling",
                a.run.name,
                f"coverage fell from {s.coverage_best:.3f} (smoothed, step {s.coverage_best_step}) to {s.coverage:.3f} "
                f"in the latest {a.window.size} steps (drop {s.coverage_drop:.3f} > coverage_max_drop "
                f"{cfg.coverage_max_drop}).",
            )
        )
    return out


def _bucket_run_alarms(a: RunAnalysis, cfg: ReportConfig) -> list[Alarm]:
    if a.comp.n_buckets_seen >= 2 and a.comp.longest_run > cfg.max_same_bucket_run:
        return [
            _alarm(
                "bucket_runs",
                a.run.name,
                f"{a.comp.longest_run} consecutive batches from bucket {a.comp.longest_run_bucket}, starting at "
                f"step {a.comp.longest_run_first_step} (max_same_bucket_run = {cfg.max_same_bucket_run}).",
            )
        ]
    return []


def _bucket_share_alarms(a: RunAnalysis, cfg: ReportConfig) -> list[Alarm]:
    out = []
    rows = [r for r in a.comp.rows if r.n_total > 0]
    n = a.m.n
    for r in rows:
        reference = r.sample_share if math.isfinite(r.sample_share) else 1.0 / max(len(rows), 1)
        if r.batch_share > cfg.dominance_share and r.batch_share >= cfg.dominance_ratio * reference:
            against = (
                f"{_pct(r.sample_share)} of the samples"
                if math.isfinite(r.sample_share)
                else f"an even share of {_pct(reference)} (no sample counts: data_plan.json missing)"
            )
            plan = (
                f"; the plan gives it {_pct(r.planned_share)} of the batches" if math.isfinite(r.planned_share) else ""
            )
            out.append(
                _alarm(
                    "bucket_dominance",
                    a.run.name,
                    f"{r.label} produced {_pct(r.batch_share)} of the {n} logged batches from {against} "
                    f"({r.batch_share / reference:.1f}×; thresholds: share > {cfg.dominance_share}, ratio ≥ "
                    f"{cfg.dominance_ratio}){plan}.",
                )
            )
    off = [
        r
        for r in rows
        if math.isfinite(r.planned_share) and abs(r.batch_share - r.planned_share) > cfg.plan_share_tolerance
    ]
    if off:
        what = "; ".join(f"{r.label}: {_pct(r.batch_share)} logged vs {_pct(r.planned_share)} planned" for r in off)
        out.append(_alarm("plan_mismatch", a.run.name, f"{what} (tolerance ±{cfg.plan_share_tolerance:g})."))
    return out


def _learning_alarms(a: RunAnalysis, cfg: ReportConfig) -> list[Alarm]:
    out = []
    g = a.grad
    if math.isfinite(g.ratio) and g.ratio < cfg.grad_collapse_ratio:
        early, late = g.phases[0], g.phases[-1]
        clip = (
            f"{_pct(g.clipped_after_warmup)} of the steps after warm-up (step {g.warmup_end_step}) were clipped"
            if g.warmup_end_step is not None
            else "warm-up end unknown (no lr)"
        )
        out.append(
            _alarm(
                "grad_collapse",
                a.run.name,
                f"median grad norm fell from {early.grad_median:.3g} (steps {early.first_step}–{early.last_step}) "
                f"to {late.grad_median:.3g} (steps {late.first_step}–{late.last_step}): ratio {g.ratio:.2f} < "
                f"grad_collapse_ratio {cfg.grad_collapse_ratio}; {clip}.",
            )
        )
    d = a.loss
    if d.bimodal and d.mixture is not None:
        mix = d.mixture
        base = (
            f"over the last {d.n} steps: mean {d.mean:.3g}, median {d.median:.3g}, p10 {d.p10:.3g}, p90 "
            f"{d.p90:.3g}; bimodality coefficient {d.bc:.2f} > {cfg.bimodality_bc}; "
            f"modes at {mix.means[0]:.3g} ({_pct(mix.weights[0])}) and {mix.means[1]:.3g} "
            f"({_pct(mix.weights[1])}), separation D = {mix.separation:.1f} > {cfg.bimodality_separation}"
        )
        if math.isfinite(d.eta2) and d.eta2 >= cfg.bucket_alignment:
            high = (
                ", ".join(f"bucket {b} ({_pct(share)} of its steps)" for b, _, _, share in d.by_bucket if share >= 0.5)
                or "none"
            )
            out.append(
                _alarm(
                    "loss_bimodal_buckets",
                    a.run.name,
                    f"{base}; the bucket explains {_pct(d.eta2)} of the loss variance (≥ bucket_alignment "
                    f"{cfg.bucket_alignment}); high mode: {high}.",
                )
            )
        else:
            eta = (
                f"the bucket explains only {_pct(d.eta2)} of the variance"
                if math.isfinite(d.eta2)
                else "buckets unknown"
            )
            out.append(_alarm("loss_bimodal", a.run.name, f"{base}; {eta}."))
    learn = a.learn
    if math.isfinite(learn.acc_gain_tail) and learn.acc_gain_tail < cfg.flat_min_gain:
        lr = (
            f"; the learning rate at the end is {_pct(learn.lr_end_share)} of its peak"
            if math.isfinite(learn.lr_end_share)
            else ""
        )
        out.append(
            _alarm(
                "acc_flat",
                a.run.name,
                f"mean accuracy changed by {learn.acc_gain_tail:+.4f} from step {learn.tail_first_step} to the end "
                f"(last {_pct(cfg.flat_frac)} of the run; flat_min_gain = {cfg.flat_min_gain}){lr}.",
            )
        )
    pos = learn.position_latest
    known = np.flatnonzero(np.isfinite(pos))
    if known.size >= 2:
        first, last = pos[known[0]], pos[known[-1]]
        if first - last < cfg.position_min_drop:
            out.append(
                _alarm(
                    "position_flat",
                    a.run.name,
                    f"over the last {a.window.size} steps, accuracy at position {known[0] + 1} is {first:.3f} and "
                    f"at position {known[-1] + 1} is {last:.3f} (drop {first - last:+.3f} < position_min_drop "
                    f"{cfg.position_min_drop}).",
                )
            )
    if math.isfinite(learn.length_spread) and learn.length_spread < cfg.length_min_spread:
        per = ", ".join(f"bucket {b} {level:.4f}" for b, level in learn.length_levels.items())
        same = " The values are bit-identical." if learn.length_identical else ""
        out.append(
            _alarm(
                "length_blind",
                a.run.name,
                f"mean accuracy per bucket from step {learn.tail_first_step} to the end (adjusted for the trend "
                f"over those steps): {per}; spread {learn.length_spread:.4f} < length_min_spread "
                f"{cfg.length_min_spread}.{same}",
            )
        )
    for r in learn.resets:
        out.append(
            _alarm(
                "loss_reset",
                a.run.name,
                f"smoothed loss rose to {r.loss:.3g} at step {r.step} after reaching {r.best:.3g} "
                f"(+{_pct(r.loss / r.best - 1)}, reset_rise = {cfg.reset_rise}); nearby: {r.context}.",
            )
        )
    return out


def _continuity_alarms(a: RunAnalysis, cfg: ReportConfig) -> list[Alarm]:
    out = []
    c = a.cont
    if c.n_missing > cfg.max_missing_steps:
        shown = ", ".join(f"{x}–{y}" if x != y else str(x) for x, y in c.missing[:8]) + (
            " ..." if len(c.missing) > 8 else ""
        )
        near = (
            f"; next to checkpoint saves at step(s) {', '.join(str(s) for _, _, s in c.missing_near_ckpt[:8])}"
            if c.missing_near_ckpt
            else ""
        )
        out.append(
            _alarm(
                "step_gaps",
                a.run.name,
                f"{c.n_missing} step number(s) absent between 1 and {c.last_step}: {shown}{near} "
                f"(max_missing_steps = {cfg.max_missing_steps}).",
            )
        )
    if c.stalls:
        worst = max(c.stalls, key=lambda s: s.seconds)
        at_ckpt = sum(s.ckpt_step is not None for s in c.stalls)
        total = sum(s.seconds for s in c.stalls)
        share = (
            f" ({_pct(total / c.wall_seconds)} of the wall clock)"
            if math.isfinite(c.wall_seconds) and c.wall_seconds > 0
            else ""
        )
        fetch = a.m.fetch_frac[np.isin(a.m.step, [s.step for s in c.stalls])]
        waiting = (
            f"; share of those steps spent waiting for data: median {_pct(float(np.nanmedian(fetch)))}"
            if np.isfinite(fetch).any()
            else ""
        )
        out.append(
            _alarm(
                "stalls",
                a.run.name,
                f"{len(c.stalls)} stall(s); the longest {worst.seconds:.1f} s before step {worst.step} against a "
                f"typical {worst.typical:.2f} s per step; {at_ckpt} of them right after a checkpoint "
                f"save{waiting}; {total:.0f} s in stalls{share} (stall_factor = {cfg.stall_factor}, "
                f"stall_min_seconds = {cfg.stall_min_seconds}).",
            )
        )
    skips = a.m.skips
    if len(skips) > cfg.max_skipped_steps:
        listed = "; ".join(f"step {s['step']} ({s['reason']})" for s in skips[:5]) + (" ..." if len(skips) > 5 else "")
        ids = skips[0]["sample_ids"][:3]
        out.append(
            _alarm(
                "skipped_steps",
                a.run.name,
                f"{len(skips)} step(s) skipped: {listed}"
                + (f"; samples of the first: {', '.join(map(str, ids))}" if ids else "")
                + f" (max_skipped_steps = {cfg.max_skipped_steps}).",
            )
        )
    if c.epoch_decreases:
        step, before, after = c.epoch_decreases[0]
        out.append(
            _alarm(
                "epoch_backwards",
                a.run.name,
                f"{len(c.epoch_decreases)} decrease(s) of epoch; the first at step {step}: {before:.3f} → {after:.3f}.",
            )
        )
    if math.isfinite(c.fetch_median) and c.fetch_median > cfg.max_fetch_frac:
        out.append(
            _alarm(
                "fetch_bound",
                a.run.name,
                f"median share of step time spent waiting for data: {_pct(c.fetch_median)} (p95 "
                f"{_pct(c.fetch_p95)}; max_fetch_frac = {cfg.max_fetch_frac}).",
            )
        )
    return out


def config_alarms(diffs: list[ConfigDiff], base: str, cfg: ReportConfig) -> list[Alarm]:
    out = []
    for d in diffs:
        if d.unexpected:
            values = {k: (x, y) for k, x, y in d.differing}
            shown = ", ".join(f"{k} ({values[k][0]!r} → {values[k][1]!r})" for k in d.unexpected[:10])
            ablated = ", ".join(cfg.ablated) if cfg.ablated else "none named (ablated=...)"
            out.append(
                _alarm("config_drift", d.run, f"{d.run} differs from {base} in {shown}; ablated keys: {ablated}.")
            )
    return out


def find_alarms(analyses: list[RunAnalysis], diffs: list[ConfigDiff], cfg: ReportConfig) -> list[Alarm]:
    out = []
    for a in analyses:
        out += run_alarms(a, cfg)
    return out + config_alarms(diffs, analyses[0].run.name, cfg)
