"""DFlash2 against DFlash on the tiny default, at equal data and steps, with seeds (not a test).

    python -m benchmarks.dflash2_tiny                            # dflash and dflash2 at block 16, seeds 0 and 1
    python -m benchmarks.dflash2_tiny --runs dflash:8,dflash2:8 --seeds 0 --steps 400 --out bench.json
    python -m benchmarks.dflash2_tiny --runs dflash2:16 --set loss.selector_weight=0   # an ablation (its rows say so)

Each run trains `python -m train configs/tiny.toml` (in this process) with `model.arch`, `model.block_size`,
`seed` and `data.seed` set and `optim.max_steps=--steps`; runs that differ only in the class see the same
batches and anchors. Needs the tiny default's shards (`make tiny`, `make extract`). Then the offline chain
τ of every checkpoint on the held-out shards, on the same blocks for every run (`--anchors` per answer,
seeded): τ = 1 + the leading draft positions equal to the target's greedy tokens (the stored top-1), for

    unary     the argmax of the target head over the drafter's output (DFlash's proposal; for a DFlash2
              checkpoint its backbone alone)
    selector  DFlash2's proposal: the selector's greedy walk over the head's top-k (`DFlash2Drafter.propose`)

This is the benchmark's own small evaluation (no DDTree, no online decoding): `train.eval` scores the unary
proposal only. The record (`--out`, then `python -m benchmarks.render --add FILE`) holds one row per run and
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

import torch

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


@torch.no_grad()
def chain_tau(run_dir: str, anchors: int, seed: int) -> dict:
    """Offline chain τ of a run's last checkpoint on the held-out shards (module docstring)."""
    from shards import ShardDataset
    from target.identity import stored_head_or_none
    from train.attention import build_layer_masks
    from train.blocks import make_blocks, step_generator
    from train.eval.checkpoints import load_eval_model, read_checkpoint, target_dir_for

    info = read_checkpoint(run_dir)
    dataset = ShardDataset(HELDOUT)
    target = target_dir_for(info, None, dataset.manifest)
    model = load_eval_model(info, target, torch.device("cpu"), torch.float32, stored_head_or_none(target))
    K, dflash2 = model.block_size, info.drafter_config.arch == "dflash2"
    streaks = {"unary": 0.0, "selector": 0.0}
    blocks_seen = 0
    for i in range(len(dataset)):
        s = dataset.torch(i)
        T = int(s["input_ids"].numel())
        blocks = make_blocks(
            s["input_ids"][None].long(),
            s["loss_mask"][None],
            torch.tensor([T]),
            s["topk_ids"][None],
            block_size=K,
            num_anchors=anchors,
            gamma=7.0,
            mask_token_id=model.mask_token_id,
            generator=step_generator(seed, i),
        )
        if blocks.num_blocks == 0:
            continue
        mask = build_layer_masks("sdpa", blocks.anchors_BN, blocks.keep_BN, T, K, model.mask_rules)
        out_BQD = model.model(model.head.embed(blocks.block_ids_BQ), s["hidden"][None], blocks.position_ids_BP, mask)
        N = blocks.anchors_BN.shape[1]
        drafts_NLD = out_BQD.view(N, K, -1)[:, 1:]
        labels_NL = blocks.labels_BQ.view(N, K)[:, 1:]
        valid_NL = (blocks.weights_BQ > 0).view(N, K)[:, 1:]
        proposals = {"unary": model.head.logits(drafts_NLD).argmax(-1)}
        if dflash2:
            anchor_N = blocks.block_ids_BQ.view(N, K)[:, 0]
            proposals["selector"] = model.model.propose(drafts_NLD, model.head.lm_head_VD, anchor_N)
        keep_N = blocks.keep_BN[0]
        for kind, tokens_NL in proposals.items():
            hits_NL = (tokens_NL == labels_NL) & valid_NL
            streaks[kind] += float((torch.cumprod(hits_NL.int(), dim=-1).sum(-1) * keep_N).sum())
        blocks_seen += blocks.num_blocks
    taus = {f"{kind}_tau": 1 + streaks[kind] / blocks_seen for kind in ("unary", "selector")}
    return {**taus, "selector_tau": taus["selector_tau"] if dflash2 else None, "blocks": blocks_seen}


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
    sys.exit(main())
