"""`make demo`: the whole pipeline on the built-in tiny default, in one command, on the GPU when
torch sees one (every step), else on the CPU.

    python -m recipes.demo [run=demo] [steps=800] [seed=0] [arch=dflash] [prompts=0 (all)] [new_tokens=96]

The demo is the drafter command (`make drafter`, recipes.drafter) applied to a built-in target: its
builder, then the same plan (recipes.drafter.plan) run by the same runner (recipes.runner),
with the settings of configs/tiny.toml (or configs/smollm2-135m.toml, recipes.demo_smollm2). Steps,
each the project's own command (so the demo proves the CLIs users run):
  1. unpack the shipped tiny target and corpus, and       python -m recipes.tiny
     regenerate the answers with the target, if absent
     (a target trained here with `make tiny target=train` is kept)
  2. extract train + held-out shards (resumes if done)     python -m extract configs/tiny.toml ...
  3. train a drafter for a few minutes                     python -m train configs/tiny.toml ...
  4. evaluate it offline on the held-out shards            python -m train.eval RUN data=.../heldout
  5. export it for serving and decode speculatively        python -m train.serve.export / train.serve.specdecode
  6. write the training-health report                      python -m train.report RUN
and prints where everything is, with the measured numbers. The steps run with the interpreter
that runs the demo (`sys.executable`), so `python3 -m recipes.demo` works without the Makefile's
venv, and with OMP_NUM_THREADS = `common.device.small_model_threads()` unless it is set: on a
many-core host, torch's default of one thread per core makes these small models slower. With
fresh=false a rerun skips every step whose output is there with the same settings (the runner's
ledger, runs/RUN/stages.json).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from typing import Literal

from common.config import ConfigError, fail, knob, parse_cli
from common.interrupts import run_main
from common.io import read_record
from recipes.demo_smollm2 import (
    SCALES,
    print_smollm2_summary,
    smollm2_job,
    smollm2_prepare,
    smollm2_summary,
    write_summary,
)
from recipes.drafter.plan import Heldout, Job, plan_stages
from recipes.drafter.results import DTYPE_NAMES, eval_pair, machine_line, num, pick_spec, timings_line
from recipes.runner import Ledger, Runner, step

TINY = "artifacts/tiny"
CONFIG = "configs/tiny.toml"


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    target: Literal["auto", "tiny", "smollm2"] = knob(
        "auto",
        help="which target the demo runs on: tiny (the built-in 2.6 M-parameter toy), smollm2 (the real "
        "SmolLM2-135M-Instruct, recipes.demo_smollm2: full scale on a GPU, a reduced scale on a CPU); auto = smollm2 "
        "on a CUDA host, tiny on a CPU",
    )
    run: str = knob("demo", help="run name under runs/ (a plain name)")
    steps: int | None = knob(
        None,
        help="drafter training steps. A step count, not epochs: what the drafter learns should not depend on how "
        "long the regenerated answers are. Unset: 800 for the tiny target (fewer leave its drafter short of "
        "trained: docs/benchmarks-log-2026-11-30-to-2026-12-04.md, 'Demo'), the scale's for smollm2",
        min=1,
        max=100_000,
    )
    seed: int = knob(
        0,
        help="the drafter's seeds (its init, anchors, and the data order): another seed shows how much τ moves "
        "from training noise alone",
        min=0,
    )
    arch: Literal["dflash", "dflash2"] = knob(
        "dflash",
        help="the drafter class (train's model.arch): dflash, or dflash2 (block convolutions and a candidate "
        "selector, block 8)",
    )
    eval_anchors: int = knob(16, help="anchors per held-out sequence in the offline evaluation", min=1)
    prompts: int = knob(
        0,
        help="held-out prompts for real speculative decoding; 0 = all of them (74; fewer make the online τ "
        "a noisy estimate: its mean over 8 prompts moved by 10% with the choice of prompts)",
        min=0,
    )
    new_tokens: int = knob(
        96,
        help="at most this many tokens generated per prompt (a response also ends where it starts "
        "looping, as the tiny build's answers do)",
        min=1,
    )
    fresh: bool = knob(
        True, help="delete an earlier run of the same name first (the tiny target and shards are kept: they are cached)"
    )
    stop_after: Literal["none", "extraction", "training"] = knob(
        "none",
        help="smollm2: stop after that step (a later run with fresh=false goes on from there: every step resumes "
        "or finds its output done)",
    )


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_cli(DemoConfig, sys.argv[1:] if argv is None else argv)
        if "/" in cfg.run or cfg.run in ("", ".", ".."):
            fail("run", f"{cfg.run!r} must be a plain name")
    except ConfigError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    run_dir = os.path.join("runs", cfg.run)
    print(f"demo: drafter class {cfg.arch}" + (" (the default)" if cfg.arch == "dflash" else ""), flush=True)
    if cfg.fresh and os.path.isdir(run_dir):
        shutil.rmtree(run_dir)
    from recipes.drafter.machine import this_machine  # torch loads here, after --help and the checks

    machine = this_machine()
    print(f"demo: running on {machine_line(machine)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(machine["threads"])}
    target = cfg.target if cfg.target != "auto" else ("smollm2" if machine["device"] == "cuda" else "tiny")
    # Side by side only on a GPU and for the real target: on a few CPU cores each step already uses them all.
    runner = Runner(
        Ledger(os.path.join(run_dir, "stages.json")),
        env=env,
        label="demo",
        side_by_side=target == "smollm2" and machine["device"] == "cuda",
        log_dir=os.path.join(run_dir, "logs"),
    )
    if target == "smollm2":
        if cfg.target == "auto":
            print(
                "demo: a CUDA device is here, so the demo runs on the real target SmolLM2-135M-Instruct "
                "(target=tiny runs the toy instead)",
                flush=True,
            )
        return run_smollm2(cfg, run_dir, machine, runner)
    # The tiny build, extraction (configs/tiny.toml: device = auto), training and evaluation take the GPU by themselves.
    step(runner.timings, "tiny target + corpus", ["-m", "recipes.tiny"], env)
    runner.run(plan_stages(tiny_job(cfg, machine["device"])))
    export_dir = os.path.join(run_dir, "export")
    summary = summarize(run_dir, runner.timings, machine)
    with open(os.path.join(run_dir, "demo_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print_summary(summary, run_dir, export_dir)
    return 0


def tiny_job(cfg: DemoConfig, device: str) -> Job:
    """The drafter command's plan (recipes.drafter.plan) for the tiny target: its answers are already
    the target's own (recipes.tiny regenerates them), every stage reads configs/tiny.toml."""
    train = [f"optim.max_steps={cfg.steps or 800}", f"model.arch={cfg.arch}", *seed_overrides(cfg.seed)]
    spec = [f"num_prompts={cfg.prompts}", f"max_new_tokens={cfg.new_tokens}", f"stop_repeat={tiny_stop_repeat()}"]
    return Job(
        target=f"{TINY}/target",
        train_prompts=f"{TINY}/corpus/train_regen.jsonl",
        heldout=(Heldout("heldout", f"{TINY}/corpus/heldout_regen.jsonl"),),
        online="heldout",
        shards_dir=f"{TINY}/shards",
        runs_dir="runs",
        run_name=cfg.run,
        export_dir=os.path.join("runs", cfg.run, "export"),
        config=CONFIG,
        defaults={"specdecode": [f"device={device}"]},
        overrides={
            "train": train,
            "eval": [f"max_anchors={cfg.eval_anchors}"],
            "specdecode": [*spec, "agreement=true", "agreement_bf16=true"],
        },
    )


