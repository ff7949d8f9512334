"""`python -m benchmarks.suites.run NAME [options] [key=value ...]`: plan and run one suite (started by
`python3 -m benchmarks.suites NAME`, which installs the carried wheels first, checks the imports and starts the
clock).

    --budget-s S     wall seconds from the start of `python3 -m benchmarks.suites` (default 540: 9 minutes, inside
                     the device host's 10-minute command)
    --scale SCALE    gpu (default where torch sees a GPU: one H100 or H200) or smoke (a CPU: the same code at toy
                     sizes, seconds); h200 is the gpu scale's earlier name
    --out DIR        the record NAME.json and the log NAME.log (default: $OUT on the device host, else bench-out/NAME)
    --work DIR       scratch for the parts' own outputs (default /tmp/dflash-bench/NAME)
    --wheels DIR     the carried wheels (default .whl)
    --plan-only      print the plan and stop
    --fresh          run every part again, though an earlier command on this host finished some
    only=A,B         run only these parts (and the parts they need)
    key=value        the suite's own options (its module's docstring lists them)

It prints the machine first, and cuts, in one line each, the parts whose measured peak GPU memory the GPU does
not have (refusing the suite where that leaves nothing). Costs come from the suite's last records in
benchmarks/results/ on the same kind of GPU, else from the estimates in its module, with a cold start added to
each part whose family has not run on this machine yet (`plan`). A command that finds an unfinished record of the
same run in the work folder continues it: the parts it finished are not run again and are copied, with their
figures, into the new record (`continuation`). Before every part the rest is planned again from the time really
left, so a part that ran long shrinks or cuts the later ones (said in the log and the record), and a part gets the
time left minus what the more important parts after it need at their smallest and what the part that follows it
(`Part.follows`) was planned at.
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
from benchmarks.suites.continuation import carry_over, earlier, finished, mark_warm, warm_families
from benchmarks.suites.plan import Part, calibrate, fit, on_machine, pinned, too_big
from benchmarks.suites.record import (
    REPO,
    SCALE_NAMES,
    commit,
    gpu_kind,
    load_records,
    machine,
    machine_line,
    measured_costs,
    new_record,
    utc_now,
    write_record,
)
from benchmarks.suites.runner import Context, SuiteLog, run_stages
from common.interrupts import run_main

RESULTS = REPO / "benchmarks" / "results"
RESERVE_S = 10.0  # kept back from the budget for writing the record at the end


def parse(argv: list[str]) -> tuple[argparse.Namespace, dict[str, str]]:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.suites", description=__doc__.split("\n\n")[0])
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--scale", choices=["gpu", "smoke", *SCALE_NAMES], default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--work", default=None)
    p.add_argument("--wheels", default=".whl")
    p.add_argument("--plan-only", action="store_true")
    p.add_argument("--fresh", action="store_true")
    args, words = p.parse_known_args(argv)
    bad = [w for w in words if "=" not in w or w.startswith("-")]
    if bad:
        p.error(f"unknown argument {bad[0]!r}: options are --flags above, suite options key=value")
    args.scale = SCALE_NAMES.get(args.scale, args.scale) or ("gpu" if torch.cuda.is_available() else "smoke")
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
    only = options.pop("only", None)
    module = importlib.import_module(SUITES[args.suite])
    every = module.parts(args.scale, options)
    parts = selected(every, only)
    log = SuiteLog(out / f"{args.suite}.log")
    here = machine()
    log.say(machine_line(here))
    kind = gpu_kind(here) if args.scale == "gpu" else None
    parts = calibrate(parts, measured_costs(load_records(RESULTS), args.suite, args.scale, kind) if kind else {})
    refused = too_big(parts, here.get("gpu_memory_gib") if args.scale == "gpu" else None)
    if refused and len(refused) == len(parts):
        log.say(f"{args.suite}: refused: this GPU is too small for every part it plans: {refused[0][1]}")
        log.close()
        return 2
    ctx = Context(args.suite, args.scale, out, work, Path(args.wheels), options, log)
    names = [p.name for p in every]
    before, why = (
        (None, "") if args.fresh else earlier(work, args.suite, args.scale, commit(REPO, ctx.wheels), options, names)
    )
    if why:
        log.say(why)
    done = set(finished(before)) if before else set()
    pending = [p for p in parts if p.name not in done and p.name not in dict(refused)]
    plan = fit(on_machine(pinned(pending, units_ran(before or {})), warm_families(work)), deadline - time.time(), done)
    for line in plan.lines() + [f"  cut: {name}: {why}" for name, why in refused]:
        log.say(line)
    if args.plan_only:
        log.close()
        return 0
    command = "python3 -m benchmarks.suites " + " ".join(argv)
    record = new_record(args.suite, args.scale, command, args.budget_s, ctx.wheels, options)
    record["plan"] = plan.to_dict()
    record["cut"] += [{"part": name, "why": why} for name, why in refused]
    if before:
        carry_over(record, before)
    run_parts(ctx, pending, record, deadline)
    record["wall_s"] = round(time.time() - started, 1)
    ran = record["parts"].values()
    whole = (
        not record["cut"]
        and all(p["status"] == "ok" for p in ran)
        and {p.name for p in parts} <= record["parts"].keys()
    )
    record["status"] = "complete" if whole else "partial"
    save(ctx, record)
    log.say(summary(record, out))
    log.close()
    return 0 if any(p["status"] == "ok" for p in ran) else 1


def save(ctx: Context, record: dict) -> None:
    """The record in the output folder, and its copy in the work folder that a later command continues from."""
    write_record(record, ctx.out / f"{ctx.suite}.json")
    write_record(record, ctx.work / f"{ctx.suite}.json")


def run_parts(ctx: Context, parts: list[Part], record: dict, deadline: float) -> None:
    """Each part in order, planned again from the time left; the record written after each. A part runs once
    every part it needs finished, in this command or an earlier one (already in `record`)."""
    ctx.state["parts"] = record["parts"]  # what ran so far, for collectors that sum the parts' times
    for i, part in enumerate(parts):
        ran = units_ran(record)
        broken = [n for n in part.needs if n not in ran]
        warm = warm_families(ctx.work)
        now_plan = fit(on_machine(pinned(parts[i:], ran), warm), deadline - time.time(), set(ran))
        units = now_plan.units(part.name)
        if broken or units is None:
            why = f"needs {', '.join(broken)}, which did not finish" if broken else dict(now_plan.cuts)[part.name]
            record["cut"].append({"part": part.name, "why": why})
            ctx.log.say(f"\n=== {part.name}: cut ({why})")
            continue
        costs = {p.part.name: p.part for p in now_plan.runs}
        later = [p for p in now_plan.runs if p.part.name != part.name and p.part.priority < part.priority]
        twins = [p for p in now_plan.runs if p.part.follows == part.name]  # kept their planned units' time
        seconds = deadline - time.time() - sum(p.part.cost(p.part.min_units) for p in later)
        seconds -= sum(p.seconds for p in twins if p not in later)
        est = costs[part.name].cost(units)
        ctx.log.say(f"\n=== {part.name}: {units} {part.unit}, ~{est:.0f} s planned, {seconds:.0f} s allowed")
        ctx.allowed_s = seconds
        entry = {"units": units, "unit": part.unit, "est_s": round(est), "cold": part.kin not in warm}
        entry["date"] = utc_now()
        result = run_stages(ctx, part.name, part.stages(ctx, units), seconds, part.jobs)
        if result["status"] in ("ok", "timed out"):
            mark_warm(ctx.work, part.kin)  # its kernels are compiled, its files cached, whether or not it finished
        record["parts"][part.name] = {**entry, **result}
        figures, raw = collect(ctx, part, units)
        did = ctx.state.pop("units_done", None)  # a part that decides its own size says what it did
        if did is not None and did != units:
            record["parts"][part.name] |= {"units": did, "planned_units": units}
        record["figures"].update(figures)
        record["raw"][part.name] = raw
        save(ctx, record)
        ctx.log.say(f"=== {part.name}: {result['status']} after {result['seconds']:.0f} s; {len(figures)} figures")


def units_ran(record: dict) -> dict[str, int]:
    """{part: the units it ran} of a record's parts that ended well."""
    return {name: p.get("units") or 0 for name, p in (record.get("parts") or {}).items() if p.get("status") == "ok"}


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
        when = f", in the command of {part['earlier']}" if part.get("earlier") else ""
        lines.append(
            f"  {name:<18} {part['status']:<12} {part['seconds']:>6.0f} s  ({part['units']} {part['unit']}{when})"
        )
    lines += [f"  {c['part']:<18} cut: {c['why']}" for c in record["cut"]]
    for key, value in sorted(record["figures"].items()):
        if not isinstance(value, (list, dict)):
            lines.append(f"  {key} = {value}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.suites.run", main))
