"""`make bench-gpu suite=real`: SmolLM2-135M-Instruct end to end on one H100 or H200, the figures of the README's
real-target row: the demo's own stages (`recipes.demo_smollm2`, what `make demo target=smollm2` runs), each part
at the scale that fits; beside them a DFlash2 drafter (`make demo target=smollm2 arch=dflash2`) trained on the
same shards with the same steps, measured the same way (run `runs/bench-real-dflash2`).

    prefix              build (fetch, check, convert), regeneration of the three prompt sets, extraction
    training            the demo's drafter (5 layers, uncompiled SDPA), as many of its 1,000 steps as fit (at least
                        300)
    training-dflash2    the DFlash2 drafter (model.arch=dflash2, the config's block of 16 and seed 0), as many
                        steps as `training` (`Part.follows`: planned together they grow together)
    evaluation          offline evaluation on HumanEval and the held-out chat split, and the export, side by side
    evaluation-dflash2  the same for the DFlash2 drafter: chain τ and DDTree τ of its selector's proposals (what it
                        serves) and of its unary ones (the head's argmax), on the same blocks
    decoding            online speculative decoding on as many HumanEval prompts as fit its time (planned only with
                        room for 32), beside target-only greedy decoding; transformers' `generate` and prompt-lookup
                        decoding on 4 of them. The command gets the part's deadline (`time_limit_s`): it stops
                        cleanly when the next prompt would not fit, and reports τ, the lossless count and the speed
                        on those it decoded
    decoding-dflash2    the same for the DFlash2 drafter on at most the prompts `decoding` decoded (the first ones;
                        no peers), with its time limit, after `decoding`
    report              the training-health report (first to go when time is short)

One seed: another seed is another training and evaluation of each class (~3 min on a GPU), more than the two
commands hold. At the smoke scale (a CPU) the demo's reduced scale. Figures: `real.*` (steps, offline τ per set,
online τ, lossless count, wall-clock speed-up, the peers' speed-ups, the time to the decoding step and the whole,
DFlash's parts only); `real.dflash2.*` the same of the DFlash2 drafter with its unary τ (`...eval.SPLIT.unary_tau`),
and its ratios to DFlash: offline τ where both trained the same steps (`...eval.SPLIT.tau_over_dflash`,
`ddtree_tau_64_over_dflash`), the training part's time (`...training_s_over_dflash`, process starts included),
online τ where both decoded the same prompts (`...online.tau_over_dflash`). DFlash2's costs are estimates.

On one H100 or H200 it takes two commands after the carrying: the first runs the prefix, both trainings, the
evaluation and the report (on a bare H100 the DFlash2 evaluation does not fit after them); the second, on the same
host, continues that record (`benchmarks.suites.continuation`): the DFlash2 evaluation and the two decodings.
"""

from __future__ import annotations

import os

from benchmarks.suites.figures import read_json
from benchmarks.suites.plan import Part
from benchmarks.suites.smollm2 import demo_stages, prefix_part, run_dir, scale_for, step, steps_named
from recipes.demo_smollm2 import smollm2_summary

RUN = "bench-real"
RUN2 = "bench-real-dflash2"  # the DFlash2 drafter's run, from the same shards
EVAL_AND_EXPORT = ["offline evaluation (humaneval)", "offline evaluation (chat_heldout)", "export"]
DECODING_MARGIN_S = 20.0  # of the part's time, for the decoding command's exit, its JSON and the collector


def _training(ctx, units: int, run: str = RUN, arch: str = "dflash"):
    return [[step(demo_stages(ctx, run, arch=arch, steps=units), "drafter training")]]


def _evaluation(ctx, units: int, run: str = RUN, arch: str = "dflash"):
    return [steps_named(demo_stages(ctx, run, arch=arch), EVAL_AND_EXPORT)]


def _decoding(ctx, units: int, run: str = RUN, arch: str = "dflash"):
    """All of HumanEval on a GPU (`num_prompts=0`) within the part's time: the command decodes as many as fit, at
    least the planned `units` where the estimate holds; `units` prompts on a CPU. The DFlash2 drafter decodes
    `units` (at most the prompts DFlash decoded: `Part.follows`) without the peers, which measure the target alone."""
    dflash2 = arch == "dflash2"
    prompts = 0 if ctx.scale == "gpu" and not dflash2 else units
    stages = demo_stages(ctx, run, arch=arch, online_prompts=prompts)
    name, argv = step(stages, "speculative decoding (HumanEval)")
    limit = ctx.allowed_s - DECODING_MARGIN_S
    argv = argv + (["peer_baselines=false"] if dflash2 else []) + ([f"time_limit_s={limit:.0f}"] if limit > 0 else [])
    return [[(name, argv)]]


