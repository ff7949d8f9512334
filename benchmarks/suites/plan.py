"""What a suite runs in its time budget: `Part` (one measurement, what it costs), `fit` (the plan: every part that
fits at its smallest, in priority order, then the time left spent on growing them, in the same order) and
`calibrate` (costs scaled to what the suite's last record measured).

A part costs `fixed_s + unit_s * units` seconds: `fixed_s` is what it pays whatever its size (process start, model
build, compilation), `unit_s` each unit of its size (a training step, a prompt, 10 K tokens). It runs between
`min_units` (the least that still answers its question) and `units` (the suite's full scale). `needs` names the
parts whose output it reads: cut with them. Costs come with their `source` (a log entry, a record), printed with
the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

# A stage: commands (name, `python` argv) run side by side; a part's stages run in order.
Stage = list[tuple[str, list[str]]]


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    what: str
    fixed_s: float
    unit_s: float
    unit: str
    units: int
    min_units: int
    priority: int  # lower first: what fits at its smallest in this order runs
    source: str
    stages: Callable[..., list[Stage]]  # (context, units) -> the commands
    collect: Callable[..., dict]  # (context, units) -> the figures it measured, from the files it wrote
    needs: tuple[str, ...] = ()
    jobs: int = 0  # commands of a stage running at once (0: all of them)

    def cost(self, units: int) -> float:
        return self.fixed_s + self.unit_s * units


@dataclasses.dataclass(frozen=True)
class Planned:
    part: Part
    units: int

    @property
    def seconds(self) -> float:
        return self.part.cost(self.units)


@dataclasses.dataclass(frozen=True)
class Plan:
    budget_s: float
    runs: tuple[Planned, ...]  # in the suite's order of running
    cuts: tuple[tuple[str, str], ...]  # (part, why), in priority order

    def units(self, name: str) -> int | None:
        return next((p.units for p in self.runs if p.part.name == name), None)

    def lines(self) -> list[str]:
        total = sum(p.seconds for p in self.runs)
        out = [f"plan for {self.budget_s:.0f} s: {len(self.runs)} parts, about {total:.0f} s"]
        for p in self.runs:
            scaled = "" if p.units == p.part.units else f" (cut from {p.part.units})"
            out.append(f"  {p.part.name:<18} {p.units:>6} {p.part.unit}{scaled}, ~{p.seconds:.0f} s: {p.part.what}")
            out.append(f"  {'':<18} costs: {p.part.source}")
        out += [f"  cut: {name}: {why}" for name, why in self.cuts]
        return out

    def to_dict(self) -> dict:
        return {
            "budget_s": round(self.budget_s, 1),
            "runs": [
                {
                    "part": p.part.name,
                    "units": p.units,
                    "of": p.part.units,
                    "unit": p.part.unit,
                    "est_s": round(p.seconds),
                }
                for p in self.runs
            ],
            "cut": [{"part": name, "why": why} for name, why in self.cuts],
        }


def fit(parts: Sequence[Part], budget_s: float) -> Plan:
    """The plan for `budget_s` seconds: each part at its smallest in priority order while it fits (a part whose
    needs were cut is cut too), then each grown toward its full scale in the same order with what is left."""
    by_priority = sorted(parts, key=lambda p: p.priority)
    chosen: dict[str, int] = {}
    cuts: list[tuple[str, str]] = []
    left = budget_s
    for part in by_priority:
        missing = [n for n in part.needs if n not in chosen]
        if missing:
            cuts.append((part.name, f"needs {', '.join(missing)}, which did not fit or ran"))
            continue
        need = part.cost(part.min_units)
        if need > left:
            cuts.append(
                (part.name, f"needs ~{need:.0f} s at its smallest ({part.min_units} {part.unit}), {left:.0f} s left")
            )
            continue
        chosen[part.name] = part.min_units
        left -= need
    for part in by_priority:
        if part.name in chosen and part.units > chosen[part.name]:
            grow = (
                part.units - chosen[part.name]
                if part.unit_s <= 0
                else min(part.units - chosen[part.name], int(left // part.unit_s))
            )
            chosen[part.name] += grow
            left -= grow * part.unit_s
    runs = tuple(Planned(p, chosen[p.name]) for p in parts if p.name in chosen)
    return Plan(budget_s, runs, tuple(cuts))


def calibrate(parts: Sequence[Part], measured: dict[str, dict]) -> list[Part]:
    """`parts` with each cost scaled to what a finished run of it measured (`measured[name]`: its record's
    {"seconds", "units", "date"}), so a suite that has run plans from its own times."""
    out = []
    for part in parts:
        run = measured.get(part.name)
        if not run or not run.get("seconds") or run.get("units") is None or part.cost(run["units"]) <= 0:
            out.append(part)
            continue
        scale = run["seconds"] / part.cost(run["units"])
        source = f"measured {run['seconds']:.0f} s for {run['units']} {part.unit} on {run['date']}"
        source += f" (x{scale:.2f} the estimate)"
        out.append(dataclasses.replace(part, fixed_s=part.fixed_s * scale, unit_s=part.unit_s * scale, source=source))
    return out
