"""The steps of one drafter command, each a stage's own command line (`plan_stages(job)`): for a
target and its prompt sets, where every stage writes, and each stage's settings.

    [prepare]           a built-in target's builder (the demos: recipes.tiny, recipes.smollm2)
    regeneration (S)    python -m extract.regenerate, per prompt set S (unless the prompts are answered)
    extraction          python -m extract, every set in one run (splits)
    drafter training    python -m train
    offline evaluation  python -m train.eval, per held-out set (the one decoded online first)
    export              python -m train.serve.export          (side by side with the evaluations on a GPU)
    speculative decoding python -m train.serve.specdecode on the online set's prompts
    report              python -m train.report

A stage's settings come in three layers, the later winning: `Job.defaults` (derived from the target
and the scale), the stage's table in the config file, `Job.overrides` (the user's `STAGE.key=value`);
the paths that tie the stages together sit between the table and the overrides. A default whose key
the config table sets is left out, so a config file's choice stands.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib

from common.config import flatten_dotted
from common.hashing import json_digest
from recipes.runner import Stage

TABLE_STAGES = ("regenerate", "extract", "train", "eval")  # the stages that read a config file's table
TEMPLATE_STAGES = ("regenerate", "extract", "specdecode")  # the stages that render chats with the target's template
EXPORT_FILES = ("config.json", "model.safetensors", "dflash_export.json")  # an export's records


@dataclasses.dataclass(frozen=True)
class Heldout:
    """A held-out prompt set: `name` is its split (shards/NAME, eval_NAME.json), `label` what the
    decoding step calls it."""

    name: str
    prompts: str
    label: str = ""


@dataclasses.dataclass(frozen=True)
class Job:
    target: str
    train_prompts: str
    heldout: tuple[Heldout, ...]
    online: str  # the held-out set decoded online
    shards_dir: str
    runs_dir: str
    run_name: str
    export_dir: str
    regen_dir: str = ""  # empty: the prompts' assistant turns are the target's own answers already
    config: str = ""  # a file whose stage tables are the stages' base settings
    server: str = ""  # regenerate through this OpenAI-compatible endpoint
    defaults: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    overrides: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    prepare: Stage | None = None
    target_digest: str = ""  # `target.identity.directory_digest`: every step that reads the target is keyed by it
    chat_template: str = ""  # a chat template file the target's steps read

    @property
    def run_dir(self) -> str:
        return os.path.join(self.runs_dir, self.run_name)

    @property
    def sets(self) -> dict[str, str]:
        """{split: prompt file}: the training prompts and every held-out set, in order."""
        return {"train": self.train_prompts, **{h.name: h.prompts for h in self.heldout}}

    def corpus(self, split: str) -> str:
        """What extraction reads for a split: the regenerated corpus, or the answered prompts."""
        return os.path.join(self.regen_dir, split) if self.regen_dir else self.sets[split]

    def eval_out(self, split: str) -> str:
        return os.path.join(self.run_dir, f"eval_{split}.json")

    @property
    def spec_out(self) -> str:
        suffix = "" if len(self.heldout) == 1 else f"_{self.online}"
        return os.path.join(self.run_dir, f"specdecode{suffix}.json")


def config_keys(config: str, stage: str) -> set[str] | None:
    """The dotted keys the config file's table for `stage` sets; None when it has no such table."""
    if not config or stage not in TABLE_STAGES:
        return None
    with open(config, "rb") as f:
        table = tomllib.load(f).get(stage)
    return set(flatten_dotted(table)) if isinstance(table, dict) else None


def setting_key(word: str) -> str:
    return word.partition("=")[0].strip()


def table_digest(config: str, stage: str) -> str | None:
    """A digest of the config file's table for `stage` (None: no file or no such table)."""
    if not config or stage not in TABLE_STAGES:
        return None
    with open(config, "rb") as f:
        table = tomllib.load(f).get(stage)
    return json_digest(table) if isinstance(table, dict) else None


def inputs_of(job: Job, stage: str, *, target: bool = True) -> dict:
    """A step's inputs besides its command line and the steps it needs: the target directory's content
    (`target`), its config table's, and the chat template file of the steps that run the target."""
    digests = []
    if target and job.target_digest:
        digests.append(("target directory", job.target_digest))
    table = table_digest(job.config, stage)
    if table:
        digests.append((f"config table [{stage}]", table))
    reads = (job.chat_template,) if job.chat_template and stage in TEMPLATE_STAGES else ()
    return {"digests": tuple(digests), "reads": reads}


def stage_args(job: Job, stage: str, positional: list[str], paths: list[str]) -> tuple[str, ...]:
    """[config file] POSITIONAL defaults-the-table-does-not-set PATHS overrides."""
    table = config_keys(job.config, stage)
    defaults = [w for w in job.defaults.get(stage, []) if table is None or setting_key(w) not in table]
    head = [job.config] if table is not None else []
    return tuple(head + positional + defaults + paths + job.overrides.get(stage, []))


