"""`make demo`: the whole pipeline on the built-in tiny default, in one command, on the GPU when
torch sees one (every step), else on the CPU.

    python -m recipes.demo [run=demo] [steps=800] [seed=0] [prompts=0 (all)] [new_tokens=96]

Steps, each the project's own command (so the demo proves the CLIs users run):
  1. unpack the shipped tiny target and corpus, and       python -m recipes.tiny
     regenerate the answers with the target, if absent
     (a target trained here with `make tiny target=train` is kept)
  2. extract train + held-out shards (resumes if done)     python -m extract configs/tiny.toml
  3. train a drafter for a few minutes                     python -m train configs/tiny.toml ...
  4. evaluate it offline on the held-out shards            python -m train.eval RUN --data .../heldout
  5. export it for serving and decode speculatively        python -m train.export / train.specdecode
  6. write the training-health report                      python -m train.report RUN
and prints where everything is, with the measured numbers. The steps run with the interpreter
that runs the demo (`sys.executable`), so `python3 -m recipes.demo` works without the Makefile's
venv, and with OMP_NUM_THREADS = `common.device.small_model_threads()` unless it is set: on a
many-core host, torch's default of one thread per core makes these small models slower.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Literal

from common.config import knob, parse_cli

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
        help="drafter training steps (about 190 s on 2 cores). 400 left the drafter short of trained: chain τ "
        "5.08-5.60 and online τ 3.95-4.51 over three seeds, against 6.94-7.21 and 5.66-5.97 at 800 (2-core VM, "
        "2026-12-01). A step count, not epochs: what the drafter learns should not depend on how long the "
        "regenerated answers are. Unset: 800 for the tiny target, the scale's for smollm2",
        min=1,
        max=100_000,
    )
    seed: int = knob(
        0,
        help="the drafter's seeds (its init, anchors, and the data order): another seed shows how much τ moves "
        "from training noise alone",
        min=0,
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
    cfg = parse_cli(DemoConfig, sys.argv[1:] if argv is None else argv)
    if "/" in cfg.run or cfg.run in ("", ".", ".."):
        raise SystemExit(f"config key 'run': {cfg.run!r} must be a plain name")
    run_dir = os.path.join("runs", cfg.run)
    if cfg.fresh and os.path.isdir(run_dir):
        shutil.rmtree(run_dir)
    timings: dict[str, float] = {}
    heldout = f"{TINY}/shards/heldout"
    export_dir = os.path.join(run_dir, "export")
    machine = demo_machine()
    print(f"demo: running on {machine_line(machine)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(machine["threads"])}
    target = cfg.target if cfg.target != "auto" else ("smollm2" if machine["device"] == "cuda" else "tiny")
    if target == "smollm2":
        if cfg.target == "auto":
            print(
                "demo: a CUDA device is here, so the demo runs on the real target SmolLM2-135M-Instruct "
                "(target=tiny runs the toy instead)",
                flush=True,
            )
        return run_smollm2(cfg, run_dir, machine, env, timings)
    steps = cfg.steps or 800
    # The tiny build, extraction (configs/tiny.toml: device = auto), training and evaluation take the GPU by themselves.
    step(timings, "tiny target + corpus", ["-m", "recipes.tiny"], env)
    step(timings, "extraction", ["-m", "extract", CONFIG], env)
    step(
        timings,
        "drafter training",
        ["-m", "train", CONFIG, f"run_name={cfg.run}", f"optim.max_steps={steps}", *seed_overrides(cfg.seed)],
        env,
    )
    step(
        timings,
        "offline evaluation",
        [
            "-m",
            "train.eval",
            run_dir,
            "--data",
            heldout,
            "--out",
            f"{run_dir}/eval_heldout.json",
            f"max_anchors={cfg.eval_anchors}",
        ],
        env,
    )
    step(timings, "export", ["-m", "train.export", run_dir, export_dir], env)
    step(
        timings,
        "speculative decoding",
        [
            "-m",
            "train.specdecode",
            "--target",
            f"{TINY}/target",
            "--drafter",
            export_dir,
            "--prompts",
            f"{TINY}/corpus/heldout_regen.jsonl",
            "--num-prompts",
            str(cfg.prompts),
            "--max-new-tokens",
            str(cfg.new_tokens),
            "--stop-repeat",
            str(tiny_stop_repeat()),
            "--agreement",
            "--agreement-bf16",
            "--device",
            machine["device"],
            "--out",
            f"{run_dir}/specdecode.json",
        ],
        env,
    )
    step(timings, "report", ["-m", "train.report", run_dir], env)
    summary = summarize(run_dir, timings, machine)
    with open(os.path.join(run_dir, "demo_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print_summary(summary, run_dir, export_dir)
    return 0


def run_smollm2(cfg: DemoConfig, run_dir: str, machine: dict, env: dict, timings: dict) -> int:
    """The real-target demo (recipes.demo_smollm2), at the scale the device allows."""
    from recipes.demo_smollm2 import SCALES, print_smollm2_summary, smollm2_stages, smollm2_summary, write_summary

    scale = SCALES["full" if machine["device"] == "cuda" else "reduced"]
    if scale.name != "full":
        print(f"demo: no GPU here, so SmolLM2 runs at the reduced scale ({scale})", flush=True)
    stages = smollm2_stages(scale, cfg.run, machine["device"], seed_overrides(cfg.seed), cfg.steps, cfg.eval_anchors)
    for stage in stages:
        # Side by side only on a GPU: on a few CPU cores each step already uses them all.
        if len(stage) > 1 and machine["device"] == "cuda":
            steps_together(timings, stage, env, os.path.join(run_dir, "logs"))
        else:
            for name, args in stage:
                step(timings, name, args, env)
        if stage[-1][0] == {"extraction": "extraction", "training": "drafter training"}.get(cfg.stop_after):
            print(f"demo: stopped after {stage[-1][0]} (stop_after); timings {timings}", flush=True)
            return 0
    summary = smollm2_summary(run_dir, timings, machine, scale)
    write_summary(summary, run_dir)
    print_smollm2_summary(summary, run_dir)
    return 0


def tiny_stop_repeat() -> int:
    """The loop rule the tiny build cut its answers by, so that online decoding ends responses where
    the training and held-out answers end (recipes.tiny `regen_stop_repeat`)."""
    regen = _read_json(f"{TINY}/target/tiny_report.json").get("regenerated_corpus", {})
    return int(regen.get("stop_repeat", 0))


def demo_machine() -> dict:
    """The device the demo's steps use (cuda when torch sees a GPU), the torch CPU threads they get,
    and the machine (CPU, cores, GPU, torch version)."""
    import torch

    from common.device import describe_machine, small_model_threads

    return {
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "threads": small_model_threads(),
        **describe_machine(),
    }


def machine_line(machine: dict) -> str:
    where = f"GPU ({machine.get('gpu')})" if machine.get("device") == "cuda" else "CPU"
    return (
        f"{where}; {machine.get('cpu')}, {machine.get('cores')} usable cores, {machine.get('threads')} torch CPU "
        "threads, "
        f"torch {machine.get('torch')}"
    )


def seed_overrides(seed: int) -> list[str]:
    """The training overrides of the drafter's seeds (none for seed 0, the config's)."""
    return [f"seed={seed}", f"data.seed={seed}"] if seed else []


def step(timings: dict[str, float], name: str, args: list[str], env: dict[str, str] | None = None) -> None:
    print(f"\n=== {name}: python {' '.join(args)}", flush=True)
    start = time.time()
    result = subprocess.run([sys.executable, *args], env=env)
    timings[name] = time.time() - start
    # Said as each step ends, so a run cut short (a lost machine, a time limit) still shows where the time went.
    print(f"=== {name}: {timings[name]:.1f} s (demo so far {sum(timings.values()):.1f} s)", flush=True)
    if result.returncode != 0:
        raise SystemExit(f"demo: step '{name}' failed (exit {result.returncode}); its output is above")


def steps_together(
    timings: dict[str, float], stage: list[tuple[str, list[str]]], env: dict[str, str] | None, log_dir: str
) -> None:
    """The steps of `stage` as processes side by side, each writing to its own log in `log_dir` (their
    progress bars would interleave), its end printed as it ends. The stage's wall time is recorded under
    the steps' names joined by ' + ', so the demo's total stays the sum of its timings."""
    from common.processes import run_side_by_side

    name = " + ".join(n for n, _ in stage)
    print(f"\n=== {name}, side by side (logs in {log_dir}/)", flush=True)
    start = time.time()
    ended = run_side_by_side(stage, log_dir, max_running=len(stage), env=env)
    timings[name] = time.time() - start
    print(f"=== {name}: {timings[name]:.1f} s (demo so far {sum(timings.values()):.1f} s)", flush=True)
    failed = [f"'{e.name}' (exit {e.exit}, log {e.log})" for e in ended if e.exit != 0]
    if failed:
        raise SystemExit(f"demo: step {', '.join(failed)} failed; its log's end is above")


def summarize(run_dir: str, timings: dict[str, float], machine: dict | None = None) -> dict:
    """The numbers the demo prints, read back from the files the steps wrote."""
    report = _read_json(f"{TINY}/target/tiny_report.json")
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
    evaluation = _read_json(f"{run_dir}/eval_heldout.json")
    spec = _read_json(f"{run_dir}/specdecode.json")
    checkpoints = evaluation.get("checkpoints") or [{}]
    return {
        "machine": machine or {},
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "total_s": round(sum(timings.values()), 1),
        "target": {k: report[k] for k in target_keys if k in report},
        "eval": _pick_eval(checkpoints[0].get("overall", {})),
        "eval_baseline": _pick_eval((evaluation.get("baseline") or {}).get("overall", {})),
        "specdecode": _pick_spec(spec),
    }


def _pick_eval(overall: dict) -> dict:
    keys = ("n_blocks", "tau", "all_accepted", "ddtree_tau_8", "ddtree_tau_16", "ddtree_tau_32", "ddtree_tau_64")
    picked = {k: overall[k] for k in keys if k in overall}
    acceptance = overall.get("position_acceptance") or []
    if acceptance:
        picked["acceptance_k1"] = acceptance[0]
    return picked


def _pick_spec(spec: dict) -> dict:
    summary, config = spec.get("summary", {}), spec.get("config", {})
    agreement = spec.get("agreement", {})
    return {
        "prompts": summary.get("prompts"),
        "max_new_tokens": config.get("max_new_tokens"),
        "tau": summary.get("tau"),
        "stop_repeat": config.get("stop_repeat"),
        "device": config.get("device"),
        "dtype": config.get("dtype"),
        "lossless": summary.get("lossless"),
        "speedup": summary.get("speedup"),
        "spec_tokens_per_s": summary.get("spec", {}).get("decode_tokens_per_s"),
        "target_tokens_per_s": summary.get("baseline", {}).get("decode_tokens_per_s"),
        "offline_tau_at_rounds_bf16": agreement.get("offline_tau_at_rounds"),
    }


DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", None: "fp32"}


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def _num(value, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def summary_text(summary: dict) -> str:
    """The closing lines of the demo: timings and the measured numbers, drafter against baselines."""
    timings = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in summary["timings_s"].items())
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
        f"tiny target ({target.get('num_layers')} layers, {_num(target.get('parameters', 0) / 1e6, '.1f')} M "
        "parameters): "
        f"held-out next-token accuracy {_num(target.get('heldout_next_token_accuracy'))} "
        f"(always the most frequent token: {_num(target.get('most_frequent_token_accuracy'))})",
        "",
        f"drafter, offline on the held-out shards ({ev.get('n_blocks', 0)} blocks; labels = the target's top-1):",
        f"  {'':<22}{'drafter':>10}{'most-frequent-label baseline':>31}",
    ]
    lines += [f"  {label:<22}{_num(ev.get(key)):>10}{_num(base.get(key)):>31}" for label, key in rows]
    lines += [
        "",
        f"drafter, online: real speculative decoding, {spec.get('prompts')} held-out prompts, up to "
        f"{spec.get('max_new_tokens')} tokens each"
        f"{' (cut where they start repeating)' if spec.get('stop_repeat') else ''}, "
        f"{str(spec.get('device') or 'cpu').upper()} {DTYPE_NAMES.get(spec.get('dtype'), spec.get('dtype'))}:",
        f"  tau {_num(spec.get('tau'))} (offline tau of the same rounds, bf16 features: "
        f"{_num(spec.get('offline_tau_at_rounds_bf16'))}); "
        f"output identical to target-only greedy decoding: {spec.get('lossless')}",
        f"  {_num(spec.get('spec_tokens_per_s'), '.0f')} tok/s against "
        f"{_num(spec.get('target_tokens_per_s'), '.0f')} tok/s for the "
        f"target alone = {_num(spec.get('speedup'), '.2f')}x (a 2.6 M-parameter target costs no more per forward "
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
    sys.exit(main())
