"""`make demo target=smollm2` (the default on a CUDA host): the whole pipeline on a real pretrained chat
model, SmolLM2-135M-Instruct, each step the project's own command:

  1. fetch, check and convert the target; write the prompt sets     python -m recipes.smollm2
  2. the target answers its prompts itself (greedy)                  python -m extract.regenerate (x3)
  3. extract train / chat_heldout / humaneval shards                 python -m extract configs/smollm2-135m.toml
  4. train a drafter                                                 python -m train configs/smollm2-135m.toml
  5. offline evaluation on HumanEval and the held-out chat split,    python -m train.eval (x2)
     and the export, side by side on a GPU                           python -m train.serve.export
  6. real speculative decoding on 64 HumanEval prompts beside target-only greedy decoding, transformers'
     `generate` and prompt-lookup decoding (those two on 4)          python -m train.serve.specdecode
  7. the training-health report                                      python -m train.report

On a GPU it runs at full scale (`SCALES["full"]`); on a CPU at a reduced scale (`SCALES["reduced"]`:
fewer prompts, shorter answers, fewer steps), which the summary names. The target runs in float32
throughout (configs/smollm2-135m.toml says why).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from common.io import read_record
from recipes.drafter.plan import Heldout, Job, plan_stages
from recipes.drafter.results import DTYPE_NAMES, eval_pair, eval_unary, machine_line, num, pick_spec, timings_line

ROOT = "artifacts/smollm2"
CONFIG = "configs/smollm2-135m.toml"
REGEN = {
    "train": f"{ROOT}/prompts/train.jsonl",
    "chat_heldout": f"{ROOT}/prompts/chat_heldout.jsonl",
    "humaneval": f"{ROOT}/prompts/humaneval.jsonl",
}


@dataclass(frozen=True)
class Scale:
    name: str
    train_prompts: int  # 0 = all
    chat_heldout_prompts: int
    humaneval_prompts: int
    max_new_tokens: int
    regen_batch: int
    steps: int
    num_layers: int
    token_budget: int
    num_anchors: int
    online_prompts: int  # HumanEval prompts decoded online (0 = all built)
    peer_prompts: int  # of those, decoded with transformers' own decoding too (eager generate is slow)


SCALES = {
    # 64 of HumanEval's 164 prompts online: all of them make online decoding the largest part of the demo
    # (docs/benchmarks-log-2026-11-30-to-2026-12-04.md, "Real target"; `train.serve.specdecode --num-prompts 0` decodes
    # them all). The peers, whose eager `generate` is slow, on 4.
    "full": Scale("full", 0, 0, 0, 256, 1024, 1000, 5, 16384, 512, 64, 4),
    # Two CPU cores take minutes per hundred answers or training steps of this model (a 49,152-way loss):
    # short answers, a 2-layer drafter, few steps (docs/benchmarks-log-2026-11-30-to-2026-12-04.md,
    # "Real target", the reduced scale).
    "reduced": Scale("reduced", 64, 8, 4, 64, 32, 30, 2, 2048, 32, 4, 4),
}


def smollm2_prepare(scale: Scale) -> tuple[str, list[str]]:
    """The builder's step: fetch, check and convert the target; write the prompt sets at the scale's sizes."""
    sizes = [
        f"train_prompts={scale.train_prompts}",
        f"chat_heldout_prompts={scale.chat_heldout_prompts}",
        f"humaneval_prompts={scale.humaneval_prompts}",
    ]
    return "target + prompts", ["-m", "recipes.smollm2", *sizes]


def smollm2_job(
    scale: Scale, run: str, device: str, train_overrides: list[str], steps: int | None, eval_anchors: int = 16
) -> Job:
    """The drafter command's plan (recipes.drafter.plan) for this target at `scale`: its three prompt
    sets answered by the target, HumanEval decoded online; `train_overrides`: the caller's training
    settings (seeds, the drafter class). `eval_anchors` anchors per held-out sequence
    offline: every position of HumanEval's answers makes the offline evaluation a large part of the
    demo's time (docs/benchmarks-log-2026-11-30-to-2026-12-04.md, "Real target"); 16 per answer keep it short."""
    run_dir = os.path.join("runs", run)
    train = [f"optim.max_steps={steps or scale.steps}", f"model.num_layers={scale.num_layers}"]
    train += [f"data.token_budget={scale.token_budget}", f"loss.num_anchors={scale.num_anchors}", *train_overrides]
    evaluation = [f"max_anchors={eval_anchors}"]
    extract = []
    if device == "cuda":
        # Not compile=true: this small drafter's steps are too short for compilation to pay, and it compiles
        # again for each length bucket's shapes (docs/benchmarks-log-2026-11-30-to-2026-12-04.md,
        # "Real target"); SDPA runs the mask uncompiled.
        train.append("model.attention=sdpa")
        # As in training: flex attention compiles for every block shape, which costs this small drafter more
        # than the dense-mask SDPA it replaces saves.
        evaluation.append("attention=sdpa")
    else:
        extract.append("tokens_per_batch=2048")  # two cores: small batches pad less
    spec = [f"num_prompts={scale.online_prompts}", f"max_new_tokens={scale.max_new_tokens}", "agreement=true"]
    spec += ["agreement_bf16=true", "peer_baselines=true", f"peer_prompts={scale.peer_prompts}"]
    # Not generate_static: it compiles again for every prompt shape; benchmarks.small_decode times it at one shape.
    spec.append("peers=generate,prompt_lookup")
    regen = [f"max_new_tokens={scale.max_new_tokens}", f"batch_size={scale.regen_batch}", f"device={device}"]
    return Job(
        target=f"{ROOT}/target",
        train_prompts=REGEN["train"],
        heldout=(Heldout("chat_heldout", REGEN["chat_heldout"]), Heldout("humaneval", REGEN["humaneval"], "HumanEval")),
        online="humaneval",
        shards_dir=f"{ROOT}/shards",
        runs_dir="runs",
        run_name=run,
        export_dir=os.path.join(run_dir, "export"),
        regen_dir=f"{ROOT}/regen",
        config=CONFIG,
        # The target runs in float32 in every stage (configs/smollm2-135m.toml says why).
        defaults={"train": [f"device={device}"], "specdecode": [f"device={device}", "dtype=float32"]},
        overrides={
            "regenerate": regen,
            "extract": [f"device={device}", *extract],
            "train": train,
            "eval": evaluation,
            "specdecode": spec,
        },
    )


