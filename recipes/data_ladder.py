"""How τ grows with data: the same drafter trained on growing shares of one training set (a fixed,
uniformly spread subset each: `data.max_samples`), each evaluated offline on the same held-out shards.

    python -m recipes.data_ladder CONFIG --eval DIR [--eval DIR ...] [--fractions 0.1,0.3,1]
        [--steps N] [--prefix ladder] [--out ladder.json] [train key=value ...]
    python -m recipes.data_ladder configs/smollm2-135m.toml --eval artifacts/smollm2/shards/humaneval \\
        --eval artifacts/smollm2/shards/chat_heldout --fractions 0.1,0.3,1 --steps 800 device=cuda

Every size trains the same number of steps (`--steps`, or the config's), so a smaller share is seen for
more epochs; the table prints both, with the loss tokens each run trained on, so the reader sees
whether a point is short of data or short of steps. Runs go to runs/PREFIX-fFRACTION. Bad arguments,
a config that does not load and `--eval` sets that cannot be read are refused in one line before the
first run trains; a run that fails stops the ladder after its own message. Exit statuses:
docs/ARCHITECTURE.md, "Exit status".
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from common.config import parse_cli
from common.interrupts import run_main
from common.io import exists_at, join_uri
from common.locations import check_problem
from common.processes import run_child
from recipes.drafter.results import num
from shards import ShardDataset
from shards.manifest import MANIFEST_NAME
from train.config import TrainConfig


class StepFailed(Exception):
    """A training or evaluation run of the ladder failed (it printed its own reason)."""


def _run(argv: list[str]) -> None:
    code = run_child(argv[1:])
    if code != 0:
        raise StepFailed(f"step failed (exit {code}): {' '.join(argv[1:])}")


def train_share(config: str, run: str, samples: int, steps: int | None, overrides: list[str]) -> None:
    argv = [sys.executable, "-m", "train", config, f"run_name={run}", f"data.max_samples={samples}", *overrides]
    if steps:
        argv.append(f"optim.max_steps={steps}")
    _run(argv)


def evaluate(run_dir: str, data: str, out: str, split: str | None = None, max_anchors: int = 0) -> dict:
    argv = [sys.executable, "-m", "train.eval", run_dir, "--data", data, "--out", out]
    argv += [f"split={split}"] if split else []
    argv += [f"max_anchors={max_anchors}"] if max_anchors else []
    _run(argv)
    with open(out) as f:
        overall = (json.load(f).get("checkpoints") or [{}])[0].get("overall", {})
    return {k: overall.get(k) for k in ("tau", "ddtree_tau_64", "n_blocks")}


def run_summary(run_dir: str) -> dict:
    """Steps, epochs, samples and tokens trained on, from the run's own files."""
    with open(os.path.join(run_dir, "run.json")) as f:
        run = json.load(f)
    with open(os.path.join(run_dir, "data_plan.json")) as f:
        plan = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        last = json.loads(f.read().strip().splitlines()[-1])
    steps, per_epoch = run.get("total_steps"), run.get("steps_per_epoch")
    return {
        "total_steps": steps,
        "epochs": steps / per_epoch if steps and per_epoch else None,
        "samples": sum(b.get("samples", 0) for b in plan.get("buckets", [])),
        "tokens_seen": last.get("tokens"),
    }


def dataset_samples(config: str, overrides: list[str]) -> int:
    cfg = parse_cli(TrainConfig, [config, *overrides], section="train")
    return len(ShardDataset(cfg.data.shards))


def parse_fractions(text: str) -> list[float]:
    """The shares of `--fractions`, each in (0, 1]; ValueError naming the option otherwise."""
    try:
        fractions = [float(f) for f in text.split(",")]
    except ValueError:
        fractions = []
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        raise ValueError(f"--fractions: expected comma-separated shares in (0, 1], got {text!r}")
    return fractions


def check_eval_sets(sets: list[str]) -> None:
    """ValueError naming `--eval` unless each is a dataset that can be read (before any training)."""
    for data in sets:
        problem = check_problem(data, "data_in")
        if problem is None and not exists_at(join_uri(data, MANIFEST_NAME)):
            problem = f"no shards dataset at {data!r} (no {MANIFEST_NAME})"
        if problem:
            raise ValueError(f"--eval: {problem}")


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--eval", action="append", required=True, help="held-out shards to evaluate on (repeat)")
    parser.add_argument("--fractions", default="0.1,0.3,1", help="shares of the training set, comma-separated")
    parser.add_argument("--steps", type=int, default=None, help="training steps of every run (default: the config's)")
    parser.add_argument("--prefix", default="ladder")
    parser.add_argument("--eval-split", default=None, help="train.eval's split (all: measure training data on purpose)")
    parser.add_argument(
        "--max-anchors",
        type=int,
        default=16,
        help="anchors per held-out sequence (0 = every position; the demo's offline evaluation uses 16 too)",
    )
    parser.add_argument("--out", default=None, help="write the table as JSON here (after every run)")
    args, overrides = parser.parse_known_args(argv)
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps: expected a positive number of steps, got {args.steps}")
    if args.max_anchors < 0:
        raise ValueError(f"--max-anchors: expected 0 or more, got {args.max_anchors}")
    return args, overrides, parse_fractions(args.fractions)


def main(argv: list[str] | None = None) -> int:
    try:
        args, overrides, fractions = parse_args(argv)
        check_eval_sets(args.eval)
        rows = ladder(args, overrides, fractions, dataset_samples(args.config, overrides))
    except (ValueError, OSError) as err:
        print(f"data_ladder: {err}", file=sys.stderr)
        return 2
    except StepFailed as err:
        print(f"data_ladder: {err}", file=sys.stderr)
        return 1
    print_table(rows, args.eval)
    return 0


def ladder(args: argparse.Namespace, overrides: list[str], fractions: list[float], total: int) -> list[dict]:
    """Train and evaluate each share; the rows of the table (also written to --out after each)."""
    rows = []
    for fraction in sorted(fractions):
        run = f"{args.prefix}-f{fraction:g}"
        run_dir = os.path.join("runs", run)
        samples = max(1, round(fraction * total))
        train_share(args.config, run, samples, args.steps, overrides)
        row = {"fraction": fraction, "samples_asked": samples, "run": run_dir, **run_summary(run_dir)}
        for data in args.eval:
            name = os.path.basename(os.path.normpath(data))
            out = os.path.join(run_dir, f"eval_{name}.json")
            row[name] = evaluate(run_dir, data, out, args.eval_split, args.max_anchors)
        rows.append(row)
        if args.out:  # each finished size is kept, also when a later one is cut short
            write_table(args.out, args.config, overrides, rows)
    return rows


def print_table(rows: list[dict], eval_sets: list[str]) -> None:
    names = [os.path.basename(os.path.normpath(d)) for d in eval_sets]
    header = f"\n{'share':>6} {'samples':>8} {'steps':>6} {'epochs':>7} {'tokens seen':>12} "
    print(header + " ".join(f"{'tau ' + n:>22}" for n in names))
    for row in rows:
        taus = " ".join(f"{num((row[n] or {}).get('tau')):>22}" for n in names)
        print(
            f"{row['fraction']:>6g} {row['samples']:>8} {num(row.get('total_steps'), 'd'):>6} "
            f"{num(row.get('epochs'), '.2f'):>7} {num(row.get('tokens_seen'), ',d'):>12} {taus}"
        )


def write_table(path: str, config: str, overrides: list[str], rows: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"config": config, "overrides": overrides, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    raise SystemExit(run_main("data_ladder", main, spawns=True))
