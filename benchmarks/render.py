"""`make bench-render` (`python -m benchmarks.render [--check] [--add RECORD ...]`): the "Today" section of
docs/benchmarks.md and the README's results table, rendered from the records in benchmarks/results/ through
`benchmarks.catalogue`, between their begin and end markers (nothing outside them changes).

    --add RECORD   first check a suite's record (the NAME.json a `make bench-gpu` run wrote) as every rendering
                   will read it, then copy it into benchmarks/results/ as SUITE-DATE.json (a second record of the
                   suite in the same second: SUITE-DATE-2.json); a record that fails is named in one line, exit 2,
                   and nothing is written; its log (NAME.log beside it) is copied beside it
    --check        change nothing: exit 1, naming the files, where what is there differs from what the records
                   give (the test suite runs this)

Every figure comes from the newest record holding it, linked in its row (date, machine, commit; "log" where the
record was imported from an entry of the log: this page's or a dated archive's beside it, named in the record's
`source`). A figure no record holds reads "not yet measured", with the
suite or command that measures it. Records at the smoke scale (a CPU run of a suite's code) are never rendered.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import uuid
from pathlib import Path

from benchmarks import catalogue as C
from benchmarks.suites import SUITES
from benchmarks.suites.record import REPO, check_record, load_records
from common.interrupts import run_main

RESULTS = REPO / "benchmarks" / "results"
DOC = REPO / "docs" / "benchmarks.md"
README = REPO / "README.md"
TODAY_MARKERS = (
    "<!-- today: begin (rendered by `make bench-render` from benchmarks/results/; edit the records, not this) -->",
    "<!-- today: end -->",
)
README_MARKERS = (
    "<!-- results table: begin (rendered by `make bench-render` from benchmarks/results/; keep these markers) -->",
    "<!-- results table: end -->",
)


class Index:
    """The records, newest last; which one holds a figure."""

    def __init__(self, records: list[tuple[Path, dict]]):
        self.records = [(p, r) for p, r in records if r.get("scale") != "smoke"]

    def latest(self, key: str) -> tuple[Path, dict, object] | None:
        for path, record in reversed(self.records):
            value = record["figures"].get(key)
            if value is not None:
                return path, record, value
        return None

    def last_run(self, suite: str) -> tuple[Path, dict] | None:
        runs = [(p, r) for p, r in self.records if r["suite"] == suite and r["status"] != "imported"]
        return runs[-1] if runs else None


def machine_short(record: dict) -> str:
    m = record.get("machine") or {}
    if m.get("gpu"):
        name = str(m["gpu"]).removeprefix("NVIDIA ")
        return f"{m['gpus']}x {name}" if (m.get("gpus") or 1) > 1 else name
    return f"{m.get('cores', '?')}-core CPU"


def link(path: Path, record: dict, base: Path) -> str:
    said = f"{record['date'][:10]}, {machine_short(record)}, {record['commit']}"
    said += ", log" if record["status"] == "imported" else ""
    return f"[{said}]({os.path.relpath(path, base).replace(os.sep, '/')})"


def value_text(value, fmt: str) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def command_of(measured_by: str) -> str:
    if measured_by.startswith("suite:"):
        return f"`make bench-gpu suite={measured_by.removeprefix('suite:')}`"
    return f"`{measured_by}`"


def not_measured(measured_by: str) -> str:
    return f"not yet measured ({command_of(measured_by)})"


def figure_row(fig: C.Fig, measured_by: str, index: Index, base: Path) -> str:
    found = index.latest(fig.key)
    if found is None:
        return f"| {fig.label} | {not_measured(fig.measured_by or measured_by)} | {fig.goal} | |"
    path, record, value = found
    return f"| {fig.label} | {value_text(value, fig.fmt)} | {fig.goal} | {link(path, record, base)} |"


def render_figures(table: C.Figures, index: Index, base: Path) -> list[str]:
    lines = [f"**{table.title}** ({command_of(table.measured_by)})", ""]
    lines += ["| figure | value | goal | record |", "|---|---:|---|---|"]
    lines += [figure_row(fig, table.measured_by, index, base) for fig in table.rows]
    return lines + ([f"\n{table.note}"] if table.note else [])


def render_series(table: C.Series, index: Index, base: Path) -> list[str]:
    found = index.latest(table.key)
    lines = [f"**{table.title}** ({command_of(table.measured_by)})", ""]
    lines += ["| " + " | ".join(h for h, _, _ in table.columns) + " |", "|" + "---|" * len(table.columns)]
    if found is None:
        lines.append(f"| {not_measured(table.measured_by)} |" + " |" * (len(table.columns) - 1))
    else:
        path, record, rows = found
        cells = [
            ["—" if row.get(f) is None else value_text(row[f], fmt) for _, f, fmt in table.columns] for row in rows
        ]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        gaps = any("—" in row for row in cells)
        lines.append(f"\nRecord: {link(path, record, base)}" + ("; —: not measured in it." if gaps else "."))
    return lines + ([f"\n{table.note}"] if table.note else [])


def render_suites(index: Index, base: Path) -> list[str]:
    lines = [
        "**GPU suites** (one H100 or H200, one command of at most 9 minutes each from a bare machine, two for `real` "
        "and `shape27b`; how to carry the wheels: [GPU suites](#gpu-suites-make-bench-gpu))",
        "",
        "| suite | measures | command on the GPU host | last run |",
        "|---|---|---|---|",
    ]
    for name in SUITES:
        last = index.last_run(name)
        ran = "not yet run"
        if last is not None:
            ran = f"{last[1]['status']} in {last[1].get('wall_s', 0):.0f} s: {link(last[0], last[1], base)}"
        lines.append(f"| `{name}` | {C.SUITE_TEXT[name]} | `python3 -m benchmarks.suites {name}` | {ran} |")
    return lines


def render_today(index: Index) -> str:
    base = DOC.parent
    lines = [
        "Every figure below comes from a record in `benchmarks/results/`, linked in its row (the command, the "
        "machine, the commit, the package versions, the date; *log*: imported as written from an entry of the log, "
        "below or in a dated archive, which the record's `source` names). A figure no record holds reads *not yet "
        "measured*, with what measures it.",
        "",
        *render_suites(index, base),
    ]
    for table in C.TODAY:
        render = render_series if isinstance(table, C.Series) else render_figures
        lines += ["", *render(table, index, base)]
    return "\n".join(lines)


def render_readme(index: Index) -> str:
    base = README.parent
    lines = ["| result | value | goal | record |", "|---|---:|---|---|"]
    lines += [figure_row(fig, "", index, base) for fig in C.README.rows]
    return "\n".join(lines)


def splice(text: str, markers: tuple[str, str], body: str, where: Path) -> str:
    """`text` with what lies between the marker lines replaced by `body`."""
    begin, end = markers
    lines = text.split("\n")
    if lines.count(begin) != 1 or lines.count(end) != 1 or lines.index(begin) > lines.index(end):
        raise ValueError(
            f"{where}: needs the lines\n{begin}\n{end}\nonce each, in that order, around the rendered part"
        )
    return "\n".join([*lines[: lines.index(begin) + 1], body, *lines[lines.index(end) :]])


def rendered(index: Index) -> dict[Path, str]:
    """Each rendered file's whole new text."""
    return {
        DOC: splice(DOC.read_text(), TODAY_MARKERS, render_today(index), DOC),
        README: splice(README.read_text(), README_MARKERS, render_readme(index), README),
    }


