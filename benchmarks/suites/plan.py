"""What a suite runs in its time budget: `Part` (one measurement, what it costs), `fit` (the plan: every part that
fits at its smallest, in priority order, then the time left spent on growing them, in the same order),
`calibrate` (costs scaled to what the suite's last record on this kind of GPU measured) and `on_machine` (the
cold-start cost added where this machine has not run the part's family yet).

A part costs `fixed_s + unit_s * units` seconds, plus `cold_s` on a bare machine: `fixed_s` is what it pays
whatever its size (process start, model build), `unit_s` each unit of its size (a training step, a prompt, 10 K
tokens), `cold_s` what only the first run of its `family` on a machine pays (compilation, graph capture, the
first pass over cold kernels and files). It runs between `min_units` (the least that still answers its question)
and `units` (the suite's full scale). `needs` names the parts whose output it reads: cut with them, run once they
finished (in this command or an earlier one). A part that `follows` another runs at that part's units (the same
steps or prompts, for a comparison): planned together they grow together; once the other finished, `pinned` plans
it at the units that one ran. `memory_gib` is the GPU memory it needs at its peak (0: not checked). Costs come with
their `source` (a log entry, a record), printed with the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence

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
    cold_s: float = 0.0  # paid on top where the machine has not run this part's family yet
    family: str = ""  # parts that warm the same caches (one model, one kernel set); "" = the part alone
    memory_gib: float = 0.0  # peak GPU memory, GiB (0: not checked)
    memory_source: str = ""
    follows: str = ""  # the part whose units this one takes (same min_units and units); "" = its own

    def cost(self, units: int) -> float:
        return self.fixed_s + self.unit_s * units

    @property
    def kin(self) -> str:
        return self.family or self.name


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


def fit(parts: Sequence[Part], budget_s: float, done: Collection[str] = ()) -> Plan:
    """The plan for `budget_s` seconds: each part at its smallest in priority order while it fits (a part whose
    needs were cut is cut too; a need in `done` finished already), then each grown toward its full scale in the
    same order with what is left; a part and the part that follows it grow together, by the same units."""
    by_priority = sorted(parts, key=lambda p: p.priority)
    follower = {p.follows: p for p in parts if p.follows}
    chosen: dict[str, int] = {}
    cuts: list[tuple[str, str]] = []
    left = budget_s
    for part in by_priority:
        missing = [n for n in part.needs if n not in chosen and n not in done]
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
        if part.name not in chosen or part.follows in chosen:  # a follower grows with the part it follows
            continue
        twin = follower.get(part.name)
        twin = twin if twin and twin.name in chosen else None
        assert not twin or (twin.min_units, twin.units) == (part.min_units, part.units), (part.name, twin.name)
        unit_s = part.unit_s + (twin.unit_s if twin else 0.0)
        grow = part.units - chosen[part.name]
        if unit_s > 0:
            grow = min(grow, int(left // unit_s))
        for grown in (part, twin) if twin else (part,):
            chosen[grown.name] += grow
        left -= grow * unit_s
    runs = tuple(Planned(p, chosen[p.name]) for p in parts if p.name in chosen)
    return Plan(budget_s, runs, tuple(cuts))


def pinned(parts: Sequence[Part], ran: dict[str, int]) -> list[Part]:
    """`parts` with each part that follows a finished one (`ran`: the units that one ran) grown to those units at
    most; its smallest stays its own (or those units, where fewer), so a short time plans it smaller, not away."""
    out = []
    for part in parts:
        units = ran.get(part.follows) if part.follows else None
        keep = units is None or units < 1
        out.append(part if keep else dataclasses.replace(part, units=units, min_units=min(units, part.min_units)))
    return out


def calibrate(parts: Sequence[Part], measured: dict[str, dict]) -> list[Part]:
    """`parts` with each cost scaled to what a finished run of it measured (`measured[name]`: its record's
    {"seconds", "units", "date", "cold", "gpu"}), or, where it has none, a finished run of another part of its
    family, so a suite that has run plans from its own times. A run on a bare machine (`cold`) is compared
    with the cost plus `cold_s`."""
    out = []
    for part in parts:
        run = measured.get(part.name) or _family_run(part, parts, measured)
        units = run.get("units") if run else None
        if units is None or not run.get("seconds"):
            out.append(part)
            continue
        estimate = part.cost(units) + (part.cold_s if run.get("cold", True) else 0.0)
        if estimate <= 0:
            out.append(part)
            continue
        scale = run["seconds"] / estimate
        whose = "" if run.get("part", part.name) == part.name else f" by {run['part']}"
        source = f"measured{whose} {run['seconds']:.0f} s for {units} {part.unit}"
        source += f" {'on a bare machine ' if run.get('cold', True) else ''}on {run['date']}"
        source += f"{', ' + run['gpu'] if run.get('gpu') else ''} (x{scale:.2f} the estimate: {part.source})"
        out.append(
            dataclasses.replace(
                part,
                fixed_s=part.fixed_s * scale,
                unit_s=part.unit_s * scale,
                cold_s=part.cold_s * scale,
                source=source,
            )
        )
    return out


def _family_run(part: Part, parts: Sequence[Part], measured: dict[str, dict]) -> dict | None:
    """The newest measured run of another part of `part`'s family, where it has a family."""
    if not part.family:
        return None
    kin = [measured[p.name] for p in parts if p.family == part.family and p.name in measured]
    return max(kin, key=lambda run: run["date"], default=None)


def on_machine(parts: Sequence[Part], warm: Collection[str]) -> list[Part]:
    """`parts` as they cost on this machine: `cold_s` added to the fixed cost of each part whose family has not run
    here yet (`warm`: the families that have)."""
    out = []
    for part in parts:
        if part.cold_s <= 0 or part.kin in warm:
            out.append(part)
            continue
        source = f"{part.source}; + {part.cold_s:.0f} s cold start (its first run on this machine)"
        out.append(dataclasses.replace(part, fixed_s=part.fixed_s + part.cold_s, source=source))
    return out


MEMORY_MARGIN_GIB = 2.0  # the CUDA context and the allocator's slack, beside a part's measured peak


def too_big(parts: Sequence[Part], gpu_gib: float | None) -> list[tuple[str, str]]:
    """(part, why) for each part whose peak GPU memory does not fit a GPU of `gpu_gib` (None: no GPU, no check)."""
    if not gpu_gib:
        return []
    return [
        (p.name, f"needs ~{p.memory_gib:.0f} GiB of GPU memory ({p.memory_source}), the GPU has {gpu_gib:.1f} GiB")
        for p in parts
        if p.memory_gib and p.memory_gib + MEMORY_MARGIN_GIB > gpu_gib
    ]
