"""How τ grows with data: the same drafter trained on growing shares of one training set (a fixed,
uniformly spread subset each: `data.max_samples`), each evaluated offline on the same held-out shards.

    python -m recipes.data_ladder [CONFIG] [key=value ...]
    python -m recipes.data_ladder configs/smollm2-135m.toml fractions='[0.1, 0.3, 1]' steps=800 \\
        heldout='["artifacts/smollm2/shards/humaneval", "artifacts/smollm2/shards/chat_heldout"]' \\
        train_overrides='["device=cuda"]'

CONFIG's [ladder] table (if it has one) sets the keys below (`--help` lists them); CONFIG is also the
training config (its [train] table trains every run) unless `config=` names another. Every size trains
the same number of steps (`steps`, or the config's), so a smaller share is seen for more epochs; the
table prints both, with the loss tokens each run trained on, so the reader sees whether a point is
short of data or short of steps. Runs go to OUT/PREFIX-fFRACTION (OUT: the training config's
out_dir). The steps run through the recipes' step runner (`recipes.runner`, its ledger
OUT/PREFIX-stages.json): a rerun skips a size done with the same settings, resumes a training cut
short and redoes one whose settings changed. Bad keys, a config that does not load and held-out sets
that cannot be read are refused in one line before the first run trains; a run that fails stops the
ladder after its own message. Exit statuses: docs/ARCHITECTURE.md, "Exit status".

Before issue 53 the ladder took options (`CONFIG --eval DIR --fractions 0.1,0.3,1 --steps N ...
[train key=value ...]`); those words are refused in one line that gives the keys that replace them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from common.config import ConfigError, describe, fail, knob, load_config
from common.interrupts import run_main
from common.io import atomic_write_text, exists_at, join_uri
from common.locations import check_problem
from recipes.drafter.results import num
from recipes.experiment import experiment_config
from recipes.runner import Ledger, Runner, Stage
from recipes.step_check import check_steps
from shards import ShardDataset
from shards.manifest import MANIFEST_NAME
from train.config import TrainConfig

TINY_CONFIG = "configs/tiny.toml"
# The options of the ladder's old command line, and the keys that replace them.
OLD_OPTIONS = {
    "--eval": "heldout=[DIR, ...]",
    "--fractions": "fractions=[0.1, 0.3, 1]",
    "--eval-split": "eval_overrides=['split=all']",
    "--max-anchors": "eval_overrides=['max_anchors=N']",
}


@dataclasses.dataclass(frozen=True)
class DataLadderConfig:
    config: str = knob(
        TINY_CONFIG, help="the training config file: its [train] table trains every run", path="local_in"
    )
    heldout: list[str] = knob(
        factory=lambda: ["artifacts/tiny/shards/heldout"],
        help="held-out shards datasets every run is evaluated on (a τ column each, named by its folder)",
    )
    fractions: list[float] = knob(factory=lambda: [0.1, 0.3, 1.0], help="shares of the training set, each in (0, 1]")
    steps: int | None = knob(None, help="training steps of every run (none: the config's)", min=1)
    prefix: str = knob("ladder", help="the runs are named PREFIX-fFRACTION")
    train_overrides: list[str] = knob(
        factory=list, help="extra key=value overrides for every training run, e.g. ['device=cuda']"
    )
    eval_overrides: list[str] = knob(
        factory=lambda: ["max_anchors=16"],
        help="extra key=value overrides for every evaluation: anchors per held-out sequence (none: every "
        "position; the demo's offline evaluation uses 16 too), ['split=all'] to measure training data on purpose",
    )
    out: str | None = knob(None, help="write the table as JSON here (after every size)", path="file_out")

    def check(self) -> None:
        if not self.heldout:
            fail("heldout", "name at least one held-out shards dataset")
        if not self.fractions or any(not 0 < f <= 1 for f in self.fractions):
            fail("fractions", f"expected shares in (0, 1], got {self.fractions}")


def check_heldout_sets(sets: list[str]) -> None:
    """ConfigError naming `heldout` unless each is a dataset that can be read (before any training)."""
    for data in sets:
        problem = check_problem(data, "data_in")
        if problem is None and not exists_at(join_uri(data, MANIFEST_NAME)):
            problem = f"no shards dataset at {data!r} (no {MANIFEST_NAME})"
        if problem:
            fail("heldout", problem)


def config_from_argv(argv: list[str]) -> tuple[DataLadderConfig, TrainConfig]:
    """The ladder's config and the training config its runs start from (ConfigError naming the key)."""
    old = next((word.partition("=")[0] for word in argv if word.partition("=")[0] in OLD_OPTIONS), None)
    if old is not None:
        raise ConfigError(
            f"'{old}' is the ladder's old option; it takes [CONFIG] key=value now: "
            + ", ".join(dict.fromkeys(OLD_OPTIONS.values()))
            + ", steps=N, train_overrides=['key=value', ...] (--help lists every key)"
        )
    cfg = experiment_config(DataLadderConfig, argv, "ladder")
    check_heldout_sets(cfg.heldout)
    try:
        train = load_config(TrainConfig, cfg.config, cfg.train_overrides, section="train")
    except ConfigError as err:
        raise ConfigError(f"{cfg.config} [train] with train_overrides: {err}") from None
    return cfg, train


