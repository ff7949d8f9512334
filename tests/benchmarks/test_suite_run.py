"""How a suite command runs its parts (benchmarks.suites.run, .continuation), on a fake suite whose parts sleep:
a part runs once what it needs finished, though the first part overran and the plan was made again from the
remaining parts; a second command continues the first's record, runs only what is left and merges the rest; the
machine is printed first, and a GPU too small for a part cuts it, or refuses the suite, in one line."""

from __future__ import annotations

import json
import time

import pytest

from benchmarks.suites import SUITES, run
from benchmarks.suites.plan import Part

SLEEP = {"a": 1.5, "b": 0.1, "c": 0.05}  # seconds each part really takes
SPEC: dict = {}  # name: Part keywords, set by each test


def fake_part(name, **changes) -> Part:
    base = dict(
        name=name,
        what=f"part {name}",
        fixed_s=0.1,
        unit_s=0.0,
        unit="u",
        units=1,
        min_units=1,
        priority=0,
        source="test",
        stages=lambda ctx, units: [],
        collect=lambda ctx, units, name=name: {f"fake.{name}.units": units},
    )
    return Part(**(base | changes))


def parts(scale: str, options: dict) -> list[Part]:
    """The fake suite (benchmarks.suites.run imports it as the suite `fake`)."""
    return [fake_part(name, **changes) for name, changes in SPEC.items()]


@pytest.fixture
def suite(tmp_path, monkeypatch):
    """Run the fake suite; every part's commands replaced by a sleep of SLEEP[part]. Returns (main, calls)."""
    monkeypatch.setitem(SUITES, "fake", __name__)
    monkeypatch.setattr(run, "RESERVE_S", 0.0)
    monkeypatch.setattr(run, "RESULTS", tmp_path / "no-records")
    (tmp_path / "no-records").mkdir()
    calls: list[tuple[str, int]] = []

    def run_stages(ctx, part, stages, seconds, jobs=0):
        calls.append((part, getattr(ctx, "allowed_s", None)))
        time.sleep(SLEEP[part])
        return {"status": "ok", "seconds": SLEEP[part], "steps": []}

    monkeypatch.setattr(run, "run_stages", run_stages)

    def main(*argv: str) -> tuple[int, dict, str]:
        out = tmp_path / "out"
        code = run.main(["fake", "--scale", "smoke", "--out", str(out), "--work", str(tmp_path / "work"), *argv])
        record = json.loads((out / "fake.json").read_text()) if (out / "fake.json").is_file() else {}
        return code, record, (out / "fake.log").read_text()

    return main, calls


def chain() -> dict:
    """a, then b (needs a, grows with its units), then c (needs b); d never fits."""
    return {
        "a": dict(fixed_s=0.5),  # estimated 0.5 s, takes 1.5 s
        "b": dict(fixed_s=0.1, unit_s=0.01, units=200, min_units=10, needs=("a",)),
        "c": dict(needs=("b",)),
        "d": dict(fixed_s=50, priority=1),
    }


def test_the_dependent_parts_run_scaled_down_when_the_first_part_overran(suite, monkeypatch):
    main, calls = suite
    SPEC.clear()
    SPEC.update(chain())
    code, record, log = main("--budget-s", "3")
    assert code == 0
    assert [name for name, _ in calls] == ["a", "b", "c"]
    assert {p: record["parts"][p]["status"] for p in "abc"} == {"a": "ok", "b": "ok", "c": "ok"}
    planned = {r["part"]: r["units"] for r in record["plan"]["runs"]}
    assert planned["b"] == 200  # planned at its full scale while a was expected to take 0.5 s
    assert 10 <= record["parts"]["b"]["units"] < 200  # a took 1.5 s: b shrank to what was left, c still ran
    assert record["figures"]["fake.b.units"] == record["parts"]["b"]["units"] and record["figures"]["fake.c.units"] == 1
    assert [c["part"] for c in record["cut"]] == ["d"] and "at its smallest" in record["cut"][0]["why"]
    assert "needs a, which" not in log and log.startswith("machine: ")


