"""`run_drafter(cfg) -> summary`: the drafter command as a library call (what `python -m
recipes.drafter` and a test's in-process run do): the target's architecture checked (a family no
DFlash drafter can serve is refused in one line, before anything is written), the prompt sets, the
derived defaults, the steps (validated with each stage's own config before any runs), the run, and
the summary.

Layout of OUT (`DrafterRecipeConfig.out_dir`):

    drafter.json          the config, the derived defaults with their reasons, how the prompt sets were made
    stages.json           the ledger of the steps (recipes.drafter.runner)
    prompts/              train.jsonl, heldout.jsonl: the prompt sets the steps read
    regen/{train,heldout} the target's own answers (python -m extract.regenerate)
    shards/{train,heldout} hidden states of the taps and the target's top-k (python -m extract)
    run/                  the training run, eval_heldout.json, specdecode.json, report.md
    export/               the drafter, ready to serve (docs/serving.md)
    summary.json          the closing summary (also printed)
    logs/                 the steps' logs where they run side by side (a GPU)
"""

from __future__ import annotations

import json
import os

from common.config import ConfigError, config_to_dict, parse_cli
from common.io import atomic_write_text, read_record
from extract.config import ExtractConfig
from extract.regenerate.config import RegenerateConfig
from recipes.drafter.config import DrafterRecipeConfig
from recipes.drafter.defaults import Derived, derive, stage_defaults
from recipes.drafter.plan import Heldout, Job, plan_stages
from recipes.drafter.prompts import PromptSplit, split_prompts
from recipes.drafter.results import DTYPE_NAMES, eval_pair, num, pick_spec, timings_line
from recipes.drafter.runner import Ledger, Runner, Stage
from target.arch import check_architecture
from train.config import TrainConfig
from train.eval.__main__ import parse_args as parse_eval_args
from train.report.config import parse_report_args
from train.serve.cli import parse_export_args, parse_specdecode_args

PARSERS = {
    "extract.regenerate": lambda args: parse_cli(RegenerateConfig, args, section="regenerate"),
    "extract": lambda args: parse_cli(ExtractConfig, args, section="extract"),
    "train": lambda args: parse_cli(TrainConfig, args, section="train"),
    "train.eval": parse_eval_args,
    "train.serve.export": parse_export_args,
    "train.serve.specdecode": parse_specdecode_args,
    "train.report": parse_report_args,
}


def build_job(cfg: DrafterRecipeConfig, prompts: PromptSplit, derived: list[Derived]) -> Job:
    out = cfg.out_dir
    defaults = stage_defaults(cfg, derived)
    defaults.setdefault("train", []).extend([f"seed={cfg.seed}", f"data.seed={cfg.seed}"])
    return Job(
        target=cfg.target,
        train_prompts=prompts.train,
        heldout=(Heldout("heldout", prompts.heldout),),
        online="heldout",
        shards_dir=os.path.join(out, "shards"),
        runs_dir=out,
        run_name="run",
        export_dir=os.path.join(out, "export"),
        regen_dir=os.path.join(out, "regen") if cfg.regenerate else "",
        config=cfg.config,
        server=cfg.server,
        defaults=defaults,
        overrides=cfg.overrides,
    )


def check_steps(groups: list[list[Stage]]) -> None:
    """Every step's command line through its stage's own parser, before anything runs: a bad
    STAGE.key=value fails here, naming the stage and the key."""
    for stage in (s for group in groups for s in group):
        try:
            PARSERS[stage.module](list(stage.args))
        except (ConfigError, ValueError) as exc:
            raise ValueError(f"step '{stage.name}': {exc}") from None


def run_drafter(cfg: DrafterRecipeConfig) -> dict:
    """Run (or resume) every step for `cfg`; the summary (also in OUT/summary.json). ValueError for a
    user error (naming the key) and for a target no DFlash drafter can serve (one line, before anything
    is written), SystemExit naming a failing step."""
    if not os.path.isdir(cfg.target):
        raise ValueError(f"config key 'target': {cfg.target} is not a directory (a local Hugging Face model)")
    check_architecture(cfg.target)  # a family DFlash cannot serve: one line, before anything is written or run
    out = cfg.out_dir
    os.makedirs(out, exist_ok=True)
    prompts = split_prompts(
        cfg.prompts, cfg.heldout, out, asked=cfg.heldout_prompts, seed=cfg.seed, smoke=cfg.scale == "smoke"
    )
    derived = derive(cfg)
    job = build_job(cfg, prompts, derived)
    groups = plan_stages(job)
    check_steps(groups)
    print(f"drafter: {cfg.target} -> {out} ({cfg.scale} scale)\ndefaults derived from the target and this machine:")
    for item in derived:
        print(item.line())
    print(f"  {'held-out prompts':<20}{prompts.record['heldout_records']!s:<22}{prompts.reason}", flush=True)
    record = {"config": config_to_dict(cfg), "derived": [derived_record(d) for d in derived]}
    atomic_write_text(os.path.join(out, "drafter.json"), json.dumps({**record, "prompts": prompts.record}, indent=2))
    device = next(d.value for d in derived if d.what == "device")
    runner = Runner(
        Ledger(os.path.join(out, "stages.json")),
        in_process=cfg.in_process,
        side_by_side=device == "cuda",
        log_dir=os.path.join(out, "logs"),
    )
    runner.run(groups)
    summary = drafter_summary(job, runner, derived, prompts)
    atomic_write_text(os.path.join(out, "summary.json"), json.dumps(summary, indent=2) + "\n")
    print("\n" + summary_text(summary))
    return summary


