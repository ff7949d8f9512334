"""`make bench-gpu suite=real`: SmolLM2-135M-Instruct end to end on one H100 or H200, the figures of the README's
real-target row: the demo's own stages (`recipes.demo_smollm2`, what `make demo target=smollm2` runs), each part
at the scale that fits.

    prefix      build (fetch, check, convert), regeneration of the three prompt sets, extraction
    training    the demo's drafter (5 layers, uncompiled SDPA), as many of its 1,000 steps as fit (at least 300)
    evaluation  offline evaluation on HumanEval and the held-out chat split, and the export, side by side
    decoding    online speculative decoding on as many HumanEval prompts as fit its time (planned only with room
                for 32), beside target-only greedy decoding; transformers' `generate` and prompt-lookup decoding
                on 4 of them. The command gets the part's deadline (`time_limit_s`): it stops cleanly when the
                next prompt would not fit, and reports τ, the lossless count and the speed on those it decoded
    report      the training-health report (first to go when time is short)

At the smoke scale (a CPU) the demo's reduced scale. Figures: `real.*` (steps, offline τ per set, online τ,
lossless count, wall-clock speed-up, the peers' speed-ups, the time to the decoding step and the whole).

On one H100 or H200 it takes two commands after the carrying: the first runs the prefix, the training, the
evaluation and the report; the second, on the same host, continues that record (`benchmarks.suites.continuation`)
and spends its time on the decoding.
"""

from __future__ import annotations

import os

from benchmarks.suites.figures import read_json
from benchmarks.suites.plan import Part
from benchmarks.suites.smollm2 import demo_stages, prefix_part, run_dir, scale_for, step, steps_named
from recipes.demo_smollm2 import smollm2_summary

RUN = "bench-real"
EVAL_AND_EXPORT = ["offline evaluation (humaneval)", "offline evaluation (chat_heldout)", "export"]
DECODING_MARGIN_S = 20.0  # of the part's time, for the decoding command's exit, its JSON and the collector


def _training(ctx, units: int):
    return [[step(demo_stages(ctx, RUN, steps=units), "drafter training")]]


def _evaluation(ctx, units: int):
    return [steps_named(demo_stages(ctx, RUN), EVAL_AND_EXPORT)]


def _decoding(ctx, units: int):
    """All of HumanEval on a GPU (`num_prompts=0`) within the part's time: the command decodes as many as fit, at
    least the planned `units` where the estimate holds; `units` prompts on a CPU."""
    prompts = 0 if ctx.scale == "gpu" else units
    name, argv = step(demo_stages(ctx, RUN, online_prompts=prompts), "speculative decoding (HumanEval)")
    limit = ctx.allowed_s - DECODING_MARGIN_S
    return [[(name, argv + ([f"time_limit_s={limit:.0f}"] if limit > 0 else []))]]


def _report(ctx, units: int):
    return [[step(demo_stages(ctx, RUN), "report")]]


def summary(ctx) -> dict:
    return smollm2_summary(run_dir(RUN), {}, {}, scale_for(ctx.scale))


def _collect_training(ctx, units: int) -> dict:
    return {"real.training.steps": units}


def _collect_evaluation(ctx, units: int) -> dict:
    figures = {}
    for split, ev in summary(ctx)["eval"].items():
        drafter = ev["drafter"]
        figures |= {
            f"real.eval.{split}.tau": drafter.get("tau"),
            f"real.eval.{split}.ddtree_tau_64": drafter.get("ddtree_tau_64"),
            f"real.eval.{split}.acceptance_k1": drafter.get("acceptance_k1"),
            f"real.eval.{split}.blocks": drafter.get("n_blocks"),
        }
    return figures


def _collect_decoding(ctx, units: int) -> dict:
    found = summary(ctx)
    spec, peers = found["specdecode"], found["peers"]
    prompts = spec.get("prompts")
    stopped = (read_json(os.path.join(run_dir(RUN), "specdecode_humaneval.json")) or {}).get("stopped")
    ctx.state["units_done"] = prompts  # what the part did, for the record and the costs learned from it
    seconds = {name: part["seconds"] for name, part in ctx.state["parts"].items()}
    figures = {
        "real.online.prompts": prompts,
        "real.online.prompts_asked": stopped["of"] if stopped else prompts,
        "real.online.stopped_at_time_limit": bool(stopped),
        "real.online.tau": spec.get("tau"),
        "real.online.offline_tau_at_rounds": spec.get("offline_tau_at_rounds_bf16"),
        "real.online.lossless": f"{prompts - len(spec['mismatches'])} of {prompts}" if prompts else None,
        "real.online.speedup": spec.get("speedup"),
        "real.online.speedup_wall": spec.get("speedup_wall"),
        "real.online.target_ms_per_token": 1e3 / spec["target_tokens_per_s"]
        if spec.get("target_tokens_per_s")
        else None,
        "real.to_decoding_s": sum(seconds.get(p, 0.0) for p in ("prefix", "training", "evaluation")),
        "real.suite_s": sum(seconds.values()),
    }
    for name, peer in peers.items():
        figures[f"real.peers.{name}.speedup_wall"] = peer.get("speedup_wall")
    return figures


def parts(scale: str, options: dict) -> list[Part]:
    smoke = scale == "smoke"
    full = scale_for(scale)
    return [
        prefix_part(scale),
        Part(
            "training",
            "the demo's drafter, uncompiled SDPA",
            40 if smoke else 15,
            9.0 if smoke else 0.115,
            "steps",
            full.steps,
            5 if smoke else 300,
            0,
            "2026-12-04 log: 1,000 steps in about 130 s with the load",
            _training,
            _collect_training,
            needs=("prefix",),
        ),
        Part(
            "evaluation",
            "offline evaluation on HumanEval and held-out chat, and the export, side by side",
            60 if smoke else 100,
            0,
            "run",
            1,
            1,
            1,
            "issue 46: build to the end of the export in 432 s on 2026-12-04 (9e14540), of it ~330 s before",
            _evaluation,
            _collect_evaluation,
            needs=("training",),
        ),
        Part(
            "decoding",
            "online speculative decoding on HumanEval beside target-only greedy decoding; the peers on 4 prompts",
            60 if smoke else 80,
            30.0 if smoke else 2.3,
            "prompts",
            4 if smoke else 164,
            2 if smoke else 32,
            1,
            "2026-12-04 log: load, graph capture and compilation ~90 s, the peers ~9.5 s a prompt on 4, then "
            "~2.3 s a prompt (speculative and target-only); 2026-12-05 H100: 1.5-2.5 s a prompt; the compilation "
            "a bare machine pays (estimate: 45 s of the 90)",
            _decoding,
            _collect_decoding,
            needs=("evaluation",),
            cold_s=0 if smoke else 45,
        ),
        Part(
            "report",
            "the training-health report",
            20 if smoke else 15,
            0,
            "run",
            1,
            1,
            5,
            "estimate",
            _report,
            lambda ctx, units: {},
            needs=("training",),
        ),
    ]
