"""DFlash2 against DFlash on the tiny default, at equal data and steps, with seeds (not a test).

    python -m benchmarks.dflash2_tiny                            # dflash and dflash2 at block 16, seeds 0 and 1
    python -m benchmarks.dflash2_tiny --runs dflash:8,dflash2:8 --seeds 0 --steps 400 --out bench.json
    python -m benchmarks.dflash2_tiny --runs dflash2:16 --set loss.selector_weight=0   # an ablation (its rows say so)

Each run trains `python -m train configs/tiny.toml` (in this process) with `model.arch`, `model.block_size`,
`seed` and `data.seed` set and `optim.max_steps=--steps`; runs that differ only in the class see the same
batches and anchors. Needs the tiny default's shards (`make tiny`, `make extract`). Then the offline chain
τ of every checkpoint on the held-out shards by `train.eval` (`eval_heldout.json` in the run directory), on
the same blocks for every run (`--anchors` per answer, seeded), for

    unary     the argmax of the target head over the drafter's output (DFlash's proposal; for a DFlash2
              checkpoint its backbone alone)
    selector  DFlash2's proposal: the selector's greedy walk over the head's top-k (`DFlash2Drafter.propose`)

The record (`--out`, then `python -m benchmarks.render --add FILE`) holds one row per run and
the means over seeds (an ablation's, with `--set`, its rows only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from common.interrupts import run_main

CONFIG = "configs/tiny.toml"
HELDOUT = "artifacts/tiny/shards/heldout"


def parse_runs(text: str) -> list[tuple[str, int]]:
    """'dflash:16,dflash2:16' -> [("dflash", 16), ("dflash2", 16)]."""
    out = []
    for word in text.split(","):
        arch, _, block = word.strip().partition(":")
        if arch not in ("dflash", "dflash2") or not block.isdigit():
            raise SystemExit(f"--runs: {word!r} is not CLASS:BLOCK with CLASS dflash or dflash2")
        out.append((arch, int(block)))
    return out


def train_run(arch: str, block: int, seed: int, steps: int, workdir: str, settings: list[str]) -> tuple[str, float]:
    """(run directory, seconds) of one training run of the tiny default, with the extra `settings` (key=value)."""
    from common.config import load_config
    from train.config import TrainConfig
    from train.loop import train

    name = f"{arch}-b{block}-s{seed}-{steps}" + "".join(f"-{w.replace('=', '_')}" for w in settings)
    words = [f"out_dir={workdir}", f"run_name={name}", f"model.arch={arch}", f"model.block_size={block}"]
    words += [f"seed={seed}", f"data.seed={seed}", f"optim.max_steps={steps}", "log.progress=false", "device=cpu"]
    words += settings
    started = time.perf_counter()
    summary = train(load_config(TrainConfig, CONFIG, words, section="train"))
    return summary["run_dir"], time.perf_counter() - started


def chain_tau(run_dir: str, anchors: int, seed: int) -> dict:
    """Offline chain τ of a run's last checkpoint on the held-out shards (module docstring), by `train.eval`."""
    from common.config import load_config
    from train.eval.config import EvalConfig
    from train.eval.run import evaluate_checkpoints

    words = [f"data={HELDOUT}", "split=all", f"max_anchors={anchors}", f"seed={seed}", "budgets=[8]"]
    words += ["device=cpu", "progress=false", f"out={os.path.join(run_dir, 'eval_heldout.json')}"]
    report, _ = evaluate_checkpoints([run_dir], load_config(EvalConfig, None, words))
    (model,) = report["checkpoints"]
    dflash2 = model["proposals"] == "selector"
    unary = model["unary"]["overall"] if dflash2 else model["overall"]
    return {
        "unary_tau": unary["tau"],
        "selector_tau": model["overall"]["tau"] if dflash2 else None,
        "blocks": model["overall"]["n_blocks"],
    }


def last_metrics(run_dir: str) -> dict:
    """Training's own view at the end: the last 50 steps' mean unary and selector streaks and coverage."""
    from train.metrics import read_metrics

    tail = read_metrics(os.path.join(run_dir, "metrics.jsonl"))[-50:]
    mean = lambda key: statistics.fmean(r[key] for r in tail) if tail and tail[0].get(key) is not None else None  # noqa: E731
    return {
        "train_streak": mean("streak"),
        "train_selector_streak": mean("selector_streak"),
        "coverage": mean("selector_coverage"),
    }


def means(rows: list[dict]) -> dict:
    """Figures over seeds: per (class, block), the mean of each τ, and the selector's against DFlash's."""
    out = {}
    for arch, block in sorted({(r["class"], r["block_size"]) for r in rows}):
        same = [r for r in rows if r["class"] == arch and r["block_size"] == block]
        for kind in ("unary_tau", "selector_tau"):
            values = [r[kind] for r in same if r[kind] is not None]
            if values:
                out[f"dflash2_tiny.{arch}.b{block}.{kind}"] = statistics.fmean(values)
    for block in {r["block_size"] for r in rows}:
        base, new = (
            out.get(f"dflash2_tiny.dflash.b{block}.unary_tau"),
            out.get(f"dflash2_tiny.dflash2.b{block}.selector_tau"),
        )
        if base and new:
            out[f"dflash2_tiny.b{block}.selector_vs_dflash"] = new / base
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dflash2_tiny", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="dflash:16,dflash2:16", help="CLASS:BLOCK,... trained side by side")
    p.add_argument("--seeds", default="0,1", help="seed and data.seed of each run")
    p.add_argument("--steps", type=int, default=800, help="optimizer steps (the demo's 800)")
    p.add_argument("--anchors", type=int, default=16, help="anchors per held-out answer (the demo's 16)")
    p.add_argument("--set", action="append", default=[], help="an extra training setting key=value for every run")
    p.add_argument("--workdir", default="runs/dflash2-tiny")
    p.add_argument("--out", default=None, help="write the record (benchmarks/suites/record.py schema) here")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not os.path.isfile(os.path.join(HELDOUT, "manifest.json")):
        print(f"no tiny held-out shards at {HELDOUT}: run `make tiny` and `make extract` first", file=sys.stderr)
        return 2
    from benchmarks.suites.record import new_record, utc_now, write_record

    record = new_record(
        "dflash2-tiny",
        "cpu",
        "python -m benchmarks.dflash2_tiny " + " ".join(sys.argv[1:] if argv is None else argv),
        0,
    )
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arch, block in parse_runs(args.runs):
            run_dir, seconds = train_run(arch, block, seed, args.steps, args.workdir, args.set)
            row = {"class": arch, "block_size": block, "seed": seed, "steps": args.steps, "train_s": round(seconds)}
            row["settings"] = " ".join(args.set) or None
            row |= chain_tau(run_dir, args.anchors, seed=0) | last_metrics(run_dir)
            rows.append(row)
            print(json.dumps(row), flush=True)
            # An ablation (--set) keeps its rows apart: the comparison's figures are of the plain recipe.
            record["figures"] = (
                {"dflash2_tiny.ablation_rows": rows} if args.set else {"dflash2_tiny.rows": rows, **means(rows)}
            )
            if args.out:  # after every run, so a cut-short benchmark keeps what it measured
                write_record(record, Path(args.out))
    record["status"], record["finished"] = "complete", utc_now()
    for key, value in record["figures"].items():
        if not key.endswith("rows"):
            print(f"{key}: {value:.4f}")
    if args.out:
        write_record(record, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main("benchmarks.dflash2_tiny", main))
