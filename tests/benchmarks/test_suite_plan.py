"""The suites' planning (benchmarks.suites.plan): what fits a budget, in priority order, grown with what is left;
what is cut says why; costs scale to what a finished run measured. And every suite's plan at the H200 budget fits
its 9 minutes with the costs it knows."""

from __future__ import annotations

import importlib

import pytest

from benchmarks.suites import SUITES
from benchmarks.suites.plan import Part, calibrate, fit
from benchmarks.suites.run import RESERVE_S, selected


def part(name, fixed, unit_s, units, min_units, priority, needs=()):
    return Part(
        name, name, fixed, unit_s, "u", units, min_units, priority, "test", lambda c, u: [], lambda c, u: {}, needs
    )


PARTS = [
    part("a", 100, 0, 1, 1, 0),  # must run, fixed
    part("b", 10, 1.0, 200, 50, 1, needs=("a",)),  # grows from 50 to 200 units
    part("c", 40, 2.0, 30, 10, 2),  # grows after b
    part("d", 500, 0, 1, 1, 3),  # never fits
    part("e", 5, 0, 1, 1, 4, needs=("d",)),  # needs what was cut
]


def test_each_part_fits_at_its_smallest_in_priority_order_then_grows_in_the_same_order():
    plan = fit(PARTS, 300)
    # a 100 + b 60 + c 60 = 220 at the smallest; 80 s left: b grows by 80 units first, c not at all.
    assert {p.part.name: p.units for p in plan.runs} == {"a": 1, "b": 130, "c": 10}
    assert [p.part.name for p in plan.runs] == ["a", "b", "c"]  # the suite's order of running
    assert sum(p.seconds for p in plan.runs) == pytest.approx(300)
    cuts = dict(plan.cuts)
    assert cuts["d"] == "needs ~500 s at its smallest (1 u), 80 s left"
    assert cuts["e"] == "needs d, which did not fit or ran"
    assert any("cut: d: needs ~500 s" in line for line in plan.lines())
    assert plan.to_dict()["runs"][1] == {"part": "b", "units": 130, "of": 200, "unit": "u", "est_s": 140}


def test_a_larger_budget_grows_parts_to_their_full_scale_and_no_further():
    plan = fit(PARTS[:3], 10_000)
    assert {p.part.name: p.units for p in plan.runs} == {"a": 1, "b": 200, "c": 30}
    assert not plan.cuts


def test_a_part_that_does_not_fit_cuts_the_parts_that_need_it():
    plan = fit(PARTS[:3], 120)  # a fits (100), b needs 60: cut; c needs 60: cut
    assert [p.part.name for p in plan.runs] == ["a"]
    assert set(dict(plan.cuts)) == {"b", "c"}


def test_costs_scale_to_what_a_finished_run_measured():
    measured = {"b": {"seconds": 120.0, "units": 100, "date": "2026-12-05"}}  # estimate 110 s for 100 units
    [a, b, *_] = calibrate(PARTS, measured)
    assert a is PARTS[0]
    assert b.cost(100) == pytest.approx(120.0) and b.fixed_s == pytest.approx(10 * 120 / 110)
    assert b.source.startswith("measured 120 s for 100 u on 2026-12-05")


def test_only_runs_the_named_parts_and_what_they_need():
    assert [p.name for p in selected(PARTS, "b")] == ["a", "b"]
    assert selected(PARTS, None) == PARTS
    with pytest.raises(SystemExit, match="no part 'zz'"):
        selected(PARTS, "zz")


@pytest.mark.parametrize("name", sorted(SUITES))
def test_every_suite_plans_its_h200_run_inside_its_budget_and_says_what_it_cut(name):
    module = importlib.import_module(SUITES[name])
    parts = module.parts("h200", {})
    budget = 540 - RESERVE_S - 15  # the wheels' install counts against it
    plan = fit(parts, budget)
    assert sum(p.seconds for p in plan.runs) <= budget
    first = min(parts, key=lambda p: p.priority)
    assert first.name in {p.part.name for p in plan.runs}  # the most important part always fits
    names = {p.name for p in parts}
    assert len(names) == len(parts) and all(n in names for p in parts for n in p.needs)
    for p in parts:
        assert 1 <= p.min_units <= p.units and p.fixed_s >= 0 and p.unit_s >= 0 and p.source
    assert {p.part.name for p in plan.runs} | set(dict(plan.cuts)) == names  # every part either runs or is cut
