"""What a suite command continues from: the record an earlier command of the same suite left in its work folder
on this host (`earlier`), whose finished parts are not run again but copied, with their figures, into the new
record (`carry_over`); and which families of parts have run on this machine (`warm_families`), so only their
first run pays the cold start.

A device host keeps /tmp and the repository's ignored outputs (artifacts/, runs/) between consecutive commands,
so a second command finds the first one's record in the work folder and its outputs where the parts left them.
An earlier record is continued only when it was written by the same suite at the same scale, from the same
commit, with the same options, and left some of the suite's parts unfinished (`--fresh` starts over anyway).
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.suites.record import scale_of

WARM = ".warm"  # a file per family of parts that has run on this machine, in the work folder


def earlier(
    work: Path, suite: str, scale: str, commit: str, options: dict, parts: list[str]
) -> tuple[dict | None, str]:
    """(the record to continue from, or None; why, for the log): the suite's record in `work` where it finished
    some of `parts` (every part of the suite) but not all."""
    path = work / f"{suite}.json"
    if not path.is_file():
        return None, ""
    try:
        found = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None, f"{path} is not JSON: starting afresh"
    differs = [
        what
        for what, same in (
            ("suite", found.get("suite") == suite),
            ("scale", scale_of(found) == scale),
            ("commit", found.get("commit") == commit),
            ("options", (found.get("options") or {}) == options),
        )
        if not same
    ]
    if differs:
        return None, f"the record in {path} differs in {', '.join(differs)}: starting afresh"
    if not set(parts) - set(finished(found)):
        return None, f"the run of {found.get('date')} in {path} finished every part: starting afresh"
    if not finished(found):
        return None, ""
    return found, f"continuing the run of {found.get('date')} ({path}): {', '.join(finished(found))} finished there"


def finished(record: dict) -> list[str]:
    """The parts of a record that ended well, in the order they ran."""
    return [name for name, part in (record.get("parts") or {}).items() if part.get("status") == "ok"]


def carry_over(record: dict, before: dict) -> None:
    """Copy `before`'s finished parts, their raw outputs and every figure it holds into `record` (the new
    command's parts then add to them and replace what they measure again), and note the command it continues."""
    for name in finished(before):
        part = before["parts"][name]
        record["parts"][name] = {**part, "earlier": part.get("earlier") or before["date"]}
        record["raw"][name] = (before.get("raw") or {}).get(name)
    record["figures"].update(before.get("figures") or {})
    own = {k: before.get(k) for k in ("date", "command", "wall_s", "status")} | {"finished": finished(before)}
    record["continues"] = [*(before.get("continues") or []), own]


def warm_families(work: Path) -> set[str]:
    folder = work / WARM
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


def mark_warm(work: Path, family: str) -> None:
    (work / WARM).mkdir(parents=True, exist_ok=True)
    (work / WARM / family).touch()
