"""`python -m tests.reliability` (= `make reliability`): the full reliability suite; writes the figures
to docs/reliability.md and exits non-zero if any scenario fails.

    python -m tests.reliability                      every scenario at full size (real processes)
    python -m tests.reliability --only 1,2 --seed 3  some scenarios, another seed
    python -m tests.reliability --quick              small counts in forked processes (checks the suite itself)
    python -m tests.reliability --only 3 --update    rerun scenario 3 and replace its figures in docs/reliability.md

The report is written only by a run of every scenario (or with --out, or --update for some
scenarios of an existing report); failed runs keep their work directory for inspection and say
where it is.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tests.reliability import bad_inputs, corruption, extract_kills, io_errors, security, thread_kills, train_kills
from tests.reliability.outcome import Outcome
from tests.reliability.report import update_report, write_report
from tests.reliability.world import REPO, build_world

FULL = {
    "extract_kills": 30,
    "train_kills": 22,
    "corruption_trials": 60,
    "record_examples": 1500,
    "config_examples": 500,
    "path_examples": 500,
    "thread_kills": 5,
    "writer_pairs": 3,
    "mode": "process",
}
QUICK = {
    "extract_kills": 4,
    "train_kills": 3,
    "corruption_trials": 8,
    "record_examples": 100,
    "config_examples": 50,
    "path_examples": 50,
    "thread_kills": 1,
    "writer_pairs": 1,
    "mode": "fork",
}


SCENARIO_NAMES = {
    1: "Extraction kills",
    2: "Training kills",
    3: "Corruption",
    4: "Full disk and I/O errors",
    5: "Bad inputs",
    6: "Security",
    7: "Extraction kills, default threads",
}
ALL = sorted(SCENARIO_NAMES)


def scenarios(sizes: dict, seed: int, world, work: Path) -> dict:
    """Scenario number -> a function running it at these sizes."""
    return {
        1: lambda: extract_kills.run(
            world, kills=sizes["extract_kills"], seed=seed, mode=sizes["mode"], work=work / "1"
        ),
        2: lambda: train_kills.run(world, kills=sizes["train_kills"], seed=seed, mode=sizes["mode"], work=work / "2"),
        3: lambda: corruption.run(world, trials=sizes["corruption_trials"], seed=seed, work=work / "3"),
        4: lambda: io_errors.run(world, work=work / "4"),
        5: lambda: bad_inputs.run(
            world,
            record_examples=sizes["record_examples"],
            config_examples=sizes["config_examples"],
            seed=seed,
            work=work / "5",
            writer_pairs=sizes["writer_pairs"],
        ),
        6: lambda: security.run(world, work=work / "6", examples=sizes["path_examples"]),
        7: lambda: thread_kills.run(world, kills=sizes["thread_kills"], seed=seed, work=work / "7"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.reliability", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", default=",".join(map(str, ALL)), help="comma-separated scenario numbers (default: all)"
    )
    parser.add_argument(
        "--seed", type=int, default=7, help="seed of the kill moments, damaged bytes and generated inputs"
    )
    parser.add_argument("--quick", action="store_true", help="small counts, forked processes")
    parser.add_argument(
        "--out", default=None, help="report path (default docs/reliability.md when every scenario runs)"
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="replace only these scenarios' rows and details in the existing report (docs/reliability.md or --out)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    only = sorted({int(x) for x in args.only.split(",") if x.strip()})
    sizes = QUICK if args.quick else FULL
    command = "python -m tests.reliability" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("train", "extract", "shards"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)  # the scenarios provoke errors on purpose
    started = time.time()
    date = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="reliability-"))
    print(
        f"reliability suite: scenarios {only}, seed {args.seed}, {'quick' if args.quick else 'full'}; work dir {work}",
        flush=True,
    )
    world = build_world(work / "world")
    world.baseline  # noqa: B018 (built now, before the scenarios' clocks start)
    runners = scenarios(sizes, args.seed, world, work)
    outcomes = []
    for number in only:
        (work / str(number)).mkdir(parents=True, exist_ok=True)
        print(f"[{number}] running ...", flush=True)
        try:
            outcome = runners[number]()
        except Exception:  # noqa: BLE001 - a crashing scenario is a failed one; the others still run
            outcome = Outcome(number, SCENARIO_NAMES[number])
            outcome.fail("the scenario itself crashed:\n" + traceback.format_exc())
            outcome.finish("crashed")
        outcomes.append(outcome)
        status = "PASS" if outcome.passed else "FAIL"
        print(f"[{number}] {status} {outcome.scenario}: {outcome.figure} ({outcome.seconds:.0f} s)", flush=True)
        for line in outcome.failures[:20]:
            print(f"      - {line[:400]}", flush=True)
    seconds = time.time() - started
    out = args.out or (str(REPO / "docs" / "reliability.md") if only == ALL and not args.quick else None)
    if args.update and not args.quick:
        out = args.out or str(REPO / "docs" / "reliability.md")
        update_report(Path(out), outcomes, command=command, date=date, seed=args.seed)
        print(f"updated scenario(s) {only} in {out}", flush=True)
    elif out:
        write_report(Path(out), outcomes, command=command, date=date, seed=args.seed, sizes=sizes, seconds=seconds)
        print(f"wrote {out}", flush=True)
    failed = [o for o in outcomes if not o.passed]
    if failed or args.keep:
        print(f"work directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{len(outcomes) - len(failed)}/{len(outcomes)} scenarios passed in {seconds / 60:.1f} min", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
