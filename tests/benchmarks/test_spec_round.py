"""The speculative round's projection (benchmarks.spec_round): golden values of the arithmetic on measured costs,
the re-run of a hybrid target's accepted tokens, the break-even τ, and the figures a record keeps of them."""

from __future__ import annotations

import pytest

from benchmarks.spec_round import ANCHOR, break_even_tau, interpolate, project, round_ms
from benchmarks.suites.figures import round_figures

GRAPHED = {"step_ms": 10.0, "verify_ms": {1: 10.0, 16: 11.5}, "propose_ms": 1.5}
EAGER = {"step_ms": 100.0, "verify_ms": {1: 100.0, 4: 110.0, 16: 130.0}, "propose_ms": 20.0, "snapshot_ms": 2.0}


def test_interpolation_is_linear_between_measured_sizes_and_flat_outside():
    points = {1: 10.0, 4: 16.0, 16: 40.0}
    assert interpolate(points, 2.5) == pytest.approx(13.0)
    assert interpolate(points, 10) == pytest.approx(28.0)
    assert interpolate(points, 0.5) == 10.0 and interpolate(points, 20) == 40.0
    assert interpolate(points, 4) == 16.0


def test_a_verify_only_round_projects_tau_steps_over_the_round():
    projected = project(GRAPHED)
    assert round_ms(GRAPHED, 5) == pytest.approx(13.0)
    assert [r["tau"] for r in projected["rows"]] == list(range(2, 11))
    assert projected["rows"][4]["speedup"] == pytest.approx(6 * 10 / 13)
    assert projected["break_even_tau"] == pytest.approx(1.3)
    assert projected["verify_over_step"] == pytest.approx(1.15) and projected["propose_over_step"] == pytest.approx(
        0.15
    )
    assert projected["at_anchor_tau"] == pytest.approx(ANCHOR["tau"] * 10 / 13)


def test_a_hybrid_round_pays_the_snapshot_and_the_re_run_of_its_accepted_tokens():
    # τ = 4: propose 20 + verify 130 + snapshot 2 + re-run of 4 tokens 110 = 262 ms for 4 tokens of 100 ms.
    assert round_ms(EAGER, 4) == pytest.approx(262.0)
    assert project(EAGER)["rows"][2]["speedup"] == pytest.approx(400 / 262)
    be = break_even_tau(EAGER)  # τ·100 = 152 + t(τ), t(τ) = 100 + 10 (τ - 1) / 3 between sizes 1 and 4
    assert be == pytest.approx((252 - 10 / 3) / (100 - 10 / 3))
    assert be * 100 == pytest.approx(round_ms(EAGER, be), rel=1e-6)


def test_a_round_that_never_pays_within_a_block_has_no_break_even():
    assert break_even_tau({"step_ms": 1.0, "verify_ms": {16: 30.0}, "propose_ms": 1.0}) is None


def test_a_records_figures_keep_both_variants_side_by_side_by_tau():
    report = {
        "dtype": "bfloat16",
        "device": "NVIDIA H200",
        "variants": {
            "graphed": {**GRAPHED, "verify_ms": {"1": 10.0, "16": 11.5}, "how": "graphs"},
            "eager": {"error": "RuntimeError: no"},
        },
        "projection": {"graphed": project(GRAPHED)},
    }
    figures = round_figures(report, "shape27b.round")
    assert figures["shape27b.round.graphed.verify16_ms"] == 11.5
    assert figures["shape27b.round.graphed.break_even_tau"] == pytest.approx(1.3)
    assert figures["shape27b.round.eager.error"] == "RuntimeError: no"
    rows = figures["shape27b.round.projection"]
    assert rows[0] == {"tau": 2, "graphed_round_ms": 13.0, "graphed_speedup": pytest.approx(20 / 13)}
