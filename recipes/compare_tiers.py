"""`make tiers` / `python -m recipes.compare_tiers [CONFIG] [key=value ...]`: choose a storage tier for
your own model by measuring what each one costs, side by side with lossless.

Steps, each the project's own command, run by the recipes' step runner (`recipes.runner`; its ledger
OUT/stages.json): rerunning the command skips a step done with the same command and inputs, resumes
one cut short (a training is done only at its final checkpoint) and redoes one whose settings changed:
  1. (optional, `extract=true`) extract a small lossless subset of your corpus
         python -m extract CONFIG out_dir=OUT/data/lossless max_records=N      (CONFIG's [extract] table)
  2. derive every tier from it, without the target
         python -m shards transcode OUT/data/lossless OUT/data/TIER encoding=... [projection=...]
  3. train a drafter on each tier (and on lossless) for every seed
         python -m train CONFIG data.shards=OUT/data/TIER run_name=TIER-sSEED seed=SEED out_dir=OUT/runs
  4. evaluate each tier's drafter against lossless's of the same seed, side by side, on the lossless
     held-out data (what the drafter meets when it serves: full bf16 features); `heldout` may name
     several sets ({humaneval = DIR, chat_heldout = DIR}), each evaluated
         python -m train.eval OUT/runs/lossless-sSEED OUT/runs/TIER-sSEED --data HELDOUT
  5. (optional, `online=true`) export each drafter and decode speculatively with the real target, on
     each prompt set of `prompts` (one file, or several by name)
         python -m train.serve.export RUN RUN/export
         python -m train.serve.specdecode --target T --drafter RUN/export ...
and writes OUT/tiers.md and OUT/tiers.json: one row per tier (lossless first) with bytes/token and
the ratio to raw bf16 of the full features, reconstruction error per tap (recorded at encode time),
variance kept per tap (a projection's share of each tap's second moment), held-out acc@1 (block
position 1), chain τ and DDTree-B τ per held-out set and online τ per prompt set, each as the mean
over seeds with the per-seed values, and the change against lossless.

Tiers are written `ENCODING` or `ENCODING@PROJECTION`, e.g. `fp8`, `nf4-g64`, `fp8@pca:rank=32`.
With no CONFIG the tiny default runs (configs/tiny.toml; `make tiny` and `make extract` first).
On the real target SmolLM2-135M-Instruct: `make tiers CONFIG=configs/smollm2-135m.toml` (its [tiers]
table: the full scale, for a GPU) or `CONFIG=configs/smollm2-135m-tiers-cpu.toml` (a reduced scale
for a CPU); docs/benchmarks-log-2026-11-30-to-2026-12-04.md, "Storage tiers on the real target".
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import sys
import tomllib
from pathlib import Path

from common.config import ConfigError, describe, fail, knob, load_config
from common.interrupts import run_main
from common.io import resolve
from recipes.drafter.plan import EXPORT_FILES
from recipes.experiment import experiment_config
from recipes.runner import Ledger, Runner, Stage
from recipes.step_check import check_steps
from shards import ShardDataset
from shards.describe import raw_bytes_per_token, reconstruction_by_tap
from shards.manifest import MANIFEST_NAME, load_manifest
from shards.provenance import provenance_of
from train.config import TrainConfig

TINY_CONFIG = "configs/tiny.toml"


@dataclasses.dataclass(frozen=True)
class CompareTiersConfig:
    config: str = knob(
        TINY_CONFIG,
        help="the experiment's config file: its [extract] table (step 1) and [train] table (step 3)",
        path="local_in",
    )
    out_dir: str = knob(
        "runs/tiers",
        help="where tier datasets (data/), runs (runs/) and the comparison (tiers.md, tiers.json) go",
        path="dir_out",
    )
    tiers: list[str] = knob(
        factory=lambda: ["fp8", "nf4-g64", "fp8@pca:rank=32"],
        help="tiers to compare with lossless: ENCODING or ENCODING@pca:rank=R / @pca:variance=V / @PROJECTION_FILE",
    )
    seeds: list[int] = knob(factory=lambda: [0, 1], help="training seeds per tier (the spread shows the noise)")
    lossless: str = knob(
        "artifacts/tiny/shards/train",
        help="the lossless training subset (written by step 1 with extract=true)",
        path="data_in",
    )
    heldout: str | dict[str, str] | None = knob(
        "artifacts/tiny/shards/heldout",
        help="lossless held-out dataset every drafter is evaluated on, or several by name ({humaneval = DIR, "
        "chat = DIR}); none = the held-out split (holdout_fraction) of `lossless`, which the training runs "
        "then leave out",
        path="data_in",
    )
    holdout_fraction: float = knob(
        0.02,
        help="with heldout = none: share of `lossless` held out (by sample-id hash) for evaluation",
        min=0.0,
        max=0.5,
    )
    extract: bool = knob(False, help="step 1: extract `lossless` first with CONFIG's [extract] table and max_records")
    max_records: int = knob(2000, help="step 1: corpus records to extract", min=1)
    calibration_samples: int = knob(256, help="samples the PCA of a projected tier is fitted on", min=1)
    train_overrides: list[str] = knob(
        factory=list, help="extra key=value overrides for every training run, e.g. ['optim.epochs=3']"
    )
    eval_overrides: list[str] = knob(
        factory=lambda: ["max_anchors=16"], help="extra key=value overrides for every evaluation"
    )
    online: bool = knob(True, help="step 5: export and run real speculative decoding (needs the target checkpoint)")
    target: str | None = knob(
        None, help="target checkpoint for step 5; none = the lossless dataset's provenance target", path="local_in"
    )
    prompts: str | dict[str, str] = knob(
        "artifacts/tiny/corpus/heldout_regen.jsonl",
        help="step 5: JSONL prompts ({'messages': [...]}), or several sets by name ({humaneval = FILE, ...})",
        path="local_in",
    )
    num_prompts: int = knob(8, help="step 5: prompts decoded per drafter", min=1)
    max_new_tokens: int = knob(96, help="step 5: tokens generated per prompt", min=1)
    specdecode_overrides: list[str] = knob(
        factory=list, help="step 5: extra key=value overrides for every decoding run, e.g. ['device=cuda']"
    )
    budget: int = knob(32, help="the DDTree node budget reported (one of the eval budgets)", min=1)
    jobs: int = knob(
        1,
        help="steps 2-5 run this many commands at a time, each logging to OUT/logs/ (1: one after another, "
        "output on the terminal). On one GPU small drafters are bound by kernel launches, so several runs "
        "share it well; the decodings' speed is not compared, only their τ",
        min=1,
        max=64,
    )

    def check(self) -> None:
        for key in ("heldout", "prompts"):
            for name in named_sets(getattr(self, key)):
                if name and not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                    fail(key, f"set name {name!r} must be a plain file name (letters, digits, '_', '-', '.')")


def tier_name(tier: str) -> str:
    """A directory name for a tier: fp8@pca:rank=32 -> fp8-pca-rank32, fp8@pca:rank=32,keep=4 ->
    fp8-pca-rank32-keep4."""
    encoding, _, projection = tier.partition("@")
    if not projection:
        return encoding
    if projection.startswith("pca:"):
        return f"{encoding}-pca-{projection[4:].replace('=', '').replace(',', '-')}"
    return f"{encoding}-proj-{Path(projection).stem}"


def _complete(root: str) -> bool:
    """Whether `root` (a local path or a store URI) holds a complete dataset."""
    try:
        return bool(_read_manifest(root).get("complete"))
    except (FileNotFoundError, ValueError):
        return False


def _read_manifest(root: str) -> dict:
    return load_manifest(*resolve(root))


def check_datasets(cfg: CompareTiersConfig) -> None:
    """ConfigError naming the key for a dataset the steps read that is not there, before any step runs:
    `lossless` (unless step 1 extracts it) and every held-out set."""
    if not cfg.extract and not _complete(cfg.lossless):
        fail(
            "lossless",
            f"no complete dataset at {cfg.lossless} (run `make tiny` and `make extract`, or set extract=true)",
        )
    for name, data in named_sets(cfg.heldout).items():
        if not _complete(data):
            fail("heldout" + (f".{name}" if name else ""), f"no complete dataset at {data}")


def _manifest(root: str) -> str:
    return str(Path(root, MANIFEST_NAME))


def run_all(cfg: CompareTiersConfig) -> dict:
    """Every step of the module docstring through the recipes' step runner (OUT/stages.json: a step
    done with the same command and inputs is skipped, one cut short resumes), then the table."""
    out = Path(cfg.out_dir)
    runner = Runner(
        Ledger(str(out / "stages.json")),
        label="compare_tiers",
        side_by_side=cfg.jobs > 1,
        log_dir=str(out / "logs"),
        max_running=cfg.jobs,
        show_tail=0,
    )
    _ensure_lossless(cfg, runner)
    datasets, runs, groups = plan(cfg, cfg.target or _provenance_target(cfg.lossless) if cfg.online else "")
    check_steps(groups)
    runner.run(groups)
    table = collect(cfg, datasets, runs)
    (out / "tiers.json").write_text(
        json.dumps({"config": dataclasses.asdict(cfg), "rows": table, "steps": runner.summary()}, indent=1) + "\n"
    )
    (out / "tiers.md").write_text("\n".join(markdown(table, cfg)) + "\n")
    print("\n" + "\n".join(markdown(table, cfg)))
    print(f"\nwrote {out / 'tiers.md'} and {out / 'tiers.json'}")
    return {"rows": table}


def _ensure_lossless(cfg: CompareTiersConfig, runner: Runner) -> None:
    """Step 1: the lossless dataset, extracted here with `extract=true` unless it is complete already
    (never removed: it may be the user's own); refused when it is missing."""
    if cfg.extract and not _complete(cfg.lossless):
        args = (cfg.config, f"out_dir={cfg.lossless}", f"max_records={cfg.max_records}", "splits={}")
        extraction = Stage(
            "extraction", "extract", (*args, "corpus=" + _extract_corpus(cfg)), records=(_manifest(cfg.lossless),)
        )
        check_steps([[extraction]])
        runner.run([[extraction]])
    if not _complete(cfg.lossless):
        fail("lossless", f"step 1 left no complete dataset at {cfg.lossless}")


def plan(cfg: CompareTiersConfig, target: str) -> tuple[dict[str, str], dict, list[list[Stage]]]:
    """({tier: dataset}, lossless first; {(tier, seed): run directory}; steps 2-5 as groups of steps,
    each group needing only what earlier ones wrote). `target` decodes in step 5."""
    out = Path(cfg.out_dir)
    datasets = {"lossless": cfg.lossless, **{tier: str(out / "data" / tier_name(tier)) for tier in cfg.tiers}}
    runs = {(tier, seed): out / "runs" / f"{tier_name(tier)}-s{seed}" for tier in datasets for seed in cfg.seeds}
    groups = [
        [_transcode_stage(cfg, tier, datasets[tier]) for tier in cfg.tiers],
        [_training_stage(cfg, tier, seed, datasets[tier], run) for (tier, seed), run in runs.items()],
        _evaluation_stages(cfg, out, runs),
    ]
    if cfg.online:
        groups.append([_export_stage(run) for run in runs.values()])
        groups.append(
            [_decoding_stage(cfg, target, run, name, p) for run in runs.values() for name, p in _prompts(cfg)]
        )
    return datasets, runs, [group for group in groups if group]


def _prompts(cfg: CompareTiersConfig) -> list[tuple[str, str]]:
    return list(named_sets(cfg.prompts).items())


def _transcode_stage(cfg: CompareTiersConfig, tier: str, path: str) -> Stage:
    encoding, _, projection = tier.partition("@")
    args = ("transcode", cfg.lossless, path, f"encoding={encoding}", f"calibration_samples={cfg.calibration_samples}")
    return Stage(
        f"transcode {tier_name(tier)}",
        "shards",
        args + ((f"projection={projection}",) if projection else ()),
        records=(_manifest(path),),
        clear=(path,),
        reads=(_manifest(cfg.lossless),),
    )


def _training_stage(cfg: CompareTiersConfig, tier: str, seed: int, data: str, run: Path) -> Stage:
    """Done only at the run's final checkpoint (`Stage.training_run`): a run cut short resumes."""
    holdout = [] if cfg.heldout else [f"data.holdout_fraction={cfg.holdout_fraction}"]
    args = (cfg.config, f"data.shards={data}", f"run_name={run.name}", f"seed={seed}", f"out_dir={run.parent}")
    lossless = tier == "lossless"
    return Stage(
        f"train {run.name}",
        "train",
        (*args, "log.progress=false", *holdout, *cfg.train_overrides),
        clear=(str(run),),
        needs=() if lossless else (f"transcode {tier_name(tier)}",),
        reads=(_manifest(data),) if lossless else (),
        training_run=str(run),
    )


def _evaluation_stages(cfg: CompareTiersConfig, out: Path, runs: dict) -> list[Stage]:
    """Each tier's drafter against the lossless one of its seed, on every held-out set."""
    stages = []
    for name, data in eval_sets(cfg).items():
        split = ["split=all"] if data else ["split=holdout", f"holdout_fraction={cfg.holdout_fraction}"]
        for tier in cfg.tiers:
            for seed in cfg.seeds:
                report = str(eval_report_path(out, name, tier, seed))
                pair = (runs[("lossless", seed)], runs[(tier, seed)])
                stages.append(
                    Stage(
                        f"eval {tier_name(tier)}-s{seed}" + (f" ({name})" if name else ""),
                        "train.eval",
                        (*map(str, pair), "--data", data or cfg.lossless, "--out", report, "progress=false")
                        + (*split, *cfg.eval_overrides),
                        records=(report,),
                        clear=(report,),
                        needs=tuple(f"train {run.name}" for run in pair),
                        reads=(_manifest(data or cfg.lossless),),
                    )
                )
    return stages


def _export_stage(run: Path) -> Stage:
    export = run / "export"
    return Stage(
        f"export {run.name}",
        "train.serve.export",
        (str(run), str(export)),
        records=tuple(str(export / name) for name in EXPORT_FILES),
        clear=(str(export),),
        needs=(f"train {run.name}",),
    )


def _decoding_stage(cfg: CompareTiersConfig, target: str, run: Path, name: str, prompts: str) -> Stage:
    """An exported drafter decoding one prompt set with the real target."""
    result = str(specdecode_path(run, name))
    sizes = ("--num-prompts", str(cfg.num_prompts), "--max-new-tokens", str(cfg.max_new_tokens))
    return Stage(
        f"specdecode {run.name}" + (f" ({name})" if name else ""),
        "train.serve.specdecode",
        ("--target", target, "--drafter", str(run / "export"), "--prompts", prompts, *sizes, "--no-baseline")
        + ("--out", result, *cfg.specdecode_overrides),
        records=(result,),
        clear=(result,),
        needs=(f"export {run.name}",),
        reads=(prompts,),
    )


def _extract_corpus(cfg: CompareTiersConfig) -> str:
    table = tomllib.loads(Path(cfg.config).read_text()).get("extract", {})
    corpus = table.get("corpus") or (table.get("splits") or {}).get("train")
    if not corpus:
        raise SystemExit(f"compare_tiers: {cfg.config} [extract] names no corpus (or splits.train) for step 1")
    return corpus


def _provenance_target(root: str) -> str:
    target = provenance_of(_read_manifest(root)).target.name_or_path
    if not target:
        raise ValueError(f"config key 'target': the provenance of {root} names no target; set target=DIR for step 5")
    return target


# ----------------------------------------------------------------------------------------------
# The comparison


def dataset_facts(root: str) -> dict:
    """bytes/token (shard files), ratio to raw bf16 of the full features, recorded error per tap."""
    ds = ShardDataset(root, verify_samples=False)
    tokens = ds.manifest["counts"]["tokens"]
    stored = sum(e["bytes"] + e["index_bytes"] for e in ds.shards)
    full_width = ds.projection["in_width"] if ds.projection else ds.hidden_width
    taps, _, _ = reconstruction_by_tap(ds.shards)
    return {
        "bytes_per_token": stored / tokens,
        "ratio_to_raw_bf16": stored / tokens / raw_bytes_per_token(full_width, ds.topk)["hidden"],
        "rel_rms_per_tap": [t["rel_rms"] for t in taps],
        "worst_channel_rel_rms": max((t["worst_channel_rel_rms"] for t in taps), default=0.0),
        "projection_file_bytes": ds.projection["bytes"] if ds.projection else 0,
        "variance_kept_per_tap": list(ds.projection.get("explained") or []) if ds.projection else [],
    }


def named_sets(value: str | dict | None) -> dict[str, str]:
    """A path, or {name: path}, as {name: path}; a single path is the set named "" (its files keep the
    names a single set always had: eval/TIER-sSEED.json, specdecode.json)."""
    if value is None:
        return {}
    return dict(value) if isinstance(value, dict) else {"": value}


def eval_sets(cfg: CompareTiersConfig) -> dict[str, str | None]:
    """The held-out sets by name; none = the held-out split of `lossless` (value None)."""
    return named_sets(cfg.heldout) or {"": None}


def eval_report_path(out: Path, name: str, tier: str, seed: int) -> Path:
    return out / "eval" / name / f"{tier_name(tier)}-s{seed}.json"


def specdecode_path(run: Path, name: str) -> Path:
    return run / (f"specdecode-{name}.json" if name else "specdecode.json")


def metric_key(metric: str, name: str) -> str:
    return f"{metric}:{name}" if name else metric


def _eval_metrics(overall: dict, budget: int, name: str) -> dict:
    return {
        metric_key("acc1", name): overall["position_acceptance"][0],
        metric_key("chain_tau", name): overall["tau"],
        metric_key("ddtree_tau", name): overall.get(f"ddtree_tau_{budget}"),
    }


def metric_keys(cfg: CompareTiersConfig) -> list[str]:
    """The table's metric columns in order: per held-out set acc@1, chain τ, DDTree τ; then online τ
    per prompt set (when decoding runs)."""
    keys = [metric_key(m, name) for name in eval_sets(cfg) for m in ("acc1", "chain_tau", "ddtree_tau")]
    return keys + ([metric_key("online_tau", name) for name in named_sets(cfg.prompts)] if cfg.online else [])


def collect(cfg: CompareTiersConfig, datasets: dict, runs: dict) -> list[dict]:
    out = Path(cfg.out_dir)
    per_seed: dict = {tier: {} for tier in datasets}
    for name in eval_sets(cfg):
        for tier in cfg.tiers:
            for seed in cfg.seeds:
                report = json.loads(eval_report_path(out, name, tier, seed).read_text())
                lossless, this = report["checkpoints"]
                per_seed["lossless"].setdefault(seed, {}).update(_eval_metrics(lossless["overall"], cfg.budget, name))
                per_seed[tier].setdefault(seed, {}).update(_eval_metrics(this["overall"], cfg.budget, name))
    for (tier, seed), run in runs.items():
        for name in named_sets(cfg.prompts):
            spec = specdecode_path(run, name)
            if spec.is_file() and seed in per_seed[tier]:
                per_seed[tier][seed][metric_key("online_tau", name)] = json.loads(spec.read_text())["summary"]["tau"]
    rows = []
    for tier, path in datasets.items():
        row = {"tier": tier, **dataset_facts(path), "seeds": per_seed[tier]}
        for metric in metric_keys(cfg):
            values = [v[metric] for v in per_seed[tier].values() if v.get(metric) is not None]
            row[metric] = statistics.fmean(values) if values else None
        rows.append(row)
    reference = rows[0]
    for row in rows:
        for metric in metric_keys(cfg):
            a, b = reference.get(metric), row.get(metric)
            row[f"delta_{metric}"] = (b - a) / a if a and b is not None else None
    return rows


def _cell(row: dict, metric: str, spec: str = ".3f") -> str:
    mean = row.get(metric)
    if mean is None:
        return "-"
    values = [v.get(metric) for v in row["seeds"].values()]
    per_seed = " / ".join(format(v, spec) for v in values if v is not None)
    delta = row.get(f"delta_{metric}")
    change = "" if row["tier"] == "lossless" or delta is None else f" ({delta:+.1%})"
    return f"{mean:{spec}}{change} [{per_seed}]"


METRIC_NAMES = {"acc1": "acc@1", "chain_tau": "chain τ", "online_tau": "online τ"}


def _header(metric: str, budget: int) -> str:
    base, _, name = metric.partition(":")
    label = METRIC_NAMES.get(base, f"DDTree-{budget} τ")
    return f"{label} ({name})" if name else label


def markdown(rows: list[dict], cfg: CompareTiersConfig) -> list[str]:
    metrics = metric_keys(cfg)
    lines = [
        "| tier | bytes/token | vs raw bf16 | rel. RMS per tap | variance kept per tap | worst channel | "
        + " | ".join(_header(m, cfg.budget) for m in metrics)
        + " |",
        "|---|---:|---:|---|---|---:|" + "---|" * len(metrics),
    ]
    for r in rows:
        rel = " / ".join(f"{x:.3f}" for x in r["rel_rms_per_tap"]) or "0 (exact)"
        kept = " / ".join(f"{x:.4f}" for x in r["variance_kept_per_tap"]) if r["variance_kept_per_tap"] else "1"
        lines.append(
            f"| {r['tier']} | {r['bytes_per_token']:,.0f} | {r['ratio_to_raw_bf16']:.3f} | {rel} | {kept} | "
            f"{r['worst_channel_rel_rms']:.2f} | " + " | ".join(_cell(r, m) for m in metrics) + " |"
        )
    where = ", ".join(f"{name or 'held out'}: {path or cfg.lossless}" for name, path in eval_sets(cfg).items())
    prompts = ", ".join(f"{name or 'prompts'}: {path}" for name, path in named_sets(cfg.prompts).items())
    lines.append(
        f"\nmean over seeds {cfg.seeds} (change against lossless) [per seed]; evaluated with lossless features on "
        f"{where}; variance kept: the projection's share of each tap's second moment on its calibration "
        f"sample (1 = not projected)"
        + (f"; online: {cfg.num_prompts} prompts x {cfg.max_new_tokens} tokens of {prompts}" if cfg.online else "")
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    """`[CONFIG] key=value ...`: CONFIG's [tiers] table (if any) and the overrides; CONFIG is also the
    experiment config of steps 1 and 3 unless `config=` says otherwise."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__ + "\nkeys:\n" + describe(CompareTiersConfig))
        return 0
    try:
        cfg = config_from_argv(argv)
        check_datasets(cfg)  # before step 1 or 2 spends minutes
        run_all(cfg)  # every step's command line is checked before any runs (ValueError)
    except ValueError as err:  # a config, input or data error (exit 2: docs/ARCHITECTURE.md, "Exit status")
        print(f"compare_tiers: {err}", file=sys.stderr)
        return 2
    return 0


def config_from_argv(argv: list[str]) -> CompareTiersConfig:
    """CONFIG's [tiers] table (if any) and the overrides; CONFIG is also the experiment config. The
    experiment config's [train] table is checked too, before any step runs (ConfigError naming the key)."""
    cfg = experiment_config(CompareTiersConfig, argv, "tiers")
    try:  # what step 3 trains with, checked before steps 1 and 2 spend minutes
        load_config(TrainConfig, cfg.config, cfg.train_overrides, section="train")
    except ConfigError as err:
        raise ConfigError(f"{cfg.config} [train] with train_overrides: {err}") from None
    return cfg


if __name__ == "__main__":
    raise SystemExit(
        run_main(
            "compare_tiers", main, spawns=True, after="rerunning the same command resumes: finished steps are skipped"
        )
    )
