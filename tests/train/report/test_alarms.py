"""Training-health report alarms: each synthetic pathology fires its own alarm and no other one,
relaxing that alarm's threshold silences it, and a healthy run raises none. Every threshold comes
from ReportConfig, so the tests follow the defaults if they change."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.train.report.fixtures.synth import BLOCK_POSITIONS, SKEWED_SAMPLES, Synth, write_run
from train.report.alarms import ALARM_CODES, not_judged
from train.report.config import ReportConfig
from train.report.make import analyse

CFG = ReportConfig()


def _pathology(code: str, cfg: ReportConfig) -> Synth:
    """A run with exactly one thing wrong, sized from the thresholds it must cross."""
    healthy = Synth()
    if code == "bucket_dominance":
        return Synth(samples=SKEWED_SAMPLES)
    if code == "bucket_runs":
        return Synth(schedule="blocked")
    if code == "grad_collapse":
        return Synth(grad_late_ratio=cfg.grad_collapse_ratio / 3)
    if code == "loss_bimodal_buckets":
        return Synth(loss_offset={0: 1.8, 1: 1.8})
    if code == "step_gaps":
        ckpt = healthy.ckpt_every * 2
        return Synth(drop_steps=tuple(range(ckpt + 1, ckpt + cfg.max_missing_steps + 11)))
    if code == "stalls":
        return Synth(stall_seconds=cfg.stall_min_seconds + 10 * cfg.stall_factor * healthy.step_seconds)
    if code == "skipped_steps":
        return Synth(nan_steps=tuple(range(250, 250 + cfg.max_skipped_steps + 3)))
    if code == "acc_flat":
        return Synth(acc_frozen_from=max(0.0, 1 - 2 * cfg.flat_frac))
    if code == "position_flat":
        # accuracy at position 15 ~ level * exp(-14 / decay): a drop of about a fifth of the threshold
        return Synth(position_decay=5 * (BLOCK_POSITIONS - 1) / max(cfg.position_min_drop, 1e-3))
    if code == "length_blind":
        return Synth(length_effect=0.0)
    if code == "loss_reset":
        return Synth(reset_at=0.6, reset_height=3 * cfg.reset_rise)
    if code == "selector_no_gain":
        return Synth(selector=True, selector_gain=cfg.selector_min_gain - 0.2)  # the walk does worse than the top-1
    if code == "coverage_falling":
        return Synth(selector=True, coverage_drop_at=0.7, coverage_drop=3 * cfg.coverage_max_drop)
    raise AssertionError(code)


# key=value that makes the alarm's own threshold loose enough to stay silent on the same run.
RELAXED = {
    "bucket_dominance": {"dominance_share": 0.9},
    "bucket_runs": {"max_same_bucket_run": 10_000},
    "grad_collapse": {"grad_collapse_ratio": 0.01},
    "loss_bimodal_buckets": {"bimodality_separation": 1000.0},
    "step_gaps": {"max_missing_steps": 1000},
    "stalls": {"stall_factor": 1000.0},
    "skipped_steps": {"max_skipped_steps": 1000},
    "acc_flat": {"flat_frac": 1.0},
    "position_flat": {"position_min_drop": 0.0},
    "length_blind": {"length_min_spread": 0.0},
    "loss_reset": {"reset_rise": 100.0},
    "selector_no_gain": {"selector_min_gain": -1.0},
    "coverage_falling": {"coverage_max_drop": 0.9},
}
SINGLE_RUN_CODES = sorted(RELAXED)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report_alarms")
    out = {"healthy": str(write_run(root / "healthy", Synth()))}
    for code in SINGLE_RUN_CODES:
        out[code] = str(write_run(root / code, _pathology(code, CFG)))
    return out


def _codes(words: list[str], cfg: ReportConfig = CFG) -> list[str]:
    return [a.code for a in analyse(words, cfg)[3]]


def test_a_healthy_dflash2_run_raises_no_alarm_and_reports_its_selector(tmp_path):
    run = str(write_run(tmp_path / "dflash2", Synth(selector=True)))
    analyses, _, _, alarms = analyse([run], CFG)
    assert alarms == [], [(a.code, a.evidence) for a in alarms]
    selector = analyses[0].selector
    assert selector.gain_later > CFG.selector_min_gain and selector.coverage_drop < CFG.coverage_max_drop
    assert selector.streak > selector.unary_streak and 0.7 < selector.coverage < 0.85
    dflash = str(write_run(tmp_path / "dflash", Synth()))
    assert analyse([dflash], CFG)[0][0].selector is None


def test_healthy_run_raises_no_alarm_and_is_fully_judged(runs):
    analyses, _, _, alarms = analyse([runs["healthy"]], CFG)
    assert alarms == [], [(a.code, a.evidence) for a in alarms]
    assert not_judged(analyses[0], CFG) == ""


def test_the_healthy_generator_sits_inside_every_threshold():
    spec = Synth()
    batches = spec.batches_per_epoch()
    shares = [b / sum(batches) for b in batches]
    assert max(shares) < CFG.dominance_share
    assert spec.grad_late_ratio > CFG.grad_collapse_ratio


@pytest.mark.parametrize("code", SINGLE_RUN_CODES)
def test_each_pathology_fires_its_own_alarm_only(runs, code):
    codes = _codes([runs[code]])
    assert codes and set(codes) == {code}, codes


@pytest.mark.parametrize("code", SINGLE_RUN_CODES)
def test_relaxing_the_threshold_silences_the_alarm(runs, code):
    cfg = dataclasses.replace(CFG, **RELAXED[code])
    assert code not in _codes([runs[code]], cfg)


def test_dominance_matches_the_last_teams_mix():
    """The skewed mix: the longest bucket holds 20% of the samples and gets about half the batches."""
    spec = Synth(samples=SKEWED_SAMPLES)
    batches = spec.batches_per_epoch()
    share = batches[-1] / sum(batches)
    sample_share = spec.samples[-1] / sum(spec.samples)
    assert share > CFG.dominance_share and share >= CFG.dominance_ratio * sample_share


def test_alarm_evidence_names_the_numbers(runs):
    alarm = next(a for a in analyse([runs["grad_collapse"]], CFG)[3] if a.code == "grad_collapse")
    assert "ratio" in alarm.evidence and str(CFG.grad_collapse_ratio) in alarm.evidence
    assert alarm.cause and alarm.title
    stall = next(a for a in analyse([runs["stalls"]], CFG)[3] if a.code == "stalls")
    # Every synthetic stall follows a checkpoint save: the evidence must say so.
    n = int(stall.evidence.split(" stall")[0])
    assert f"{n} of them right after a checkpoint save" in stall.evidence


def test_gaps_next_to_checkpoints_are_named(runs):
    alarm = next(a for a in analyse([runs["step_gaps"]], CFG)[3] if a.code == "step_gaps")
    assert f"checkpoint saves at step(s) {Synth().ckpt_every * 2}" in alarm.evidence


def test_bimodal_loss_not_aligned_with_buckets_is_its_own_alarm(tmp_path):
    # Every third step has a high loss whatever its bucket: two modes, not explained by length.
    spec = Synth()
    records = spec.records()
    for r in records:
        if r["step"] % 3 == 0:
            r["loss"] += 1.8
    run = write_run(tmp_path / "mixed", spec)

    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert set(_codes([str(run)])) == {"loss_bimodal"}


def test_config_differing_in_more_than_the_ablated_key_fires(tmp_path):
    base = write_run(tmp_path / "base", Synth())
    other = write_run(tmp_path / "other", Synth(config_changes={"loss.gamma": 5.0, "optim.lr": 1e-3}))
    cfg = dataclasses.replace(CFG, ablated=["loss.gamma"])
    alarms = analyse([str(base), str(other)], cfg)[3]
    assert [a.code for a in alarms] == ["config_drift"]
    assert "optim.lr" in alarms[0].evidence and "loss.gamma (" not in alarms[0].evidence
    assert _codes([str(base), str(other)], dataclasses.replace(CFG, ablated=["loss.gamma", "optim.*"])) == []


def test_different_shards_count_as_a_config_difference(tmp_path):
    base = write_run(tmp_path / "base", Synth())
    other = write_run(tmp_path / "other", Synth(config_changes={"loss.gamma": 5.0}))

    info = json.loads((other / "run.json").read_text())
    info["manifest_digest"] = "another"
    (other / "run.json").write_text(json.dumps(info))
    alarms = analyse([str(base), str(other)], dataclasses.replace(CFG, ablated=["loss.gamma"]))[3]
    assert [a.code for a in alarms] == ["config_drift"] and "run.manifest_digest" in alarms[0].evidence


def test_every_alarm_code_is_exercised():
    covered = set(SINGLE_RUN_CODES) | {"config_drift", "loss_bimodal"}
    # plan_mismatch, epoch_backwards and fetch_bound are covered in test_robust.py.
    assert set(ALARM_CODES) - covered == {"plan_mismatch", "epoch_backwards", "fetch_bound"}


def test_a_reset_at_an_epoch_boundary_is_placed_there(tmp_path):
    spec = Synth()
    boundary = 2 * sum(spec.batches_per_epoch())
    run = write_run(tmp_path / "reset", Synth(reset_at=boundary / spec.n_steps, reset_height=3 * CFG.reset_rise))
    alarms = analyse([str(run)], CFG)[3]
    assert [a.code for a in alarms] == ["loss_reset"]
    step = int(alarms[0].evidence.split(" at step ")[1].split(" ")[0])
    assert boundary <= step <= boundary + analyse([str(run)], CFG)[0][0].smooth
    assert "an epoch boundary (epoch 1." in alarms[0].evidence