def _report(ctx, units: int):
    return [[step(demo_stages(ctx, RUN), "report")]]


def summary(ctx, run: str = RUN) -> dict:
    return smollm2_summary(run_dir(run), {}, {}, scale_for(ctx.scale))


def _collect_training(ctx, units: int) -> dict:
    return {"real.training.steps": units}


def eval_figures(ctx, run: str, prefix: str) -> dict:
    """Offline τ per held-out set of run `run`, as `{prefix}.eval.SPLIT.*`; a DFlash2 drafter's `tau` and
    `ddtree_tau_64` are its selector's proposals, `unary_*` its head's argmax."""
    figures = {}
    for split, ev in summary(ctx, run)["eval"].items():
        drafter, unary = ev["drafter"], ev.get("unary") or {}
        figures |= {
            f"{prefix}.eval.{split}.tau": drafter.get("tau"),
            f"{prefix}.eval.{split}.ddtree_tau_64": drafter.get("ddtree_tau_64"),
            f"{prefix}.eval.{split}.acceptance_k1": drafter.get("acceptance_k1"),
            f"{prefix}.eval.{split}.blocks": drafter.get("n_blocks"),
            f"{prefix}.eval.{split}.unary_tau": unary.get("tau"),
            f"{prefix}.eval.{split}.unary_ddtree_tau_64": unary.get("ddtree_tau_64"),
        }
    return figures


def _collect_evaluation(ctx, units: int) -> dict:
    return eval_figures(ctx, RUN, "real")


def online_figures(ctx, run: str, prefix: str) -> dict:
    """Online τ, the lossless count and the speed-ups of run `run`'s decoding, as `{prefix}.online.*`."""
    spec = summary(ctx, run)["specdecode"]
    prompts = spec.get("prompts")
    stopped = (read_json(os.path.join(run_dir(run), "specdecode_humaneval.json")) or {}).get("stopped")
    ctx.state["units_done"] = prompts  # what the part did, for the record and the costs learned from it
    return {
        f"{prefix}.online.prompts": prompts,
        f"{prefix}.online.prompts_asked": stopped["of"] if stopped else prompts,
        f"{prefix}.online.stopped_at_time_limit": bool(stopped),
        f"{prefix}.online.tau": spec.get("tau"),
        f"{prefix}.online.offline_tau_at_rounds": spec.get("offline_tau_at_rounds_bf16"),
        f"{prefix}.online.lossless": f"{prompts - len(spec['mismatches'])} of {prompts}" if prompts else None,
        f"{prefix}.online.speedup": spec.get("speedup"),
        f"{prefix}.online.speedup_wall": spec.get("speedup_wall"),
        f"{prefix}.online.target_ms_per_token": 1e3 / spec["target_tokens_per_s"]
        if spec.get("target_tokens_per_s")
        else None,
    }


def _collect_decoding(ctx, units: int) -> dict:
    figures = online_figures(ctx, RUN, "real")
    seconds = {name: part["seconds"] for name, part in ctx.state["parts"].items() if not name.endswith("-dflash2")}
    figures["real.to_decoding_s"] = sum(seconds.get(p, 0.0) for p in ("prefix", "training", "evaluation"))
    figures["real.suite_s"] = sum(seconds.values())
    for name, peer in summary(ctx)["peers"].items():
        figures[f"real.peers.{name}.speedup_wall"] = peer.get("speedup_wall")
    return figures


def _ran(ctx, part: str) -> dict:
    return (ctx.state.get("parts") or {}).get(part) or {}


def ratio(new, base) -> float | None:
    return new / base if new is not None and base else None


def _collect_training_dflash2(ctx, units: int) -> dict:
    base, new = _ran(ctx, "training"), _ran(ctx, "training-dflash2")
    same = base.get("status") == "ok" and base.get("units") == units
    return {
        "real.dflash2.training.steps": units,
        "real.dflash2.training_s_over_dflash": ratio(new.get("seconds"), base.get("seconds")) if same else None,
    }