def test_a_second_command_continues_the_first_and_merges_its_parts(suite, monkeypatch):
    main, calls = suite
    SPEC.clear()
    SPEC.update({k: v for k, v in chain().items() if k != "d"})
    SPEC["c"] = dict(needs=("b",), cold_s=2.0)  # its first run on a machine costs 2 s more
    monkeypatch.setitem(SLEEP, "a", 0.05)
    code, first, _ = main("--budget-s", "20", "only=a,b")
    assert code == 0 and set(first["parts"]) == {"a", "b"} and "c" not in first["figures"]
    calls.clear()
    code, second, log = main("--budget-s", "20")  # the same work folder: the host kept it
    assert code == 0 and [name for name, _ in calls] == ["c"]  # a and b finished in the first command
    assert second["status"] == "complete" and set(second["parts"]) == {"a", "b", "c"}
    assert second["parts"]["a"]["earlier"] == first["date"] and "earlier" not in second["parts"]["c"]
    assert second["figures"] == {"fake.a.units": 1, "fake.b.units": 200, "fake.c.units": 1}
    assert second["continues"][0]["command"] == first["command"] and second["continues"][0]["finished"] == ["a", "b"]
    assert "continuing the run of" in log and "a, b finished there" in log
    assert second["parts"]["c"]["cold"] is True and second["parts"]["c"]["est_s"] == 2  # 0.1 s + the cold 2 s
    calls.clear()
    code, third, log = main("--budget-s", "20")  # everything finished: a new run, on a warm machine
    assert [name for name, _ in calls] == ["a", "b", "c"] and "finished every part: starting afresh" in log
    assert third["parts"]["c"]["cold"] is False and third["parts"]["c"]["est_s"] == 0 and "continues" not in third
    calls.clear()
    main("--budget-s", "20", "only=a")
    main("--budget-s", "20", "--fresh")
    assert [name for name, _ in calls] == ["a", "a", "b", "c"]  # --fresh runs a again


def test_a_gpu_too_small_cuts_the_parts_it_cannot_hold_or_refuses_the_suite(suite, monkeypatch):
    main, calls = suite
    small = {"gpu": "NVIDIA L4", "gpus": 1, "gpu_memory_gib": 22.0, "cpu": "test CPU", "cores": 2, "os": "test"}
    monkeypatch.setattr(run, "machine", lambda: small)
    SPEC.clear()
    SPEC.update(
        {
            "a": dict(fixed_s=0.01, memory_gib=55.3, memory_source="peak measured"),
            "b": dict(fixed_s=0.01, needs=("a",)),
            "c": dict(fixed_s=0.01, priority=1),
        }
    )
    monkeypatch.setitem(SLEEP, "a", 0.0)
    code, record, log = main("--budget-s", "20", "--scale", "gpu")
    assert code == 0 and [name for name, _ in calls] == ["c"]
    cut = {c["part"]: c["why"] for c in record["cut"]}
    assert cut["a"] == "needs ~55 GiB of GPU memory (peak measured), the GPU has 22.0 GiB"
    assert cut["b"].startswith("needs a") and log.startswith("machine: NVIDIA L4 (22.0 GiB); test CPU, 2 cores")
    SPEC.update({"c": dict(fixed_s=0.01, memory_gib=40, memory_source="estimate"), "b": dict(memory_gib=30)})
    code, _, log = main("--budget-s", "20", "--scale", "gpu")
    assert code == 2 and log.splitlines()[-1].startswith("fake: refused: this GPU is too small for every part")


def test_a_part_keeps_the_time_of_the_part_that_follows_it_which_then_takes_the_units_it_ran(suite, monkeypatch):
    main, calls = suite
    SPEC.clear()

    def decoded_fewer(ctx, units):  # as `real`'s decoding: it stopped before its planned units
        ctx.state["units_done"] = units - 3
        return {"fake.a.units": units - 3}

    SPEC["a"] = dict(unit_s=0.01, units=100, min_units=10, collect=decoded_fewer)
    SPEC["b"] = dict(unit_s=0.02, units=100, min_units=10, needs=("a",), follows="a")
    monkeypatch.setitem(SLEEP, "a", 0.01)
    code, record, _ = main("--budget-s", "20")
    assert code == 0 and [name for name, _ in calls] == ["a", "b"]
    assert {r["part"]: r["units"] for r in record["plan"]["runs"]} == {"a": 100, "b": 100}  # grown together
    assert record["parts"]["a"]["units"] == record["parts"]["b"]["units"] == 97  # b took what a ran
    # a was allowed the time left less b's planned time (0.1 + 100 x 0.02 s), b the time left
    assert calls[1][1] - calls[0][1] == pytest.approx(2.1, abs=0.3)
