"""`run_drafter(cfg) -> summary`: the drafter command as a library call (what `python -m
recipes.drafter` and a test's in-process run do). Before anything is written: the target's
architecture (a family no DFlash drafter can serve is refused in one line), the output folder (one
folder, one target), the prompt sets (held-out prompts left out of training), the derived defaults,
the steps (each validated with its stage's own config), the checks a later step would make and the
target's self-check (`recipes.drafter.checks`), all printed; then drafter.json and the prompt sets are
written, the steps run, and the summary closes.

Layout of OUT (`DrafterRecipeConfig.out_dir`):

    drafter.json          the config, the target (resolved path, content digest), the derived defaults with
                          their reasons, the self-check's numbers, how the prompt sets were made
    stages.json           the ledger of the steps (recipes.runner)
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

from transformers import AutoTokenizer

from common.config import config_to_dict
from common.io import atomic_write_text, read_record
from extract.regenerate.server import chunked_prefill_advice
from recipes.drafter.checks import (
    RECORD,
    accepted_line,
    check_drafter_shape,
    check_key,
    check_owner,
    check_rendering,
    mask_token,
    recorded_owner,
    target_self_check,
)
from recipes.drafter.config import DrafterRecipeConfig, legacy_out
from recipes.drafter.defaults import Derived, derive, stage_defaults, value_of
from recipes.drafter.plan import Heldout, Job, plan_stages
from recipes.drafter.prompts import PromptSplit, split_prompts
from recipes.drafter.results import DTYPE_NAMES, eval_pair, num, pick_spec, timings_line
from recipes.runner import Ledger, Runner
from recipes.step_check import check_steps
from shards.provenance import provenance_of
from target.arch import check_architecture
from target.files import check_target_files
from target.identity import directory_digest
from target.self_check import SelfCheck


def build_job(cfg: DrafterRecipeConfig, out: str, prompts: PromptSplit, derived: list[Derived], digest: str) -> Job:
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
        target_digest=digest,
        chat_template=cfg.chat_template,
    )


def output_folder(cfg: DrafterRecipeConfig) -> str:
    """`cfg.out_dir`; with no `out`, the folder of the old default name when it holds this target's drafter
    (a rerun then continues it) and the new one is not there yet."""
    out = cfg.out_dir
    old = legacy_out(cfg.target)
    if cfg.out or os.path.isdir(out) or not os.path.isdir(old):
        return out
    owner = recorded_owner(old)
    return old if owner is not None and owner["path"] == os.path.realpath(cfg.target) else out


def run_drafter(cfg: DrafterRecipeConfig) -> dict:
    """Run (or resume) every step for `cfg`; the summary (also in OUT/summary.json). ValueError for a
    user error (naming the key), for a target no DFlash drafter can serve and for one that fails its
    self-check (one line, before anything is written), SystemExit naming a failing step."""
    check_target_files(cfg.target)  # config.json, weights, tokenizer: one line, before anything is written or run
    check_architecture(cfg.target)  # a family DFlash cannot serve: one line, before anything is written or run
    out = output_folder(cfg)
    digest = directory_digest(cfg.target)
    check_owner(out, cfg.target, digest)
    prompts = split_prompts(
        cfg.prompts,
        cfg.heldout,
        out,
        asked=cfg.heldout_prompts,
        seed=cfg.seed,
        smoke=cfg.scale == "smoke",
        texts_as_prompts=cfg.regenerate,
    )
    derived = derive(cfg)
    job = build_job(cfg, out, prompts, derived, digest)
    groups = plan_stages(job)
    parsed = check_steps(groups)
    tokenizer = AutoTokenizer.from_pretrained(cfg.target, trust_remote_code=False)
    extract_cfg, train_cfg = parsed["extract"], parsed["train"]
    check_rendering(cfg, tokenizer, extract_cfg, prompts.lines["train"] + prompts.lines["heldout"])
    mask = mask_token(cfg, tokenizer, extract_cfg, train_cfg)
    check_drafter_shape(cfg.target, train_cfg, list(extract_cfg.layer_ids), mask.value)
    key = check_key(digest, *(value_of(derived, what) for what in ("dtype", "device", "attn_implementation")))
    checked, reused = target_self_check(cfg, out, key)
    derived = [mask if d.what == "mask token" else d for d in derived]  # extraction's own choice, now named
    print(f"drafter: {cfg.target} -> {out} ({cfg.scale} scale)\ndefaults derived from the target and this machine:")
    for item in derived:
        print(item.line())
    print(f"  {'held-out prompts':<20}{prompts.record['heldout_records']!s:<22}{prompts.reason}")
    again = " (checked before: the same target, dtype, device and kernel)" if reused else ""
    print(f"target self-check ({checked['dtype']}, {checked['device']}, {checked['seconds']:.1f} s){again}:")
    print("\n".join(SelfCheck.from_record(checked).lines()), flush=True)
    for warning in (accepted_line(checked), chunked_prefill_advice(cfg.target) if cfg.server else None):
        if warning:
            print(f"drafter: warning: {warning}", flush=True)
    os.makedirs(out, exist_ok=True)
    prompts.write()
    record = {
        "config": config_to_dict(cfg),
        "target": {"path": os.path.realpath(cfg.target), "digest": digest},
        "derived": [derived_record(d) for d in derived],
        "self_check": checked,
    }
    atomic_write_text(os.path.join(out, RECORD), json.dumps({**record, "prompts": prompts.record}, indent=2))
    device = value_of(derived, "device")
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
    provenance = provenance_of(read_record(os.path.join(job.shards_dir, "train", "manifest.json")))
    taps, tokenizer = provenance.taps.layer_ids, provenance.tokenizer
    return {
        "taps": None if taps is None else list(taps),
        "mask_token": {"id": tokenizer.mask_token_id, **tokenizer.mask_token.to_dict()},
    }


def drafter_summary(job: Job, runner: Runner, derived: list[Derived], prompts: PromptSplit) -> dict:
    drafter, baseline = eval_pair(job.eval_out(job.online))
    spec_all = read_record(job.spec_out)
    spec = pick_spec(spec_all)
    spec["speedup_wall"] = spec_all.get("summary", {}).get("speedup_wall")
    export_config = read_record(os.path.join(job.export_dir, "config.json"))
    return {
        "target": job.target,
        "out": os.path.dirname(job.run_dir),
        "steps": runner.summary(),
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