def dataset_samples(config: str, overrides: list[str]) -> int:
    """Samples in the training set `config` [train] with `overrides` trains on."""
    return len(ShardDataset(load_config(TrainConfig, config, overrides, section="train").data.shards))


def run_summary(run_dir: str) -> dict:
    """Steps, epochs, samples and tokens trained on, from the run's own files."""
    with open(os.path.join(run_dir, "run.json")) as f:
        run = json.load(f)
    with open(os.path.join(run_dir, "data_plan.json")) as f:
        plan = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        last = json.loads(f.read().strip().splitlines()[-1])
    steps, per_epoch = run.get("total_steps"), run.get("steps_per_epoch")
    return {
        "total_steps": steps,
        "epochs": steps / per_epoch if steps and per_epoch else None,
        "samples": sum(b.get("samples", 0) for b in plan.get("buckets", [])),
        "tokens_seen": last.get("tokens"),
    }


def set_name(data: str) -> str:
    """A held-out set's column: its folder's name."""
    return os.path.basename(os.path.normpath(data))


def eval_out(run_dir: str, data: str) -> str:
    return os.path.join(run_dir, f"eval_{set_name(data)}.json")


@dataclasses.dataclass(frozen=True)
class Size:
    """One rung: a share of the training set, its run, its training and its evaluations."""

    fraction: float
    samples: int
    run_dir: str
    training: Stage
    evaluations: tuple[Stage, ...]


def plan(cfg: DataLadderConfig, out_dir: str, total: int) -> list[Size]:
    """Each share's training (done only at its final checkpoint) and its evaluations, smallest first."""
    sizes = []
    for fraction in sorted(cfg.fractions):
        run = f"{cfg.prefix}-f{fraction:g}"
        run_dir, samples = os.path.join(out_dir, run), max(1, round(fraction * total))
        steps = [f"optim.max_steps={cfg.steps}"] if cfg.steps else []
        args = (cfg.config, f"run_name={run}", f"data.max_samples={samples}", *cfg.train_overrides, *steps)
        training = Stage(f"train {run}", "train", args, clear=(run_dir,), training_run=run_dir)
        evaluations = tuple(
            Stage(
                f"eval {run} ({set_name(data)})",
                "train.eval",
                (run_dir, "--data", data, "--out", eval_out(run_dir, data), *cfg.eval_overrides),
                records=(eval_out(run_dir, data),),
                clear=(eval_out(run_dir, data),),
                needs=(training.name,),
            )
            for data in cfg.heldout
        )
        sizes.append(Size(fraction, samples, run_dir, training, evaluations))
    return sizes


def evaluated(path: str) -> dict:
    with open(path) as f:
        overall = (json.load(f).get("checkpoints") or [{}])[0].get("overall", {})
    return {k: overall.get(k) for k in ("tau", "ddtree_tau_64", "n_blocks")}


def ladder(cfg: DataLadderConfig, train: TrainConfig) -> list[dict]:
    """Train and evaluate each share (each a run of the step runner); the rows of the table (also
    written to `out` after each size)."""
    sizes = plan(cfg, train.out_dir, dataset_samples(cfg.config, cfg.train_overrides))
    check_steps([[size.training, *size.evaluations] for size in sizes])
    runner = Runner(Ledger(os.path.join(train.out_dir, f"{cfg.prefix}-stages.json")), label="data_ladder")
    rows = []
    for size in sizes:
        runner.run([[size.training], list(size.evaluations)])
        row = {"fraction": size.fraction, "samples_asked": size.samples, "run": size.run_dir}
        row.update(run_summary(size.run_dir))
        rows.append(row | {set_name(data): evaluated(eval_out(size.run_dir, data)) for data in cfg.heldout})
        if cfg.out:  # each finished size is kept, also when a later one is cut short
            write_table(cfg.out, cfg, rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__ + "\nkeys:\n" + describe(DataLadderConfig))
        return 0
    try:
        cfg, train = config_from_argv(argv)
        rows = ladder(cfg, train)  # every step's command line is checked before the first runs
    except (ValueError, OSError) as err:
        print(f"data_ladder: {err}", file=sys.stderr)
        return 2
    print_table(rows, cfg.heldout)
    return 0


def print_table(rows: list[dict], heldout: list[str]) -> None:
    names = [set_name(d) for d in heldout]
    header = f"\n{'share':>6} {'samples':>8} {'steps':>6} {'epochs':>7} {'tokens seen':>12} "
    print(header + " ".join(f"{'tau ' + n:>22}" for n in names))
    for row in rows:
        taus = " ".join(f"{num((row[n] or {}).get('tau')):>22}" for n in names)
        print(
            f"{row['fraction']:>6g} {row['samples']:>8} {num(row.get('total_steps'), 'd'):>6} "
            f"{num(row.get('epochs'), '.2f'):>7} {num(row.get('tokens_seen'), ',d'):>12} {taus}"
        )


def write_table(path: str, cfg: DataLadderConfig, rows: list[dict]) -> None:
    table = {"config": cfg.config, "ladder": dataclasses.asdict(cfg), "overrides": cfg.train_overrides, "rows": rows}
    atomic_write_text(path, json.dumps(table, indent=2))


if __name__ == "__main__":
    raise SystemExit(run_main("data_ladder", main, spawns=True))