# The fields of a suite's record by the type every rendering reads them as (beyond `check_record`'s).
ADDED_TYPES = {
    "suite": str,
    "status": str,
    "commit": str,
    "command": str,
    "machine": dict,
    "packages": dict,
    "figures": dict,
}
SUITE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")
# Records `--add` keeps: the GPU suites', and those of the benchmarks that write the same record themselves.
ADDABLE = (*SUITES, "dflash2-tiny")  # benchmarks.dflash2_tiny


def check_addable(record: object, where: str) -> dict:
    """The record, or a ValueError naming `where` and the first thing that keeps every rendering from
    reading it: not an object, a field of the wrong type, a `suite` that is no suite's plain name (it
    names the file in benchmarks/results/), a smoke-scale record, or anything a trial rendering trips on."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record is a JSON object, got {type(record).__name__}")
    check_record(record, where)
    for key, kind in ADDED_TYPES.items():
        if not isinstance(record[key], kind):
            raise ValueError(f"{where}: '{key}' must be a JSON {'object' if kind is dict else 'string'}")
    if not SUITE_NAME.fullmatch(record["suite"]) or record["suite"] not in ADDABLE:
        raise ValueError(f"{where}: 'suite' {record['suite']!r} is none of the suites {', '.join(ADDABLE)}")
    if record.get("scale") == "smoke":
        raise ValueError(f"{where}: a smoke-scale record (a CPU run of the suite's code) is never rendered")
    try:
        rendered(Index([*load_records(RESULTS), (RESULTS / f"{record['suite']}.json", record)]))
    except Exception as exc:  # noqa: BLE001 - whatever a rendering trips on, named before the file is kept
        raise ValueError(f"{where}: the record cannot be rendered ({type(exc).__name__}: {exc})") from None
    return record


def add(record_path: Path) -> Path:
    """Check a suite's record (`check_addable`) and copy it into benchmarks/results/ as SUITE-DATE.json, never
    over another record (the same bytes already there: that file)."""
    try:
        data = record_path.read_bytes()
        record = check_addable(json.loads(data), str(record_path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{record_path}: cannot be read as a JSON record ({exc})") from None
    stamp = record["date"].replace(":", "")[:17] + "Z"  # 2026-12-05T143212Z
    tmp = RESULTS / f".{uuid.uuid4().hex}.tmp"
    tmp.write_bytes(data)
    try:
        for n in range(1, 1000):
            target = RESULTS / f"{record['suite']}-{stamp}{f'-{n}' if n > 1 else ''}.json"
            try:
                os.link(tmp, target)  # fails if the name is taken: a record is never overwritten
                if record_path.with_suffix(".log").is_file():
                    shutil.copyfile(record_path.with_suffix(".log"), target.with_suffix(".log"))
                return target
            except FileExistsError:
                if target.read_bytes() == data:
                    return target
        raise ValueError(f"{record_path}: 999 records of suite {record['suite']} at {stamp} already")
    finally:
        tmp.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.render", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("--add", action="append", default=[], type=Path)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    for path in args.add:
        try:
            print(f"added {add(path)}")
        except ValueError as exc:
            print(f"bench-render: {exc}", file=sys.stderr)
            return 2
    index = Index(load_records(RESULTS))
    stale = []
    for path, text in rendered(index).items():
        if path.read_text() != text:
            stale.append(path)
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        names = ", ".join(str(p.relative_to(REPO)) for p in stale)
        print(f"{names}: not what benchmarks/results/ gives; run `make bench-render` and commit the result")
        return 1
    print("rendered " + (", ".join(str(p.relative_to(REPO)) for p in stale) or "nothing: already up to date"))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.render", main))
