"""The suites' planning (benchmarks.suites.plan): what fits a budget, in priority order, grown with what is left;
what is cut says why; a need finished earlier counts; costs scale to what a finished run on the same kind of GPU
measured, with the cold start a bare machine adds; a GPU too small for a part cuts it; a part that follows another
grows with it and then takes the units it ran. And every suite's plan at the GPU budget fits its 9 minutes with the
costs it knows, the committed H100 records' among them, `real`'s DFlash2 parts beside DFlash's."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from benchmarks.suites import SUITES
from benchmarks.suites.plan import Part, calibrate, fit, on_machine, pinned, too_big
from benchmarks.suites.record import gpu_kind, load_records, measured_costs
from benchmarks.suites.run import RESERVE_S, RESULTS, selected


def part(name, fixed, unit_s, units, min_units, priority, needs=(), **more):
    return Part(
        name,
        name,
        fixed,
        unit_s,
        "u",
        units,
        min_units,
        priority,
        "test",
        lambda c, u: [],
        lambda c, u: {},
        needs,
        **more,
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
    assert b.source.startswith("measured 120 s for 100 u on a bare machine on 2026-12-05 (x1.09 the estimate: test)")


def test_a_need_that_finished_earlier_counts_as_met():
    plan = fit(PARTS[1:3], 300, done={"a"})  # b needs a, which an earlier command (or part) finished
    assert {p.part.name: p.units for p in plan.runs} == {"b": 200, "c": 25} and not plan.cuts  # 60 + 150, 60 + 30
    assert dict(fit(PARTS[1:3], 300).cuts)["b"] == "needs a, which did not fit or ran"


def test_a_bare_machine_adds_the_cold_start_and_a_measured_run_says_which_it_was():
    x = part("x", 10, 1.0, 100, 10, 0, cold_s=40, family="f")
    y = part("y", 20, 2.0, 50, 5, 1, cold_s=40, family="f")
    z = part("z", 5, 0, 1, 1, 2, cold_s=30)
    assert [p.cost(10) for p in on_machine([x, y, z], warm=set())] == [60, 80, 35]
    assert [p.cost(10) for p in on_machine([x, y, z], warm={"f"})] == [20, 40, 35]  # the family ran: warm
    assert "+ 40 s cold start" in on_machine([x], set())[0].source
    cold = {"x": {"part": "x", "seconds": 300.0, "units": 100, "date": "2026-12-05", "cold": True, "gpu": "H100"}}
    [cx, cy, _] = calibrate([x, y, z], cold)  # 300 s measured against 10 + 100 + 40 = 150: x2
    assert (cx.fixed_s, cx.unit_s, cx.cold_s) == pytest.approx((20, 2.0, 80))
    # y scaled by what x measured, against y's own estimate at those units: 20 + 2 * 100 + 40 = 260
    assert (cy.fixed_s, cy.unit_s, cy.cold_s) == pytest.approx((300 / 260 * 20, 300 / 260 * 2, 300 / 260 * 40))
    assert cy.source.startswith("measured by x 300 s for 100 u on a bare machine on 2026-12-05, H100")
    warm = {"x": {**cold["x"], "cold": False}}  # the same seconds on a warm machine: x300/110
    assert calibrate([x], warm)[0].cost(100) == pytest.approx(300.0)


def test_a_part_that_follows_another_grows_with_it_and_then_takes_the_units_it_ran():
    lead = part("t", 10, 1.0, 100, 10, 0)
    twin = part("t2", 10, 1.5, 100, 10, 0, follows="t")
    # 20 + 25 at the smallest; 55 s left grow both by 22 (2.5 s a unit), not the first alone by 55
    assert {p.part.name: p.units for p in fit([lead, twin], 100).runs} == {"t": 32, "t2": 32}
    alone = part("t2", 10, 1.5, 100, 10, 0)
    assert {p.part.name: p.units for p in fit([lead, alone], 100).runs} == {"t": 65, "t2": 10}
    assert {p.part.name: p.units for p in fit([lead, twin], 10_000).runs} == {"t": 100, "t2": 100}
    # t finished (40 units) in this command or an earlier one: t2 is planned at those, fewer where time is short
    [after] = pinned([twin], {"t": 40})
    assert (after.units, after.min_units) == (40, 10) and pinned([lead], {"t": 40}) == [lead]
    assert fit([after], 1000, {"t"}).units("t2") == 40 and fit([after], 30, {"t"}).units("t2") == 13
    assert (pinned([twin], {"t": 4})[0].units, pinned([twin], {"t": 4})[0].min_units) == (4, 4)


def test_real_plans_dflash2_right_after_dflash_at_the_same_steps_and_prompts():
    """A bare H100 at the committed records' costs: the first command trains both drafters the same steps; the
    second (continuing it) decodes the same prompts with both."""
    module = importlib.import_module(SUITES["real"])
    parts = calibrate(module.parts("gpu", {}), measured_costs(load_records(RESULTS), "real", "gpu", "H100"))
    names = [p.name for p in parts]
    assert names.index("training-dflash2") == names.index("training") + 1
    assert names.index("evaluation-dflash2") == names.index("evaluation") + 1
    assert names.index("decoding-dflash2") == names.index("decoding") + 1
    budget = 540 - RESERVE_S - 15
    first = fit(on_machine(parts, set()), budget)
    ran = {p.part.name: p.units for p in first.runs}
    assert {"prefix", "training", "training-dflash2", "evaluation"} <= set(ran)
    assert 300 <= ran["training"] == ran["training-dflash2"] < 1000
    rest = pinned([p for p in parts if p.name not in ran], ran)
    second = fit(on_machine(rest, {"training", "evaluation"}), budget, set(ran))
    planned = {p.part.name: p.units for p in second.runs}
    # evaluation-dflash2 fits the first command or the second, as the records' costs have it
    assert {"evaluation-dflash2", "decoding", "decoding-dflash2"} <= set(ran) | set(planned)
    assert 32 <= planned["decoding"] == planned["decoding-dflash2"]


def test_a_gpu_too_small_for_a_part_cuts_it_in_one_line():
    big = part("big", 10, 0, 1, 1, 0, memory_gib=55.3, memory_source="peak measured")
    small = part("small", 10, 0, 1, 1, 1)
    assert too_big([big, small], 79.2) == [] and too_big([big, small], None) == []
    assert too_big([big, small], 44.4) == [("big", "needs ~55 GiB of GPU memory (peak measured), the GPU has 44.4 GiB")]


def record(date, gpu, parts, scale="gpu", suite="s"):
    return (
        Path(f"/r/{date}.json"),
        {"suite": suite, "scale": scale, "date": date, "machine": {"gpu": gpu}, "parts": parts},
    )


def test_costs_come_from_the_newest_finished_runs_on_the_same_kind_of_gpu():
    ok = {"status": "ok", "seconds": 100.0, "units": 4}
    records = [
        record("2026-12-01T00:00:00Z", "NVIDIA H100 80GB HBM3", {"a": ok}, scale="h200"),  # the scale's old name
        record("2026-12-02T00:00:00Z", "NVIDIA H200", {"a": {**ok, "seconds": 50.0}}),
        record("2026-12-03T00:00:00Z", "NVIDIA H100 80GB HBM3", {"b": {**ok, "cold": False}}),
        record("2026-12-04T00:00:00Z", "NVIDIA H100 80GB HBM3", {"a": {**ok, "status": "timed out"}}),
        record("2026-12-05T00:00:00Z", "NVIDIA H100 80GB HBM3", {"a": ok}, scale="smoke"),
        record("2026-12-06T00:00:00Z", "NVIDIA H100 80GB HBM3", {"a": ok}, suite="other"),
    ]
    h100 = measured_costs(records, "s", "gpu", "H100")
    assert h100["a"]["date"] == "2026-12-01" and h100["a"]["cold"] is True  # no `cold`: a bare machine
    assert h100["b"]["cold"] is False and h100["b"]["gpu"] == "H100"
    assert measured_costs(records, "s", "gpu", "H200") == {
        "a": {"part": "a", "seconds": 50.0, "units": 4, "date": "2026-12-02", "cold": True, "gpu": "H200"}
    }
    assert measured_costs(records, "s", "gpu", "A100") == {}
    names = [
        "NVIDIA H100 80GB HBM3",
        "NVIDIA H200",
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA GeForce RTX 4090",
        "NVIDIA L40S",
        None,
    ]
    assert [gpu_kind({"gpu": n}) for n in names] == ["H100", "H200", "A100", "GeForce RTX 4090", "L40S", None]


def test_the_committed_h100_records_set_the_costs_of_the_next_h100_run():
    module = importlib.import_module(SUITES["shape27b"])
    records = load_records(RESULTS)
    parts = {p.name: p for p in calibrate(module.parts("gpu", {}), measured_costs(records, "shape27b", "gpu", "H100"))}
    assert parts["round"].cost(1) + parts["round"].cold_s == pytest.approx(167.6)  # 2026-12-05, a bare H100
    assert parts["extract-packed5"].cost(28) + parts["extract-packed5"].cold_s == pytest.approx(218.2)
    assert "measured by extract-packed5" in parts["extract-unpacked4"].source  # the family's run
    assert parts["train-stream"].source.startswith("2026-11-30/12-01 logs")  # never finished: the estimate
    real = calibrate(
        importlib.import_module(SUITES["real"]).parts("gpu", {}), measured_costs(records, "real", "gpu", "H100")
    )
    assert real[0].cost(1) + real[0].cold_s == pytest.approx(292.8)  # the newest: 2026-12-05 17:59, a bare H100
    h200 = calibrate(module.parts("gpu", {}), measured_costs(records, "shape27b", "gpu", "H200"))
    assert h200[0].cost(1) + h200[0].cold_s == pytest.approx(150.1, abs=0.5)  # 2026-12-05, a bare H200


def test_only_runs_the_named_parts_and_what_they_need():
    assert [p.name for p in selected(PARTS, "b")] == ["a", "b"]
    assert selected(PARTS, None) == PARTS
    with pytest.raises(SystemExit, match="no part 'zz'"):
        selected(PARTS, "zz")


@pytest.mark.parametrize("name", sorted(SUITES))
def test_every_suite_plans_its_gpu_run_inside_its_budget_and_says_what_it_cut(name):
    module = importlib.import_module(SUITES[name])
    parts = module.parts("gpu", {})
    budget = 540 - RESERVE_S - 15  # the wheels' install counts against it
    plan = fit(on_machine(parts, set()), budget)  # a bare machine
    assert sum(p.seconds for p in plan.runs) <= budget
    first = min(parts, key=lambda p: p.priority)
    assert first.name in {p.part.name for p in plan.runs}  # the most important part always fits
    names = {p.name for p in parts}
    assert len(names) == len(parts) and all(n in names for p in parts for n in p.needs)
    for p in parts:
        assert 1 <= p.min_units <= p.units and p.fixed_s >= 0 and p.unit_s >= 0 and p.cold_s >= 0 and p.source
        assert p.memory_gib < 70 and (p.memory_source or not p.memory_gib)  # one H100 holds every part
    assert {p.part.name for p in plan.runs} | set(dict(plan.cuts)) == names  # every part either runs or is cut
