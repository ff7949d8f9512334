"""`check_steps(groups)`: every planned step's command line read by its stage's own parser before any
step runs, so a bad `key=value` of any step (a recipe's overrides, a stage table) stops the recipe
in one line naming the step and the key, not minutes later when that step starts."""

from __future__ import annotations

from common.config import ConfigError, parse_cli
from extract.config import ExtractConfig
from extract.regenerate.config import RegenerateConfig
from recipes.runner import Stage
from shards.__main__ import parse_args as parse_shards_args
from train.config import TrainConfig
from train.eval.__main__ import parse_args as parse_eval_args
from train.report.config import parse_report_args
from train.serve.cli import parse_export_args, parse_specdecode_args

PARSERS = {
    "extract.regenerate": lambda args: parse_cli(RegenerateConfig, args, section="regenerate"),
    "extract": lambda args: parse_cli(ExtractConfig, args, section="extract"),
    "shards": parse_shards_args,
    "train": lambda args: parse_cli(TrainConfig, args, section="train"),
    "train.eval": parse_eval_args,
    "train.serve.export": parse_export_args,
    "train.serve.specdecode": parse_specdecode_args,
    "train.report": parse_report_args,
}


def check_steps(groups: list[list[Stage]]) -> dict:
    """Every step's command line through its stage's own parser, before anything runs: a bad
    STAGE.key=value fails here, naming the step and the key (ValueError). Returns {module: its parsed
    config} (the last step's where several run one module), for checks across steps."""
    parsed = {}
    for stage in (s for group in groups for s in group):
        try:
            parsed[stage.module] = PARSERS[stage.module](list(stage.args))
        except (ConfigError, ValueError) as exc:
            raise ValueError(f"step '{stage.name}': {exc}") from None
    return parsed
