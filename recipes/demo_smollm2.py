"""`make demo target=smollm2` (the default on a CUDA host): the whole pipeline on a real pretrained chat
model, SmolLM2-135M-Instruct, each step the project's own command:

  1. fetch, check and convert the target; write the prompt sets     python -m recipes.smollm2
  2. the target answers its prompts itself (greedy)                  python -m extract.regenerate (x3)
  3. extract train / chat_heldout / humaneval shards                 python -m extract configs/smollm2-135m.toml
  4. train a drafter                                                 python -m train configs/smollm2-135m.toml
  5. offline evaluation on HumanEval and the held-out chat split,    python -m train.eval (x2)
     and the export, side by side on a GPU                           python -m train.export
  6. real speculative decoding on 64 HumanEval prompts beside target-only greedy decoding, transformers'
     `generate` and prompt-lookup decoding (those two on 4)          python -m train.specdecode
  7. the training-health report                                      python -m train.report

On a GPU it runs at full scale (`SCALES["full"]`); on a CPU at a reduced scale (`SCALES["reduced"]`:
fewer prompts, shorter answers, fewer steps), which the summary names. The target runs in float32
throughout (configs/smollm2-135m.toml says why).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

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
    # 64 of HumanEval's 164 prompts online (all 164 took about 6 of the demo's 17-19 minutes on the H200,
    # 2026-12-04; `train.specdecode --num-prompts 0` decodes them all), the peers on 4 (about 9.5 s each).
    "full": Scale("full", 0, 0, 0, 256, 1024, 1000, 5, 16384, 512, 64, 4),
    # Two CPU cores decode this model at ~7 tok/s (batch 1) to ~70 tok/s (batch 32), and train its 2-layer
    # drafter at 15-20 s per 4,096-token step (49,152-way loss): minutes per hundred answers or steps.
    "reduced": Scale("reduced", 64, 8, 4, 64, 32, 30, 2, 2048, 32, 4, 4),
}


def smollm2_stages(
    scale: Scale, run: str, device: str, seed_overrides: list[str], steps: int | None, eval_anchors: int = 16
) -> list[list[tuple[str, list[str]]]]:
    """Every step as (name, argv), in stages run in order; the steps of one stage need only what earlier
    stages wrote, so on a GPU they run side by side (the offline evaluations and the export: three
    launch-bound small-model processes). `eval_anchors` anchors per held-out sequence offline: every
    position of HumanEval's answers (23 K blocks) took about 140 s on the H200; 16 per answer (2.6 K blocks)
    took 69 s with the model's load and the DDTree budgets (2026-12-02)."""
    run_dir = os.path.join("runs", run)
    export_dir = os.path.join(run_dir, "export")
    shards = f"{ROOT}/shards"
    out = [
        (
            "target + prompts",
            [
                "-m",
                "recipes.smollm2",
                f"train_prompts={scale.train_prompts}",
                f"chat_heldout_prompts={scale.chat_heldout_prompts}",
                f"humaneval_prompts={scale.humaneval_prompts}",
            ],
        )
    ]
    for split, corpus in REGEN.items():
        out.append(
            (
                f"regeneration ({split})",
                [
                    "-m",
                    "extract.regenerate",
                    CONFIG,
                    f"corpus={corpus}",
                    f"out={ROOT}/regen/{split}",
                    f"max_new_tokens={scale.max_new_tokens}",
                    f"batch_size={scale.regen_batch}",
                    f"device={device}",
                ],
            )
        )
    extract = ["-m", "extract", CONFIG, f"device={device}"]
    if device == "cpu":
        extract.append("tokens_per_batch=2048")  # two cores: small batches pad less (16,384 padded 55% here)
    out.append(("extraction", extract))
    train = ["-m", "train", CONFIG, f"run_name={run}", f"optim.max_steps={steps or scale.steps}"]
    train += [f"model.num_layers={scale.num_layers}", f"data.token_budget={scale.token_budget}"]
    train += [f"loss.num_anchors={scale.num_anchors}", f"device={device}", *seed_overrides]
    if device == "cuda":
        # Not compile=true: with this drafter's small steps, compiling for each length bucket's shapes took
        # most of 5 minutes on the H200 (132 of 1,000 steps done, 2026-12-02); SDPA runs the mask uncompiled.
        train.append("model.attention=sdpa")
    out.append(("drafter training", train))
    stages = [[step] for step in out]
    after_training = []
    for split in ("humaneval", "chat_heldout"):
        after_training.append(
            (
                f"offline evaluation ({split})",
                [
                    "-m",
                    "train.eval",
                    run_dir,
                    "--data",
                    f"{shards}/{split}",
                    "--out",
                    f"{run_dir}/eval_{split}.json",
                    f"max_anchors={eval_anchors}",
                    # As in training: flex attention compiles for every block shape, which costs this small
                    # drafter more than the dense-mask SDPA it replaces saves.
                    *(["attention=sdpa"] if device == "cuda" else []),
                ],
            )
        )
    after_training.append(("export", ["-m", "train.export", run_dir, export_dir]))
    stages.append(after_training)
    stages.append(
        [
            (
                "speculative decoding (HumanEval)",
                [
                    "-m",
                    "train.specdecode",
                    "--target",
                    f"{ROOT}/target",
                    "--drafter",
                    export_dir,
                    "--prompts",
                    REGEN["humaneval"],
                    "--num-prompts",
                    str(scale.online_prompts),
                    "--max-new-tokens",
                    str(scale.max_new_tokens),
                    "--agreement",
                    "--agreement-bf16",
                    "--peer-baselines",
                    "--peer-prompts",
                    str(scale.peer_prompts),
                    # Not generate_static: it compiles again for every prompt shape (49 s of 16 prompts, 2026-12-02);
                    # benchmarks.small_decode times it at one shape.
                    "--peers",
                    "generate,prompt_lookup",
                    "--dtype",
                    "float32",
                    "--device",
                    device,
                    "--out",
                    f"{run_dir}/specdecode_humaneval.json",
                ],
            )
        ]
    )
    stages.append([("report", ["-m", "train.report", run_dir])])
    return stages