def toml_table(mapping: dict[str, str]) -> str:
    """{a = "x", b = "y"}: a table on the command line, as a config file writes it."""
    return "{" + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in mapping.items()) + "}"


def regeneration_stages(job: Job) -> list[list[Stage]]:
    if not job.regen_dir:
        return []
    server = ["backend=server", f"urls={json.dumps([job.server])}"] if job.server else []
    return [
        [
            Stage(
                f"regeneration ({split})",
                "extract.regenerate",
                stage_args(
                    job,
                    "regenerate",
                    [],
                    [f"target={job.target}", f"corpus={prompts}", f"out={job.corpus(split)}", *server],
                ),
                records=(os.path.join(job.corpus(split), "regenerate.json"),),
                clear=(job.corpus(split),),
                reads=(prompts, *inputs_of(job, "regenerate")["reads"]),
                digests=inputs_of(job, "regenerate")["digests"],
            )
        ]
        for split, prompts in job.sets.items()
    ]


def extraction_stage(job: Job) -> Stage:
    splits = {split: job.corpus(split) for split in job.sets}
    paths = [f"target={job.target}", f"out_dir={job.shards_dir}", f"splits={toml_table(splits)}"]
    return Stage(
        "extraction",
        "extract",
        stage_args(job, "extract", [], paths),
        records=tuple(os.path.join(job.shards_dir, split, "manifest.json") for split in splits),
        clear=tuple(os.path.join(job.shards_dir, split) for split in splits),
        needs=tuple(f"regeneration ({split})" for split in splits) if job.regen_dir else (),
        reads=(() if job.regen_dir else tuple(splits.values())) + inputs_of(job, "extract")["reads"],
        digests=inputs_of(job, "extract")["digests"],
    )


def training_stage(job: Job) -> Stage:
    paths = [
        f"out_dir={job.runs_dir}",
        f"run_name={job.run_name}",
        f"data.shards={os.path.join(job.shards_dir, 'train')}",
        "data.holdout_fraction=0.0",  # held out: the held-out sets, in their own shards
    ]
    return Stage(
        "drafter training",
        "train",
        stage_args(job, "train", [], paths),
        clear=(job.run_dir,),
        needs=("extraction",),
        digests=inputs_of(job, "train")["digests"],
        training_run=job.run_dir,
    )


def evaluation_stages(job: Job) -> list[Stage]:
    """Per held-out set, the one decoded online first."""
    order = sorted(job.heldout, key=lambda h: h.name != job.online)
    return [
        Stage(
            "offline evaluation" + ("" if len(job.heldout) == 1 else f" ({h.name})"),
            "train.eval",
            stage_args(
                job,
                "eval",
                [job.run_dir],
                [f"data={os.path.join(job.shards_dir, h.name)}", f"out={job.eval_out(h.name)}"],
            ),
            records=(job.eval_out(h.name),),
            clear=(job.eval_out(h.name),),
            needs=("drafter training", "extraction"),
            digests=inputs_of(job, "eval")["digests"],
        )
        for h in order
    ]


def export_stage(job: Job) -> Stage:
    return Stage(
        "export",
        "train.serve.export",
        stage_args(job, "export", [job.run_dir, job.export_dir], []),
        records=tuple(os.path.join(job.export_dir, n) for n in EXPORT_FILES),
        clear=(job.export_dir,),
        needs=("drafter training",),
        digests=inputs_of(job, "export")["digests"],
    )


def decoding_stage(job: Job) -> Stage:
    online = next(h for h in job.heldout if h.name == job.online)
    label = "" if len(job.heldout) == 1 else f" ({online.label or online.name})"
    paths = [f"target={job.target}", f"drafter={job.export_dir}", f"prompts={online.prompts}", f"out={job.spec_out}"]
    return Stage(
        "speculative decoding" + label,
        "train.serve.specdecode",
        stage_args(job, "specdecode", [], paths),
        records=(job.spec_out,),
        clear=(job.spec_out,),
        needs=("export",),
        reads=(online.prompts, *inputs_of(job, "specdecode")["reads"]),
        digests=inputs_of(job, "specdecode")["digests"],
    )


def report_stage(job: Job) -> Stage:
    out = os.path.join(job.run_dir, "report.md")
    return Stage(
        "report",
        "train.report",
        stage_args(job, "report", [job.run_dir], []),
        records=(out,),
        clear=(out,),
        needs=("drafter training",),
        digests=inputs_of(job, "report", target=False)["digests"],
    )


def plan_stages(job: Job) -> list[list[Stage]]:
    """Every step in groups run in order; the steps of one group need only what earlier groups
    wrote (the evaluations and the export: side by side on a GPU)."""
    groups = [[job.prepare]] if job.prepare is not None else []
    groups += regeneration_stages(job)
    groups += [[extraction_stage(job)], [training_stage(job)]]
    groups += [[*evaluation_stages(job), export_stage(job)], [decoding_stage(job)], [report_stage(job)]]
    return groups
