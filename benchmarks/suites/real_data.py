"""`make bench-gpu suite=real-data`: on SmolLM2, τ against training data at equal steps, and whether the stored
top-k buys τ when data is scarce: the demo's drafter recipe (`recipes.demo_smollm2`) trained several times side by
side on one H100 or H200, every run the same number of steps, each evaluated offline on HumanEval and the held-out chat.

    prefix      the demo's build, answers and shards (benchmarks.suites.smollm2)
    ladder      trainings side by side, then their evaluations side by side:
                  shares 0.03, 0.1, 0.3 and 1 of the training pool (a uniformly spread subset each,
                  `data.max_samples`), hard cross-entropy, seed 0: τ against data, four points at least;
                  at the 0.1 share, hard cross-entropy against cross-entropy plus a KL term on the stored top-k
                  (`loss.kl_weight`, option kl_weight=1.0), seeds 0 and 1 each;
                  the pool plus sampled answers, and the pool plus the library pool, where those parts ran
    sampled     the target's sampled answers (T 0.8, top-p 0.95, seed 1) to some of the training prompts, then the
                pool plus them extracted as one dataset
    library     greedy answers to some of the shipped library pool's 15,654 prompts, extracted with the pool

Priorities: prefix, ladder (as many steps as fit, at least 200), sampled, library (cut at the one-command budget; run
`only=library,ladder` in another command). Figures: `real_data.*`: the ladder and the loss comparison as
series, the KL term's change of τ at small data (mean over seeds), the steps.
"""

from __future__ import annotations

import dataclasses
import os
import statistics

from benchmarks.suites.figures import read_json
from benchmarks.suites.plan import Part
from benchmarks.suites.smollm2 import (
    ROOT,
    demo_stages,
    device_for,
    manifest_counts,
    prefix_part,
    run_dir,
    scale_for,
    step,
    steps_named,
)
from recipes.data_ladder import dataset_samples, run_summary
from recipes.demo_smollm2 import CONFIG

POOL = f"{ROOT}/shards/train"
SPLITS = ("humaneval", "chat_heldout")
EVALS = [f"offline evaluation ({split})" for split in SPLITS]


@dataclasses.dataclass(frozen=True)
class Training:
    tag: str  # runs/data-TAG
    data: str  # what it trains on, as the table says it
    shards: str
    share: float  # of the dataset's samples (1: all)
    loss: str  # "hard CE" or "CE + KL"
    seed: int

    @property
    def run(self) -> str:
        return f"data-{self.tag}"


def trainings(ctx) -> list[Training]:
    """The runs of the ladder: the pool's shares, the loss comparison at the small share, the extra sources."""
    shares, small = ((0.5, 1.0), 0.5) if ctx.scale == "smoke" else ((0.03, 0.1, 0.3, 1.0), 0.1)
    out = [Training(f"f{s:g}", f"{s:g} of the pool", POOL, s, "hard CE", 0) for s in shares]
    out += [Training(f"f{small:g}-s1", f"{small:g} of the pool", POOL, small, "hard CE", 1)]
    out += [
        Training(f"f{small:g}-kl-s{seed}", f"{small:g} of the pool", POOL, small, "CE + KL", seed) for seed in (0, 1)
    ]
    for source, said in (("sampled", "sampled answers"), ("library", "the library pool's answers")):
        if manifest_counts(f"{ROOT}/shards/train_{source}").get("samples"):
            out.append(Training(source, f"the pool + {said}", f"{ROOT}/shards/train_{source}", 1.0, "hard CE", 0))
    return out


def train_argv(ctx, t: Training, steps: int) -> list[str]:
    name, argv = step(demo_stages(ctx, t.run, seed=t.seed, steps=steps), "drafter training")
    argv = [*argv, f"data.shards={t.shards}"]
    if t.share < 1:
        total = dataset_samples(CONFIG, [f"data.shards={t.shards}"])
        argv.append(f"data.max_samples={max(1, round(t.share * total))}")
    if t.loss == "CE + KL":
        argv.append(f"loss.kl_weight={ctx.options.get('kl_weight', '1.0')}")
    return argv


def _ladder(ctx, units: int):
    runs = trainings(ctx)
    ctx.state["ladder"] = runs
    train = [(t.run, train_argv(ctx, t, units)) for t in runs]
    evals = [(f"{t.run} {name}", argv) for t in runs for name, argv in steps_named(demo_stages(ctx, t.run), EVALS)]
    return [train, evals]