def smollm2_stages(
    scale: Scale, run: str, device: str, seed_overrides: list[str], steps: int | None, eval_anchors: int = 16
) -> list[list[tuple[str, list[str]]]]:
    """Every step as (name, argv), in groups run in order: the builder, then the drafter plan, whose
    offline evaluations and export need only the checkpoint (side by side on a GPU: three launch-bound
    small-model processes)."""
    groups = plan_stages(smollm2_job(scale, run, device, seed_overrides, steps, eval_anchors))
    return [[smollm2_prepare(scale)]] + [[(s.name, s.argv) for s in group] for group in groups]


def smollm2_summary(run_dir: str, timings: dict[str, float], machine: dict, scale: Scale) -> dict:
    build = read_record(f"{ROOT}/build.json")
    spec_all = read_record(f"{run_dir}/specdecode_humaneval.json")
    evals = {}
    for split in ("humaneval", "chat_heldout"):
        drafter, baseline = eval_pair(f"{run_dir}/eval_{split}.json")
        unary = eval_unary(f"{run_dir}/eval_{split}.json")  # a DFlash2 drafter's; its `drafter` is the selector's
        evals[split] = {"drafter": drafter, "baseline": baseline} | ({"unary": unary} if unary else {})
    spec = pick_spec(spec_all)
    summary = spec_all.get("summary", {})
    spec["speedup_wall"] = summary.get("speedup_wall")
    spec["spec_wall_s"] = (summary.get("spec") or {}).get("wall_s")
    spec["target_wall_s"] = (summary.get("baseline") or {}).get("wall_s")
    spec["mismatches"] = summary.get("mismatches", [])
    peers = {
        name: {"speedup_wall": p.get("speedup_wall"), "lossless": p.get("lossless"), "wall_s": p["spec"]["wall_s"]}
        for name, p in (spec_all.get("peers") or {}).items()
    }
    return {
        "target_name": "smollm2",
        "scale": scale.__dict__,
        "machine": machine,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "total_s": round(sum(timings.values()), 1),
        "prompts": build.get("prompts", {}),
        "eval": evals,
        "specdecode": spec,
        "peers": peers,
    }