def _collect_evaluation_dflash2(ctx, units: int) -> dict:
    """The DFlash2 drafter's offline figures, and its τ over DFlash's where both trained the same steps."""
    figures = eval_figures(ctx, RUN2, "real.dflash2")
    steps = _ran(ctx, "training").get("units")
    if steps is None or steps != _ran(ctx, "training-dflash2").get("units"):
        return figures
    base = eval_figures(ctx, RUN, "real")
    for split in ("humaneval", "chat_heldout"):
        for key in ("tau", "ddtree_tau_64"):
            new, old = figures.get(f"real.dflash2.eval.{split}.{key}"), base.get(f"real.eval.{split}.{key}")
            figures[f"real.dflash2.eval.{split}.{key}_over_dflash"] = ratio(new, old)
    return figures


def _collect_decoding_dflash2(ctx, units: int) -> dict:
    """The DFlash2 drafter's online figures, and its online τ over DFlash's where both decoded the same prompts."""
    figures = online_figures(ctx, RUN2, "real.dflash2")
    prompts = figures.get("real.dflash2.online.prompts")
    base = summary(ctx)["specdecode"]
    if prompts and base.get("prompts") == prompts:
        figures["real.dflash2.online.tau_over_dflash"] = ratio(figures["real.dflash2.online.tau"], base.get("tau"))
    return figures


def _dflash2(stages):
    """A part's commands for the DFlash2 run."""
    return lambda ctx, units: stages(ctx, units, RUN2, "dflash2")


DFLASH2_STEP = 1.15  # DFlash2's step over DFlash's on a small drafter: 10-20% slower (estimate)


def parts(scale: str, options: dict) -> list[Part]:
    smoke = scale == "smoke"
    full = scale_for(scale)
    step_s = 9.0 if smoke else 0.115
    decode_s = 30.0 if smoke else 2.3
    return [
        prefix_part(scale),
        Part(
            "training",
            "the demo's drafter, uncompiled SDPA",
            40 if smoke else 15,
            step_s,
            "steps",
            full.steps,
            5 if smoke else 300,
            0,
            "2026-12-04 log: 1,000 steps in about 130 s with the load",
            _training,
            _collect_training,
            needs=("prefix",),
            family="training",
        ),
        Part(
            "training-dflash2",
            "the DFlash2 drafter from the same shards, as many steps as the DFlash drafter",
            40 if smoke else 15,
            step_s * DFLASH2_STEP,
            "steps",
            full.steps,
            5 if smoke else 300,
            0,
            "estimate: DFlash's steps 10-20% slower (the block convolutions and the selector on a 5-layer drafter)",
            _dflash2(_training),
            _collect_training_dflash2,
            needs=("prefix",),
            family="training",
            follows="training",
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
            family="evaluation",
        ),
        Part(
            "evaluation-dflash2",
            "the DFlash2 drafter's offline evaluation (its selector's proposals and its unary ones) and export",
            60 if smoke else 100,
            0,
            "run",
            1,
            1,
            1,
            "estimate: as DFlash's (issue 46: ~100 s with the export); the selector's walk and trees, same blocks",
            _dflash2(_evaluation),
            _collect_evaluation_dflash2,
            needs=("training-dflash2",),
            family="evaluation",
        ),
        Part(
            "decoding",
            "online speculative decoding on HumanEval beside target-only greedy decoding; the peers on 4 prompts",
            60 if smoke else 80,
            decode_s,
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
            family="decoding",
        ),
        Part(
            "decoding-dflash2",
            "the DFlash2 drafter's online speculative decoding on the same HumanEval prompts, without the peers",
            60 if smoke else 42,
            decode_s,
            "prompts",
            4 if smoke else 164,
            2 if smoke else 32,
            1,
            "estimate: DFlash's decoding less the peers (~38 s on 4 prompts), ~2.3 s a prompt; no cold start: "
            "it runs after DFlash's decoding, which compiled the target (the compile cache is on disk)",
            _dflash2(_decoding),
            _collect_decoding_dflash2,
            needs=("evaluation-dflash2", "decoding"),
            family="decoding",
            follows="decoding",
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