def derived_record(item: Derived) -> dict:
    return {"what": item.what, "value": item.value, "reason": item.reason, "yours": list(item.yours)}


def shard_facts(job: Job) -> dict:
    """The taps and the mask token the training shards record (extraction's provenance)."""
    provenance = read_record(os.path.join(job.shards_dir, "train", "manifest.json")).get("provenance", {})
    tokenizer = provenance.get("tokenizer", {})
    mask = tokenizer.get("mask_token") or {}
    return {
        "taps": (provenance.get("taps") or {}).get("layer_ids"),
        "mask_token": {"id": tokenizer.get("mask_token_id"), **mask},
    }


def step_seconds(runner: Runner, name: str) -> float:
    """A step's time; steps run side by side share their group's (recorded as 'a + b + c')."""
    return round(next((t for key, t in runner.timings.items() if name in key.split(" + ")), 0.0), 1)


def drafter_summary(job: Job, runner: Runner, derived: list[Derived], prompts: PromptSplit) -> dict:
    drafter, baseline = eval_pair(job.eval_out(job.online))
    spec_all = read_record(job.spec_out)
    spec = pick_spec(spec_all)
    spec["speedup_wall"] = spec_all.get("summary", {}).get("speedup_wall")
    export_config = read_record(os.path.join(job.export_dir, "config.json"))
    return {
        "target": job.target,
        "out": os.path.dirname(job.run_dir),
        "steps": {
            name: {"status": status, "seconds": step_seconds(runner, name)} for name, status in runner.status.items()
        },
        "total_s": round(sum(runner.timings.values()), 1),
        "defaults": [derived_record(d) for d in derived],
        "prompts": prompts.record,
        **shard_facts(job),
        "drafter_layers": export_config.get("num_hidden_layers"),
        "eval": drafter,
        "eval_baseline": baseline,
        "specdecode": spec,
        "paths": {
            "export": job.export_dir,
            "run": job.run_dir,
            "shards": job.shards_dir,
            "regenerated": job.regen_dir or None,
            "eval": job.eval_out(job.online),
            "specdecode": job.spec_out,
            "report": os.path.join(job.run_dir, "report.md"),
        },
    }


def summary_text(summary: dict) -> str:
    steps = summary["steps"]
    ran = {n: s["seconds"] for n, s in steps.items() if s["status"] != "skipped"}
    skipped = [n for n, s in steps.items() if s["status"] == "skipped"]
    ev, base, spec, mask = summary["eval"], summary["eval_baseline"], summary["specdecode"], summary["mask_token"]
    paths = summary["paths"]
    done = (
        f"done in {summary['total_s'] / 60:.1f} min: {len(ran)} of {len(steps)} steps ran ({timings_line(ran)})"
        if ran
        else "nothing to do"
    )
    lines = [
        "=" * 78,
        f"drafter for {summary['target']} {done}"
        + (f"; {len(skipped)} skipped (done before with the same settings)" if skipped else ""),
        f"taps {summary['taps']}, mask token {mask.get('token')!r} (id {mask.get('id')}, {mask.get('source')}), "
        f"drafter of {summary['drafter_layers']} layers",
        f"offline on the held-out prompts ({ev.get('n_blocks', 0)} blocks): τ {num(ev.get('tau'))} (chain of 15), "
        f"acceptance at k=1 {num(ev.get('acceptance_k1'))}; always the most frequent label: τ {num(base.get('tau'))}",
        f"speculative decoding, {spec.get('prompts')} held-out prompts, up to {spec.get('max_new_tokens')} tokens, "
        f"{str(spec.get('device') or 'cpu').upper()} {DTYPE_NAMES.get(spec.get('dtype'), spec.get('dtype'))}: "
        f"τ {num(spec.get('tau'))}; identical to the target's own greedy decoding: {spec.get('lossless')}",
        f"  {num(spec.get('speedup_wall'), '.2f')}x the target's own greedy decoding in wall time "
        f"({num(spec.get('spec_tokens_per_s'), '.0f')} against {num(spec.get('target_tokens_per_s'), '.0f')} tok/s "
        f"decoding; path: {spec.get('decoding_path') or 'n/a'})",
        "",
        "where things are",
        f"  drafter, to serve      {paths['export']}/ (config.json, model.safetensors, dflash.py; docs/serving.md)",
        f"  training run           {paths['run']}/ (config.json, metrics.jsonl, checkpoints/)",
        f"  training-health report {paths['report']} (+ report_*.png)",
        f"  offline evaluation     {paths['eval']}",
        f"  speculative decoding   {paths['specdecode']}",
        f"  shards                 {paths['shards']}/{{train,heldout}}   (python -m shards inspect DIR)",
        *([f"  target's answers       {paths['regenerated']}/{{train,heldout}}"] if paths["regenerated"] else []),
        f"  settings and defaults  {summary['out']}/drafter.json; this summary {summary['out']}/summary.json",
    ]
    return "\n".join(lines)