def smollm2_summary_text(summary: dict) -> str:
    timings = timings_line(summary["timings_s"])
    scale, spec, prompts = summary["scale"], summary["specdecode"], summary["prompts"]
    lines = [
        "=" * 78,
        f"demo (SmolLM2-135M-Instruct, {scale['name']} scale) finished in {summary['total_s'] / 60:.1f} min",
        f"  ({timings})",
        *([f"on {machine_line(summary['machine'])}"] if summary.get("machine") else []),
        "",
        f"prompts answered by the target (greedy, <= {scale['max_new_tokens']} tokens): train {prompts.get('train')}, "
        f"held-out chat {prompts.get('chat_heldout')}, HumanEval {prompts.get('humaneval')}; drafter "
        f"{scale['num_layers']} layers, {scale['steps']} steps",
        "",
        "drafter, offline (labels = the target's top-1):",
        f"  {'':<22}{'HumanEval':>12}{'chat':>10}{'most-frequent baseline (HumanEval)':>38}",
    ]
    he, chat = summary["eval"]["humaneval"], summary["eval"]["chat_heldout"]
    rows = [("acceptance at k=1", "acceptance_k1"), ("tau, chain of 15", "tau")]
    rows += [(f"tau, DDTree-{b}", f"ddtree_tau_{b}") for b in (8, 16, 32, 64) if f"ddtree_tau_{b}" in he["drafter"]]
    for label, key in rows:
        lines.append(
            f"  {label:<22}{num(he['drafter'].get(key)):>12}{num(chat['drafter'].get(key)):>10}"
            f"{num(he['baseline'].get(key)):>38}"
        )
    if "unary" in he:  # a DFlash2 drafter: the rows above are its selector's proposals, these its head's argmax
        for label, key in [("tau, chain", "tau"), ("tau, DDTree-64", "ddtree_tau_64")]:
            unary = f"unary: {label}"
            lines.append(f"  {unary:<22}{num(he['unary'].get(key)):>12}{num(chat.get('unary', {}).get(key)):>10}")
    lines += [
        "",
        f"online on HumanEval: {spec.get('prompts')} prompts, up to {spec.get('max_new_tokens')} tokens each, "
        f"{str(spec.get('device') or 'cpu').upper()} {DTYPE_NAMES.get(spec.get('dtype'), spec.get('dtype'))}, batch 1:",
        f"  tau {num(spec.get('tau'))} (offline tau at the same round starts, bf16 features: "
        f"{num(spec.get('offline_tau_at_rounds_bf16'))}); identical to target-only greedy decoding: "
        f"{spec.get('lossless')}",
        f"  {'wall-clock speed-up against target-only greedy decoding':<58}{'speed-up':>9}{'lossless':>10}",
        f"  {'DFlash speculative decoding (this drafter)':<58}{num(spec.get('speedup_wall'), '.2f') + 'x':>9}"
        f"{str(spec.get('lossless')):>10}",
    ]
    names = {
        "generate": "transformers generate (greedy)",
        "prompt_lookup": "transformers prompt-lookup decoding",
        "generate_static": "transformers generate, static cache",
    }
    for name, peer in summary.get("peers", {}).items():
        speedup = num(peer.get("speedup_wall"), ".2f") + "x"
        lines.append(f"  {names.get(name, name):<58}{speedup:>9}{str(peer.get('lossless')):>10}")
    for m in spec.get("mismatches", []):
        lines.append(
            f"  prompt {m['prompt']} differs from token {m['first_mismatch']}: the target's top-1/top-2 logit margin "
            f"there {num(m.get('margin'), '.3g')} (a near-tie if tiny)"
        )
    if scale["name"] != "full":
        lines.append(
            "  (reduced scale on a CPU: far too little data and too few steps for the drafter to learn, so its "
            "tau and speed here say nothing about the method; the full scale runs on a GPU: docs/benchmarks.md)"
        )
    return "\n".join(lines)


def print_smollm2_summary(summary: dict, run_dir: str) -> None:
    print("\n" + smollm2_summary_text(summary))
    print("\nwhere things are")
    print(f"  target, prompts        {ROOT}/target, {ROOT}/prompts")
    print(f"  regenerated answers    {ROOT}/regen/{{train,chat_heldout,humaneval}}")
    print(f"  shards                 {ROOT}/shards/{{train,chat_heldout,humaneval}}")
    print(f"  run                    {run_dir}/ (config.json, metrics.jsonl, checkpoints/, export/)")
    print(f"  evaluation, decoding   {run_dir}/eval_humaneval.json, eval_chat_heldout.json, specdecode_humaneval.json")
    print(f"  this summary           {run_dir}/demo_summary.json")


def write_summary(summary: dict, run_dir: str) -> None:
    with open(os.path.join(run_dir, "demo_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