def run_smollm2(cfg: DemoConfig, run_dir: str, machine: dict, runner: Runner) -> int:
    """The real-target demo (recipes.demo_smollm2), at the scale the device allows."""
    scale = SCALES["full" if machine["device"] == "cuda" else "reduced"]
    if scale.name != "full":
        print(f"demo: no GPU here, so SmolLM2 runs at the reduced scale ({scale})", flush=True)
    name, args = smollm2_prepare(scale)
    step(runner.timings, name, args, runner.env)
    train = [*seed_overrides(cfg.seed), f"model.arch={cfg.arch}"]
    job = smollm2_job(scale, cfg.run, machine["device"], train, cfg.steps, cfg.eval_anchors)
    stop = {"extraction": "extraction", "training": "drafter training"}.get(cfg.stop_after, "")
    if not runner.run(plan_stages(job), stop_after=stop):
        print(f"demo: stopped after {stop} (stop_after); timings {runner.timings}", flush=True)
        return 0
    summary = smollm2_summary(run_dir, runner.timings, machine, scale)
    write_summary(summary, run_dir)
    print_smollm2_summary(summary, run_dir)
    return 0


def tiny_stop_repeat() -> int:
    """The loop rule the tiny build cut its answers by, so that online decoding ends responses where
    the training and held-out answers end (recipes.tiny `regen_stop_repeat`)."""
    regen = read_record(f"{TINY}/target/tiny_report.json").get("regenerated_corpus", {})
    return int(regen.get("stop_repeat", 0))


def seed_overrides(seed: int) -> list[str]:
    """The training overrides of the drafter's seeds (none for seed 0, the config's)."""
    return [f"seed={seed}", f"data.seed={seed}"] if seed else []


