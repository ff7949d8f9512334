"""Scenario 5's records family (issue 54): `python -m benchmarks.render --add RECORD` (how a GPU suite's
record is kept) in a copy of the checkout's results and rendered pages.

- a malformed record (a field of the wrong type, a `suite` that is a path or no suite's name, a date
  that is no date, not JSON, not an object, a smoke-scale record): exit 2, one line naming the file,
  nothing written (not in benchmarks/results/, not outside it), and `--check` still passes;
- two records of one suite made in the same minute (and second): both kept, under two names; the
  same record added twice: kept once.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

from tests.reliability.cli import call_main, one_line_problems

GOOD = {
    "schema": 1,
    "suite": "shape27b",
    "scale": "h200",
    "status": "complete",
    "date": "2026-12-05T14:32:12Z",
    "commit": "abc1234",
    "machine": {"gpu": "NVIDIA H200", "gpus": 1, "cores": 16},
    "packages": {"torch": "2.13.0"},
    "command": "python3 -m benchmarks.suites shape27b",
    "figures": {"shape27b.round.tau": 3.0},
}
MALFORMED = {
    "machine a string": {"machine": "H200"},
    "packages a list": {"packages": ["torch"]},
    "commit a number": {"commit": 1234},
    "suite climbing out": {"suite": "../../../escaped"},
    "suite an absolute path": {"suite": "/tmp/dflash-escaped"},
    "suite unknown": {"suite": "nosuch"},
    "date no date": {"date": "yesterday"},
    "figures a list": {"figures": [1, 2]},
    "wall_s a string": {"wall_s": "long"},
    "smoke scale": {"scale": "smoke"},
}


@contextlib.contextmanager
def checkout_copy(work: Path):
    """benchmarks.render pointed at a copy of benchmarks/results/, docs/benchmarks.md and README.md."""
    from benchmarks import render

    root = work / "checkout"
    shutil.rmtree(root, ignore_errors=True)
    saved = {name: getattr(render, name) for name in ("RESULTS", "DOC", "README", "REPO")}
    shutil.copytree(render.RESULTS, root / "benchmarks" / "results")
    for name in ("DOC", "README"):
        target = root / saved[name].relative_to(saved["REPO"])
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(saved[name], target)
        setattr(render, name, target)
    render.RESULTS, render.REPO = root / "benchmarks" / "results", root
    try:
        yield root
    finally:
        for name, value in saved.items():
            setattr(render, name, value)


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def run_all(tally, work: Path) -> None:
    from benchmarks import render

    work.mkdir(parents=True, exist_ok=True)
    with checkout_copy(work) as root:
        before = files_under(work)
        for name, change in MALFORMED.items():
            path = work / f"{name.replace(' ', '-')}.json"
            path.write_text(json.dumps({**GOOD, **change}))
            code, stderr = call_main(render.main, ["--add", str(path)])
            problems, _ = one_line_problems(code, stderr, exit_code=2, says=(str(path),))
            written = sorted(set(files_under(work)) - set(before) - {path.name})
            problems += [f"wrote {written}"] if written else []
            escaped = list(Path("/tmp").glob("dflash-escaped*"))
            problems += [f"wrote outside the checkout: {escaped}"] if escaped else []
            for stray in escaped:
                stray.unlink()
            code, out = call_main(render.main, ["--check"])
            problems += [] if code == 0 else [f"--check fails afterwards ({code})"]
            tally.add(f"records:{name}", not problems, f"--add a record with {name}: {'; '.join(problems)}")
            path.unlink()
        for name, text in (("not JSON", "{not json"), ("not an object", "[1, 2]")):
            path = work / "bad.json"
            path.write_text(text)
            code, stderr = call_main(render.main, ["--add", str(path)])
            problems, _ = one_line_problems(code, stderr, exit_code=2, says=(str(path),))
            tally.add(f"records:{name}", not problems, f"--add {name}: {'; '.join(problems)}")
        first, second = work / "first.json", work / "second.json"
        first.write_text(json.dumps(GOOD))
        second.write_text(json.dumps({**GOOD, "figures": {"shape27b.round.tau": 3.5}}))
        kept = [render.add(first), render.add(second), render.add(first)]
        ok = len({kept[0], kept[1]}) == 2 and kept[2] == kept[0] and all(p.parent == render.RESULTS for p in kept)
        ok = ok and json.loads(kept[1].read_text())["figures"]["shape27b.round.tau"] == 3.5
        tally.add("records:same minute", ok, f"two records of one suite in the same second: kept as {kept}")
        shutil.rmtree(root)
