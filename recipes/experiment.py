"""`experiment_config(cls, argv, section)`: a recipe's command line, `[CONFIG] key=value ...` (the
grammar of every entry point, `common.config.parse_command`). CONFIG is the experiment's config file:
its `[section]` table (if it has one) sets the recipe's keys, and the file itself is the recipe's
`config` key (the stages' tables the recipe's steps read) unless the table or a `config=` word names
another file."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from common.config import ConfigError, fail, parse_cli


def experiment_config(cls: type, argv: list[str], section: str) -> Any:
    """`cls` from the command line; ConfigError (one line naming the file or key) on bad input."""
    path = argv[0] if argv and "=" not in argv[0] and not argv[0].startswith("-") else None
    if path is not None and not Path(path).is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        table = tomllib.loads(Path(path).read_text(encoding="utf-8")).get(section) if path else None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file '{path}' is not valid TOML: {err}") from None
    # A config without a [section] table is only the experiment's config (the stages' tables).
    cfg = parse_cli(cls, argv if table is not None else argv[1:] if path else argv, section=section)
    if path and "config" not in (table or {}) and not any(word.startswith("config=") for word in argv[1:]):
        cfg = dataclasses.replace(cfg, config=path)
    if not Path(cfg.config).is_file():
        fail("config", f"the experiment's config file '{cfg.config}' does not exist")
    return cfg