def summarize(run_dir: str, timings: dict[str, float], machine: dict | None = None) -> dict:
    """The numbers the demo prints, read back from the files the steps wrote."""
    report = read_record(f"{TINY}/target/tiny_report.json")
    target_keys = (
        "heldout_next_token_accuracy",
        "most_frequent_token_accuracy",
        "heldout_answer_next_token_accuracy",
        "most_frequent_token_answer_accuracy",
        "parameters",
        "num_layers",
        "hidden_size",
        "vocab_size",
        "tap_layer_ids",
    )
    drafter, baseline = eval_pair(f"{run_dir}/eval_heldout.json")
    return {
        "machine": machine or {},
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "total_s": round(sum(timings.values()), 1),
        "target": {k: report[k] for k in target_keys if k in report},
        "eval": drafter,
        "eval_baseline": baseline,
        "specdecode": pick_spec(read_record(f"{run_dir}/specdecode.json")),
    }


def summary_text(summary: dict) -> str:
    """The closing lines of the demo: timings and the measured numbers, drafter against baselines."""
    timings = timings_line(summary["timings_s"])
    target, ev, base, spec = summary["target"], summary["eval"], summary["eval_baseline"], summary["specdecode"]
    budgets = [b for b in (8, 16, 32, 64) if f"ddtree_tau_{b}" in ev]
    rows = [("acceptance at k=1", "acceptance_k1"), ("tau, chain of 15", "tau")] + [
        (f"tau, DDTree-{b}", f"ddtree_tau_{b}") for b in budgets
    ]
    lines = [
        "=" * 78,
        f"demo finished in {summary['total_s'] / 60:.1f} min ({timings})",
        *([f"on {machine_line(summary['machine'])}"] if summary.get("machine") else []),
        "",
        f"tiny target ({target.get('num_layers')} layers, {num(target.get('parameters', 0) / 1e6, '.1f')} M "
        "parameters): "
        f"held-out next-token accuracy {num(target.get('heldout_next_token_accuracy'))} "
        f"(always the most frequent token: {num(target.get('most_frequent_token_accuracy'))})",
        "",
        f"drafter, offline on the held-out shards ({ev.get('n_blocks', 0)} blocks; labels = the target's top-1):",
        f"  {'':<22}{'drafter':>10}{'most-frequent-label baseline':>31}",
    ]
    lines += [f"  {label:<22}{num(ev.get(key)):>10}{num(base.get(key)):>31}" for label, key in rows]
    lines += [
        "",
        f"drafter, online: real speculative decoding, {spec.get('prompts')} held-out prompts, up to "
        f"{spec.get('max_new_tokens')} tokens each"
        f"{' (cut where they start repeating)' if spec.get('stop_repeat') else ''}, "
        f"{str(spec.get('device') or 'cpu').upper()} {DTYPE_NAMES.get(spec.get('dtype'), spec.get('dtype'))}:",
        f"  tau {num(spec.get('tau'))} (offline tau of the same rounds, bf16 features: "
        f"{num(spec.get('offline_tau_at_rounds_bf16'))}); "
        f"output identical to target-only greedy decoding: {spec.get('lossless')}",
        f"  {num(spec.get('spec_tokens_per_s'), '.0f')} tok/s against "
        f"{num(spec.get('target_tokens_per_s'), '.0f')} tok/s for the "
        f"target alone = {num(spec.get('speedup'), '.2f')}x (a 2.6 M-parameter target costs no more per forward "
        "than its drafter,",
        "  so this speed says little; the speed-ups DFlash is for come from a target whose forward costs far more than "
        "the drafter's, e.g. the 27B on a GPU)",
    ]
    return "\n".join(lines)


def print_summary(summary: dict, run_dir: str, export_dir: str) -> None:
    print("\n" + summary_text(summary))
    print("\nwhere things are")
    print(f"  tiny target + corpus   {TINY}/target, {TINY}/corpus")
    print(f"  shards                 {TINY}/shards/train, {TINY}/shards/heldout   (python -m shards inspect DIR)")
    print(f"  run                    {run_dir}/ (config.json, metrics.jsonl, checkpoints/)")
    print(f"  offline evaluation     {run_dir}/eval_heldout.json")
    print(f"  exported drafter       {export_dir}/ (config.json, model.safetensors, dflash.py)")
    print(f"  speculative decoding   {run_dir}/specdecode.json")
    print(f"  training-health report {run_dir}/report.md (+ report_*.png)")
    print(f"  this summary           {run_dir}/demo_summary.json")


if __name__ == "__main__":
    raise SystemExit(
        run_main("demo", main, spawns=True, after="rerunning with fresh=false goes on from the finished steps")
    )
