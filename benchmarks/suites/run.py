"""`python -m benchmarks.suites.run NAME [options] [key=value ...]`: plan and run one suite (started by
`python3 -m benchmarks.suites NAME`, which installs the carried wheels first and starts the clock).

    --budget-s S     wall seconds from the start of `python3 -m benchmarks.suites` (default 540: 9 minutes, inside
                     the device host's 10-minute command)
    --scale SCALE    h200 (default where torch sees a GPU) or smoke (a CPU: the same code at toy sizes, seconds)
    --out DIR        the record NAME.json and the log NAME.log (default: $OUT on the device host, else bench-out/NAME)
    --work DIR       scratch for the parts' own outputs (default /tmp/dflash-bench/NAME)
    --wheels DIR     the carried wheels (default .whl)
    --plan-only      print the plan and stop
    only=A,B         run only these parts (and the parts they need)
    key=value        the suite's own options (its module's docstring lists them)

Before every part the rest is planned again from the time really left, so a part that ran long shrinks or cuts
the later ones (said in the log and the record), and a part gets the time left minus what the more important
parts after it need at their smallest.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.suites import SUITES
from benchmarks.suites.plan import Part, calibrate, fit
from benchmarks.suites.record import REPO, load_records, measured_costs, new_record, write_record
from benchmarks.suites.runner import Context, SuiteLog, run_stages
from common.interrupts import run_main

RESULTS = REPO / "benchmarks" / "results"
RESERVE_S = 10.0  # kept back from the budget for writing the record at the end


def parse(argv: list[str]) -> tuple[argparse.Namespace, dict[str, str]]:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.suites", description=__doc__.split("\n\n")[0])
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--scale", choices=["h200", "smoke"], default="h200" if torch.cuda.is_available() else "smoke")
    p.add_argument("--out", default=None)
    p.add_argument("--work", default=None)
    p.add_argument("--wheels", default=".whl")
    p.add_argument("--plan-only", action="store_true")
    args, words = p.parse_known_args(argv)
    bad = [w for w in words if "=" not in w or w.startswith("-")]
    if bad:
        p.error(f"unknown argument {bad[0]!r}: options are --flags above, suite options key=value")
    return args, dict(w.split("=", 1) for w in words)


def selected(parts: list[Part], only: str | None) -> list[Part]:
    """The parts `only` names and, transitively, the parts they need (all parts when `only` is None)."""
    if not only:
        return parts
    by_name = {p.name: p for p in parts}
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise SystemExit(f"only={only}: no part {unknown[0]!r}; the parts: {', '.join(by_name)}")
    keep: set[str] = set()
    while wanted:
        name = wanted.pop()
        if name not in keep:
            keep.add(name)
            wanted += list(by_name[name].needs)
    return [p for p in parts if p.name in keep]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, options = parse(argv)
    started = float(os.environ.get("DFLASH_SUITE_STARTED", time.time()))
    deadline = started + args.budget_s - RESERVE_S
    out = Path(args.out or os.environ.get("OUT") or f"bench-out/{args.suite}")
    work = Path(args.work or f"/tmp/dflash-bench/{args.suite}")
    for folder in (out, work):
        folder.mkdir(parents=True, exist_ok=True)
    module = importlib.import_module(SUITES[args.suite])
    parts = selected(module.parts(args.scale, options), options.pop("only", None))
    parts = calibrate(parts, measured_costs(load_records(RESULTS), args.suite, args.scale))
    log = SuiteLog(out / f"{args.suite}.log")
    ctx = Context(args.suite, args.scale, out, work, Path(args.wheels), options, log)
    plan = fit(parts, deadline - time.time())
    for line in plan.lines():
        log.say(line)
    if args.plan_only:
        log.close()
        return 0
    command = "python3 -m benchmarks.suites " + " ".join(argv)
    record = new_record(args.suite, args.scale, command, args.budget_s, ctx.wheels)
    record["plan"] = plan.to_dict()
    run_parts(ctx, parts, record, deadline)
    record["wall_s"] = round(time.time() - started, 1)
    ran = record["parts"].values()
    record["status"] = "complete" if not record["cut"] and all(p["status"] == "ok" for p in ran) else "partial"
    write_record(record, out / f"{args.suite}.json")
    log.say(summary(record, out))
    log.close()
    return 0 if any(p["status"] == "ok" for p in ran) else 1


def run_parts(ctx: Context, parts: list[Part], record: dict, deadline: float) -> None:
    """Each part in order, planned again from the time left; the record written after each."""
    done: dict[str, str] = {}
    ctx.state["parts"] = record["parts"]  # what ran so far, for collectors that sum the parts' times
    for i, part in enumerate(parts):
        broken = [n for n in part.needs if done.get(n) != "ok"]
        now_plan = fit([p for p in parts[i:] if all(done.get(n) == "ok" for n in p.needs)], deadline - time.time())
        units = now_plan.units(part.name)
        if broken or units is None:
            why = f"needs {', '.join(broken)}, which did not finish" if broken else dict(now_plan.cuts)[part.name]
            record["cut"].append({"part": part.name, "why": why})
            ctx.log.say(f"\n=== {part.name}: cut ({why})")
            continue
        later = [p.part for p in now_plan.runs if p.part.priority < part.priority and parts.index(p.part) > i]
        seconds = deadline - time.time() - sum(p.cost(p.min_units) for p in later)
        ctx.log.say(
            f"\n=== {part.name}: {units} {part.unit}, ~{part.cost(units):.0f} s planned, {seconds:.0f} s allowed"
        )
        result = run_stages(ctx, part.name, part.stages(ctx, units), seconds, part.jobs)
        done[part.name] = result["status"]
        record["parts"][part.name] = {"units": units, "unit": part.unit, "est_s": round(part.cost(units)), **result}
        figures, raw = collect(ctx, part, units)
        record["figures"].update(figures)
        record["raw"][part.name] = raw
        write_record(record, ctx.out / f"{ctx.suite}.json")
        ctx.log.say(f"=== {part.name}: {result['status']} after {result['seconds']:.0f} s; {len(figures)} figures")


def collect(ctx: Context, part: Part, units: int) -> tuple[dict, dict | None]:
    """(figures, the part's own raw output) read back from the files its commands wrote; what is missing is
    missing (a part cut short measured less), and a collector that fails says why in the log."""
    try:
        got = part.collect(ctx, units)
    except Exception as exc:  # noqa: BLE001 - the record keeps what the other parts measured
        ctx.log.say(f"  collecting {part.name}'s figures failed: {type(exc).__name__}: {exc}")
        return {}, None
    figures, raw = got if isinstance(got, tuple) else (got, None)
    return {k: v for k, v in figures.items() if v is not None}, raw


def summary(record: dict, out: Path) -> str:
    lines = [
        f"\n{record['suite']}: {record['status']} in {record['wall_s']:.0f} s; record {out / record['suite']}.json"
    ]
    for name, part in record["parts"].items():
        lines.append(f"  {name:<18} {part['status']:<12} {part['seconds']:>6.0f} s  ({part['units']} {part['unit']})")
    lines += [f"  {c['part']:<18} cut: {c['why']}" for c in record["cut"]]
    for key, value in sorted(record["figures"].items()):
        if not isinstance(value, (list, dict)):
            lines.append(f"  {key} = {value}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.suites.run", main))