def smollm2_summary(run_dir: str, timings: dict[str, float], machine: dict, scale: Scale) -> dict:
    from recipes.demo import _pick_eval, _pick_spec, _read_json

    build = _read_json(f"{ROOT}/build.json")
    spec_all = _read_json(f"{run_dir}/specdecode_humaneval.json")
    evals = {}
    for split in ("humaneval", "chat_heldout"):
        ev = _read_json(f"{run_dir}/eval_{split}.json")
        checkpoints = ev.get("checkpoints") or [{}]
        evals[split] = {
            "drafter": _pick_eval(checkpoints[0].get("overall", {})),
            "baseline": _pick_eval((ev.get("baseline") or {}).get("overall", {})),
        }
    spec = _pick_spec(spec_all)
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
    from recipes.demo import DTYPE_NAMES, _num, machine_line

    timings = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in summary["timings_s"].items())
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
            f"  {label:<22}{_num(he['drafter'].get(key)):>12}{_num(chat['drafter'].get(key)):>10}"
            f"{_num(he['baseline'].get(key)):>38}"
        )
    lines += [
        "",
        f"online on HumanEval: {spec.get('prompts')} prompts, up to {spec.get('max_new_tokens')} tokens each, "
        f"{str(spec.get('device') or 'cpu').upper()} {DTYPE_NAMES.get(spec.get('dtype'), spec.get('dtype'))}, batch 1:",
        f"  tau {_num(spec.get('tau'))} (offline tau at the same round starts, bf16 features: "
        f"{_num(spec.get('offline_tau_at_rounds_bf16'))}); identical to target-only greedy decoding: "
        f"{spec.get('lossless')}",
        f"  {'wall-clock speed-up against target-only greedy decoding':<58}{'speed-up':>9}{'lossless':>10}",
        f"  {'DFlash speculative decoding (this drafter)':<58}{_num(spec.get('speedup_wall'), '.2f') + 'x':>9}"
        f"{str(spec.get('lossless')):>10}",
    ]
    names = {
        "generate": "transformers generate (greedy)",
        "prompt_lookup": "transformers prompt-lookup decoding",
        "generate_static": "transformers generate, static cache",
    }
    for name, peer in summary.get("peers", {}).items():
        speedup = _num(peer.get("speedup_wall"), ".2f") + "x"
        lines.append(f"  {names.get(name, name):<58}{speedup:>9}{str(peer.get('lossless')):>10}")
    for m in spec.get("mismatches", []):
        lines.append(
            f"  prompt {m['prompt']} differs from token {m['first_mismatch']}: the target's top-1/top-2 logit margin "
            f"there {_num(m.get('margin'), '.3g')} (a near-tie if tiny)"
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
