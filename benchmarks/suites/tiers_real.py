"""`make bench-gpu suite=tiers-real`: the storage-tier comparison on SmolLM2 (`make tiers` on
configs/smollm2-135m.toml, `recipes.compare_tiers`) at the scale that fits one command on one H100 or H200.

    prefix        the demo's build, answers and shards (benchmarks.suites.smollm2)
    tiers         every tier of the config's [tiers] table transcoded from the lossless training split, a drafter
                  trained on each and on lossless side by side (six at a time, the config's `jobs`), each evaluated
                  against lossless on HumanEval and the held-out chat split: as many training steps as fit
    tiers-online  the same comparison again with online decoding (it resumes: only the exports and decodings
                  run), as many prompts per set as fit

Options: tiers=["fp8","nf4-g64"] (default: the config's), seeds=[0] (default: one seed, the time of one command).
At the smoke scale (a CPU) configs/smollm2-135m-tiers-cpu.toml. Figures: `tiers_real.*`: one row per tier (bytes per
token, vs raw bf16, chain τ and its change against lossless per held-out set, online τ where decoded), the steps.
"""

from __future__ import annotations

import json

from benchmarks.suites.figures import read_json
from benchmarks.suites.plan import Part
from benchmarks.suites.smollm2 import prefix_part

OUT = "runs/bench-tiers"
CONFIGS = {"gpu": "configs/smollm2-135m.toml", "smoke": "configs/smollm2-135m-tiers-cpu.toml"}
# The config's train_overrides but the steps (compare_tiers replaces the whole list).
TRAIN = {
    "gpu": ["model.attention=sdpa"],
    "smoke": [
        "device=cpu",
        "model.num_layers=2",
        "data.token_budget=1024",
        "loss.num_anchors=16",
        "data.prefetch_threads=1",
    ],
}


def compare_argv(ctx, steps: int, online: bool, prompts: int = 1) -> list[str]:
    """`python -m recipes.compare_tiers CONFIG ...` for this scale, `steps` steps per training."""
    train = [f"optim.max_steps={steps}", f"checkpoint.every={steps}", *TRAIN[ctx.scale]]
    argv = ["-m", "recipes.compare_tiers", CONFIGS[ctx.scale], f"out_dir={OUT}", f"train_overrides={json.dumps(train)}"]
    argv += [f"seeds={ctx.options.get('seeds', '[0]')}", f"online={str(online).lower()}", f"num_prompts={prompts}"]
    return argv + ([f"tiers={ctx.options['tiers']}"] if "tiers" in ctx.options else [])


def trained_steps(ctx) -> int:
    """The steps the `tiers` part trained, in this command or an earlier one it continues."""
    return ((ctx.state.get("parts") or {}).get("tiers") or {}).get("units", 1)


def _tiers(ctx, units: int):
    return [[("storage tiers", compare_argv(ctx, units, online=False))]]


def _online(ctx, units: int):
    return [[("storage tiers, online", compare_argv(ctx, trained_steps(ctx), online=True, prompts=units))]]


def tier_rows(report: dict | None) -> list[dict]:
    """One flat row per tier of recipes.compare_tiers' tiers.json (lossless first)."""
    rows = []
    for r in (report or {}).get("rows") or []:
        out = {
            "tier": r["tier"],
            "bytes_per_token": r.get("bytes_per_token"),
            "vs_raw_bf16": r.get("ratio_to_raw_bf16"),
        }
        for key, value in r.items():
            if ":" in key and (key.startswith(("chain_tau", "online_tau", "acc1", "delta_chain_tau", "delta_online"))):
                out[key.replace(":", "_")] = value
        out["seeds"] = ", ".join(str(s) for s in (r.get("seeds") or {}))
        rows.append(out)
    return rows


def _collect(ctx, units: int):
    report = read_json(f"{OUT}/tiers.json")
    return {"tiers_real.rows": tier_rows(report) or None, "tiers_real.steps": trained_steps(ctx)}, report


def parts(scale: str, options: dict) -> list[Part]:
    smoke = scale == "smoke"
    return [
        prefix_part(scale),
        Part(
            "tiers",
            "tiers transcoded, trained side by side with lossless, evaluated against it on both held-out sets",
            300 if smoke else 170,
            30 if smoke else 0.4,
            "steps",
            3 if smoke else 1000,
            1 if smoke else 200,
            1,
            "2026-12-03 log: four 1,000-step trainings side by side in 288 s; six at a time (jobs = 6) not measured "
            "yet; transcoding with PCA calibration ~30 s; ten evaluations six at a time ~120 s",
            _tiers,
            _collect,
            needs=("prefix",),
        ),
        Part(
            "tiers-online",
            "the same comparison with online decoding (exports and decodings only)",
            300 if smoke else 60,
            60 if smoke else 3,
            "prompts",
            1 if smoke else 32,
            1 if smoke else 4,
            3,
            "estimate: uncompiled decoding ~1.5 s a prompt, twelve decodings six at a time",
            _online,
            _collect,
            needs=("tiers",),
        ),
    ]