def _regenerate_and_extract(source: str, prompts: str, per_unit: int, sampling: list[str]):
    """Stages of a data source: the target answers `units * per_unit` prompts of `prompts`, then the pool's
    greedy answers and these are extracted as one dataset, shards/train_SOURCE."""

    def stages(ctx, units: int):
        scale, device = scale_for(ctx.scale), device_for(ctx.scale)
        out = f"{ROOT}/regen/{source}"
        regen = ["-m", "extract.regenerate", CONFIG, f"corpus={ROOT}/prompts/{prompts}", f"out={out}"]
        regen += [f"max_records={units * per_unit}", f"max_new_tokens={scale.max_new_tokens}"]
        regen += [f"batch_size={scale.regen_batch}", f"device={device}", *sampling]
        mix = f"{ROOT}/regen/mix-{source}"  # the two answer files side by side: one corpus
        os.makedirs(mix, exist_ok=True)
        for name, target in (("pool.jsonl", "../train/data.jsonl"), (f"{source}.jsonl", f"../{source}/data.jsonl")):
            if not os.path.lexists(os.path.join(mix, name)):
                os.symlink(target, os.path.join(mix, name))
        extract = ["-m", "extract", CONFIG, f"device={device}", f'splits={{train_{source} = "{mix}"}}']
        return [[(f"regeneration ({source})", regen)], [(f"extraction (pool + {source})", extract)]]

    def collect(ctx, units: int) -> dict:
        counts = manifest_counts(f"{ROOT}/shards/train_{source}")
        return {
            f"real_data.{source}.samples": counts.get("samples"),
            f"real_data.{source}.tokens": counts.get("tokens"),
        }

    return stages, collect


def evaluated(run: str, split: str) -> dict:
    overall = ((read_json(os.path.join(run_dir(run), f"eval_{split}.json")) or {}).get("checkpoints") or [{}])[0]
    return overall.get("overall") or {}


def row(t: Training) -> dict:
    try:
        trained = run_summary(run_dir(t.run))
    except (OSError, ValueError, IndexError):
        trained = {}
    out = {"data": t.data, "loss": t.loss, "seed": t.seed, **{k: trained.get(k) for k in ("samples", "tokens_seen")}}
    out["epochs"], out["steps"] = trained.get("epochs"), trained.get("total_steps")
    for split in SPLITS:
        overall = evaluated(t.run, split)
        out[f"{split}_tau"], out[f"{split}_ddtree_tau_64"] = overall.get("tau"), overall.get("ddtree_tau_64")
    return out


def kl_change(rows: list[dict], split: str) -> float | None:
    """Mean τ with the KL term minus mean τ without it, over the seeds of the small share (None if one is missing)."""
    taus = {loss: [r[f"{split}_tau"] for r in rows if r["loss"] == loss] for loss in ("hard CE", "CE + KL")}
    if any(not v or None in v for v in taus.values()):
        return None
    return statistics.fmean(taus["CE + KL"]) - statistics.fmean(taus["hard CE"])


def _collect_ladder(ctx, units: int) -> dict:
    runs = ctx.state.get("ladder") or []
    rows = {t.tag: row(t) for t in runs}
    compared = next((t.share for t in runs if t.loss == "CE + KL"), None)  # the small share both losses train on
    small = [rows[t.tag] for t in runs if t.share == compared and t.shards == POOL]
    ladder = [rows[t.tag] for t in runs if t.loss == "hard CE" and t.seed == 0 and t.shards == POOL]
    sources = [rows[t.tag] for t in runs if t.share == 1.0 and t.seed == 0 and t.loss == "hard CE"]
    return {
        "real_data.steps": units,
        "real_data.ladder": ladder,
        "real_data.sources": sources if len(sources) > 1 else None,
        "real_data.loss": small,
        "real_data.kl_minus_hard.humaneval": kl_change(small, "humaneval"),
        "real_data.kl_minus_hard.chat_heldout": kl_change(small, "chat_heldout"),
        "real_data.kl_weight": float(ctx.options.get("kl_weight", "1.0")),
    }


def parts(scale: str, options: dict) -> list[Part]:
    smoke = scale == "smoke"
    sampling = ["temperature=0.8", "top_p=0.95", "seed=1"]
    sampled, sampled_collect = _regenerate_and_extract("sampled", "train.jsonl", 512, sampling)
    library, library_collect = _regenerate_and_extract("library", "library.jsonl", 1024, [])
    return [
        prefix_part(scale),
        Part(
            "sampled",
            "sampled answers to training prompts, extracted with the pool",
            120 if smoke else 40,
            60 if smoke else 14,
            "x 512 answers",
            1 if smoke else 11,
            1 if smoke else 2,
            2,
            "2026-12-03 log: 2,048 sampled answers in 49.5 s (6,148 tok/s); extraction ~55 K tok/s",
            sampled,
            sampled_collect,
            needs=("prefix",),
        ),
        Part(
            "library",
            "greedy answers to library prompts, extracted with the pool",
            120 if smoke else 40,
            60 if smoke else 17,
            "x 1,024 prompts",
            1 if smoke else 16,
            1 if smoke else 4,
            6,
            "estimate from the 2026-12-02 regeneration rate (12,989 tok/s greedy) and extraction (~55 K tok/s)",
            library,
            library_collect,
            needs=("prefix",),
        ),
        Part(
            "ladder",
            "trainings at equal steps side by side (shares, losses, seeds, sources), then their evaluations",
            120 if smoke else 140,
            60 if smoke else 0.46,
            "steps",
            30 if smoke else 1000,
            3 if smoke else 200,
            1,
            "2026-12-03 log: four 1,000-step trainings side by side in 288 s (one alone 123-139 s); evaluations "
            "~60 s each, eight at a time",
            _ladder,
            _collect_ladder,
            needs=("prefix",),
            jobs=1 if smoke else 8,  # small trainings are bound by kernel launches: eight share one GPU
        ),
    ]
