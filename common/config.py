"""Stage configs: one dataclass per stage, loaded from a TOML (or resolved JSON) file plus
`key=value` overrides (nested keys with dots), validated before any work starts.

Every field is declared with `knob(...)`, which carries its help text and its allowed range or
choices. A bad value raises `ConfigError` (a `ValueError`) whose message names the key and what
is allowed. A file may hold one table per stage (`[extract]`, `[train]`, ...); a stage reads its
own table, so one file can describe a whole experiment.

    cfg = parse_cli(TrainConfig, ["configs/tiny.toml", "loss.gamma=5", "run_name=abl"], section="train")
    save_config(cfg, run_dir / "config.json")

Every entry point reads its command line with `parse_command` (the one grammar, `[CONFIG] [VALUE
...] key=value | --key value | --flag`; `python -m shards` adds a command word first) and answers
`--help` with `describe`: every key's type, allowed values or range, default and help, before torch
loads. How an override's text is read depends on the key's type (`CommandLineValue`).

A stage config is a frozen dataclass. Cross-field checks go in its `check(self)` method, which
raises through `fail(key, msg)` and may store resolved values with `set_resolved`; after that
nothing changes it (`dataclasses.replace` makes a changed copy). A key that takes a floating-point
type accepts both spellings (`bf16` / `bfloat16`, ...; `DTYPE_SYNONYMS`) and stores its own, so
saved configs and manifests keep their bytes.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import hashlib
import json
import os
import tomllib
import types
import typing
from dataclasses import MISSING, field
from pathlib import Path
from typing import Any, Literal

from common import locations, objstore
from common.io import atomic_write_text

__all__ = [
    "ConfigError",
    "knob",
    "load_config",
    "parse_cli",
    "config_from_dict",
    "config_to_dict",
    "flatten_dotted",
    "save_config",
    "config_digest",
    "describe",
    "fail",
    "check_paths",
]


# One vocabulary for floating-point types across the stages. Each key keeps its stage's stored
# spelling (`precision = 'bf16'` in train, eval and the tiny build; `dtype = 'bfloat16'` in extract
# and regeneration, whose value travels into shard manifests, which must not change), and accepts
# the other spelling of the same type.
DTYPE_SYNONYMS = {
    "bf16": "bfloat16",
    "bfloat16": "bf16",
    "fp16": "float16",
    "float16": "fp16",
    "fp32": "float32",
    "float32": "fp32",
}


# transformers' attention implementations a stage that loads the target takes (`attn_implementation`):
# some targets have no sdpa one (Gemma2, gpt-oss: eager). "auto" leaves the choice to transformers
# (sdpa where the model supports it, else eager; `target.load.load_target`).
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention", "auto")


def literal_member(value: Any, allowed: typing.Sequence[Any]) -> Any:
    """`value` if allowed, else its other dtype spelling if that is allowed, else None."""
    if value in allowed:
        return value
    other = DTYPE_SYNONYMS.get(value) if isinstance(value, str) else None
    return other if other in allowed else None


def dtype_spelling(text: str) -> str:
    """A command-line dtype in the long spelling (`bf16` -> `bfloat16`); other text as given."""
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(text, text)


class ConfigError(ValueError):
    """A user error in a config file or override; the message names the key."""


def knob(
    default: Any = MISSING,
    *,
    help: str,
    min: float | None = None,
    max: float | None = None,
    choices: typing.Sequence[Any] | None = None,
    factory: typing.Callable[[], Any] | None = None,
    path: str | None = None,
) -> Any:
    """Declare a config field with its help text and allowed values (checked by `load_config`);
    `path` makes it a path setting of that kind (`common.locations`: parsed at load, checked when a
    command line is read)."""
    metadata = {"help": help, "min": min, "max": max, "choices": tuple(choices) if choices else None, "path": path}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    if default is MISSING:
        return field(metadata=metadata)
    return field(default=default, metadata=metadata)


def set_resolved(cfg: Any, name: str, value: Any) -> None:
    """Inside a config's `check`: store the value a field resolves to (a default that depends on
    other keys, a canonical spelling). Configs are frozen dataclasses: after `check` nothing changes
    them (`dataclasses.replace` makes a changed copy)."""
    object.__setattr__(cfg, name, value)


def fail(key: str, message: str) -> typing.NoReturn:
    """Raise a ConfigError for `key` (used by the stages' cross-field `check` methods)."""
    raise ConfigError(f"config key '{key}': {message}")


# ----------------------------------------------------------------------------------------------
# Loading


def parse_cli(cls: type, argv: typing.Sequence[str], *, section: str | None = None) -> Any:
    """Build `cls` from `[CONFIG_FILE] key=value | --key value ...` as given on a command line (the
    grammar of `parse_command`, without positional values; the first word is the config file
    unless it is a setting)."""
    argv = list(argv)
    path = None
    if argv and not argv[0].startswith("-") and ("=" not in argv[0] or os.path.isfile(argv[0])):
        path = argv.pop(0)  # a config file may have '=' in its name
    return parse_command(cls, argv, section=section, config=path)


def _is_uri(word: str) -> bool:
    """`s3://bucket/p?endpoint_override=...`: a value (a URI's query holds '='), not key=value."""
    scheme, sep, _ = word.partition("://")
    return bool(sep) and "=" not in scheme and scheme.replace("+", "").isalnum()


def parse_command(
    cls: type,
    argv: typing.Sequence[str],
    *,
    section: str | None = None,
    positional: typing.Sequence[str] = (),
    rest: bool = False,
    usage: str = "",
    config: str | None = None,
) -> Any:
    """The command-line grammar every entry point shares:

        [CONFIG_FILE] [VALUE ...] [key=value ...] [--key VALUE | --key=VALUE | --flag ...]

    CONFIG_FILE is the first word when it names an existing .toml or .json file (or `--config
    FILE` where no key is named `config`, or `config` given by the caller); its `[section]` table
    is read. The VALUEs fill the `positional` keys in order; with `rest`, the words left over are
    returned too (`(cfg, words)`). `--some-key VALUE` is `some_key=VALUE`; a bool key given as
    `--key` alone is true. A VALUE of a text key is taken exactly as typed (a path may hold '=' or
    spaces). `-h` / `--help` prints `usage` and every key with its allowed values (`describe`) and
    exits. A command read here starts with the outage clocks of its stores at rest (`common.objstore`:
    the same command run again in one process, as tests do, is a new command)."""
    argv = list(argv)
    objstore.reset_outage_clocks()
    if any(word in ("-h", "--help") for word in argv):
        print((usage.rstrip() + "\n\nkeys:\n" if usage else "") + describe(cls))
        raise SystemExit(0)
    path = argv.pop(0) if config is None and argv and _is_config_file(argv[0]) else config
    config_is_a_key = "config" in {f.name for f in dataclasses.fields(cls)}
    words: list[str] = []
    overrides: list[str] = []
    values: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        word = argv[i]
        if word.startswith("--") and len(word) > 2:
            name, eq, inline = word[2:].partition("=")
            key = name.replace("-", "_")
            file_option = key == "config" and not config_is_a_key
            hint = str if file_option else _hint_of(cls, key, word)
            if hint is bool and not eq:
                overrides.append(f"{key}=true")
            else:
                if not eq and i + 1 >= len(argv):
                    raise ConfigError(f"option '{word}' needs a value")
                value = inline if eq else argv[i + 1]
                i += 0 if eq else 1
                if file_option:
                    path = value
                else:
                    _put_word(key, value, hint, overrides, values)
        elif "=" in word and not os.path.exists(word) and not _is_uri(word):  # a path or URI may hold '='
            overrides.append(word)
        else:
            words.append(word)
        i += 1
    # strict=False: fewer words than positional keys leave those keys unset; more are checked below
    for key, word in zip(positional, words, strict=False):
        _put_word(key, word, _hint_of(cls, key, key), overrides, values)
    left = words[len(positional) :]
    if left and not rest:
        raise ConfigError(
            f"expected key=value or --key value, got '{left[0]}'"
            + ("" if positional else " (only the first argument may be a config file)")
        )
    cfg = load_config(cls, path, overrides, section=section, values=values)
    check_paths(cfg)
    return (cfg, left) if rest else cfg


def _is_config_file(word: str) -> bool:
    return word.endswith((".toml", ".json")) and os.path.isfile(word)


def _hint_of(cls: type, dotted: str, spelled: str) -> Any:
    """The type of a (dotted) key of `cls`; ConfigError naming the option if there is none."""
    hint: Any = cls
    for part in dotted.split("."):
        fields = {f.name for f in dataclasses.fields(hint)} if dataclasses.is_dataclass(hint) else set()
        if part not in fields:
            known = sorted(f.name for f in dataclasses.fields(cls))
            raise ConfigError(f"unknown option '{spelled}'; keys: {', '.join(known)}")
        hint = typing.get_type_hints(hint)[part]
    return hint


def _put_word(key: str, word: str, hint: Any, overrides: list[str], values: dict[str, Any]) -> None:
    """A text key takes the word exactly as typed; any other key reads it as a key=value would."""
    args = typing.get_args(hint)
    text = _takes_text(hint) or (
        typing.get_origin(hint) in (typing.Union, types.UnionType) and any(_takes_text(a) for a in args)
    )
    if text and word.lower() not in ("none", "null"):
        values[key] = word
    else:
        overrides.append(f"{key}={word}")


def load_config(
    cls: type,
    path: str | os.PathLike | None,
    overrides: typing.Sequence[str] = (),
    *,
    section: str | None = None,
    values: typing.Mapping[str, Any] | None = None,
) -> Any:
    """Read `path` (TOML or JSON; its `[section]` table if it has one), apply the `key=value`
    overrides, then `values` ({dotted key: value}, taken exactly as given: what a CLI's own
    options such as `--data DIR` set), and validate."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_file(Path(path))
        if section is not None and isinstance(data.get(section), dict):
            data = data[section]
    data = copy.deepcopy(data)
    for word in overrides:
        key, _, raw = word.partition("=")
        key = key.strip()
        if not key:
            raise ConfigError(f"override '{word}' has no key")
        _set_dotted(data, key, CommandLineValue(raw.strip()))
    for key, value in (values or {}).items():
        _set_dotted(data, key, value)
    return config_from_dict(cls, data)


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"config file '{path}' is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a table at the top level")
    return data


class CommandLineValue:
    """The text of a `key=value` override. The key's type decides how it is read: a string key
    takes the text as given (`run_name=2024-06-01`, `1e3`, `true` are names, not a date, a number
    and a boolean), with surrounding quotes removed when the whole text is one TOML string; other
    keys read it as a TOML value (`5`, `[1, 2]`, `true`, `{a = 1}`), and `none` / `null` is none. A
    key that takes a name or a list (or table) reads a TOML array or inline table as TOML does
    (`model.layer_types=["sliding_attention", "full_attention"]`), so a list means the same on the
    command line as in a config file for every key."""

    def __init__(self, text: str):
        self.text = text

    def as_text(self) -> str:
        if self.text[:1] in ('"', "'"):
            parsed = self.as_toml()
            if isinstance(parsed, str):
                return parsed
        return self.text

    def as_toml(self) -> Any:
        """`5` -> 5, `[1,2]` -> [1, 2], `true` -> True, `"a b"` -> 'a b', `abc` -> 'abc', `none` -> None."""
        if self.text.lower() in ("none", "null"):
            return None
        try:
            return tomllib.loads(f"v = {self.text}")["v"]
        except tomllib.TOMLDecodeError:
            return self.text

    def __repr__(self) -> str:
        return repr(self.text)


def _takes_text(hint: Any) -> bool:
    """A string key, or a choice among strings: its command-line value is the text itself."""
    if hint is str:
        return True
    args = typing.get_args(hint)
    return typing.get_origin(hint) is Literal and all(isinstance(a, str) for a in args)


def _spells_container(value: CommandLineValue, args: tuple) -> bool:
    """The text is a TOML array or inline table and the key takes more than text (a list, say):
    it is then read as TOML reads it, and refused the same way if the key takes no such value."""
    if all(_takes_text(a) or a is type(None) for a in args):
        return False
    return value.text.lstrip()[:1] in ("[", "{") and isinstance(value.as_toml(), (list, dict))


def _plain(value: Any, hint: Any = Any) -> Any:
    """Command-line values inside `value` read for `hint` (a table's or list's items: their own hint)."""
    if isinstance(value, CommandLineValue):
        if _takes_text(hint):
            return value.as_text()
        return value.as_toml()
    if isinstance(value, dict):
        args = typing.get_args(hint)
        item_hint = args[1] if typing.get_origin(hint) is dict and len(args) == 2 else Any
        return {k: _plain(v, item_hint) for k, v in value.items()}
    return value


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{key}': '{part}' is a value, not a table")
        node = child
    node[parts[-1]] = value


# ----------------------------------------------------------------------------------------------
# Validation


def config_from_dict(cls: type, data: dict[str, Any], *, prefix: str = "") -> Any:
    """Validate a plain dict against dataclass `cls` (recursively) and build it."""
    assert dataclasses.is_dataclass(cls), cls
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.') or '<root>'}': expected a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown config key '{prefix}{unknown[0]}'; allowed keys here: {', '.join(sorted(known))}")
    kwargs = {}
    for name, f in known.items():
        key = prefix + name
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ConfigError(f"config key '{key}' is required ({f.metadata.get('help', '')})")
            continue
        kwargs[name] = _check_value(key, data[name], hints[name], f.metadata)
    cfg = cls(**kwargs)
    check = getattr(cfg, "check", None)
    if callable(check):
        check()
    return cfg


def _check_value(key: str, value: Any, hint: Any, meta: typing.Mapping[str, Any]) -> Any:
    value = _coerce(key, value, hint)
    if meta.get("path"):
        for where, text in _path_values(key, value):
            problem = locations.parse_problem(text, meta["path"])
            if problem:
                fail(where, problem)
    choices = meta.get("choices")
    if choices is not None and value is not None:
        items = value if isinstance(value, list) else [value]
        for item in items:
            if item not in choices:
                fail(key, f"{item!r} is not allowed; choose one of {', '.join(map(repr, choices))}")
    lo, hi = meta.get("min"), meta.get("max")
    if value is not None and (lo is not None or hi is not None):
        items = value if isinstance(value, list) else [value]
        for item in items:
            if lo is not None and item < lo:
                fail(
                    key, f"{item!r} is below the minimum {lo}" + (f" (allowed: {lo} to {hi})" if hi is not None else "")
                )
            if hi is not None and item > hi:
                fail(
                    key, f"{item!r} is above the maximum {hi}" + (f" (allowed: {lo} to {hi})" if lo is not None else "")
                )
    return value


def _path_values(key: str, value: Any) -> list[tuple[str, str]]:
    """(key, text) of each non-empty path in a path setting's value (a text, or a table of them)."""
    items = value.items() if isinstance(value, dict) else [(None, value)]
    return [(key if name is None else f"{key}.{name}", text) for name, text in items if isinstance(text, str) and text]


def check_paths(cfg: Any, prefix: str = "") -> None:
    """ConfigError naming the key for the first path setting of `cfg` that cannot be used as its
    kind says (`common.locations.check_problem`: a store reached, a local output writable)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            check_paths(value, f"{prefix}{f.name}.")
            continue
        kind = f.metadata.get("path")
        if not kind:
            continue
        for where, text in _path_values(prefix + f.name, value):
            problem = locations.check_problem(text, kind)
            if problem:
                fail(where, problem)


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(map(repr, typing.get_args(hint)))
    if origin in (typing.Union, types.UnionType):
        return " | ".join("none" if a is type(None) else _type_name(a) for a in typing.get_args(hint))
    if origin is not None:  # list[int] and the like
        return str(hint).replace("typing.", "")
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _quote_hint(value: Any) -> str:
    """TOML reads an unquoted 2024-06-01 in a config file as a date: say how to make it text."""
    return (
        " (TOML read a date or time: quote it in the config file)"
        if isinstance(value, (datetime.date, datetime.time))
        else ""
    )


def _coerce(key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if isinstance(value, CommandLineValue):
            if type(None) in args and value.text.lower() in ("none", "null"):
                return None
            text_type = next((a for a in args if _takes_text(a)), None)
            if text_type is not None and _spells_container(value, args):
                text_type = None  # `key=[a, b]` for a key taking a name or a list: the list, as in TOML
            value = _plain(value, text_type if text_type is not None else Any)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        for arg in non_none:
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                continue  # the message below names every type the key takes
        fail(
            key,
            f"expected {' or '.join(_type_name(a) for a in non_none)}"
            + (" or none" if type(None) in args else "")
            + f", got {value!r}{_quote_hint(value)}",
        )
    if isinstance(value, CommandLineValue) and not dataclasses.is_dataclass(hint):
        value = _plain(value, hint)
    if value is None:
        fail(key, f"expected {_type_name(hint)}, got none")
    if origin is Literal:
        member = literal_member(value, args)
        if member is None:
            fail(key, f"{value!r} is not allowed; choose one of {', '.join(map(repr, args))}")
        return member
    if dataclasses.is_dataclass(hint):
        return config_from_dict(typing.cast(type, hint), value, prefix=key + ".")
    if origin in (list, tuple, typing.Sequence) or hint in (list, tuple):
        if not isinstance(value, list):
            fail(key, f"expected a list, got {value!r}")
        item_hint = args[0] if args else Any
        return [_coerce(f"{key}[{i}]", v, item_hint) for i, v in enumerate(value)]
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            fail(key, f"expected a table, got {value!r}")
        value = _plain(value, hint)
        if len(args) == 2:
            return {k: _coerce(f"{key}.{k}", v, args[1]) for k, v in value.items()}
        return dict(value)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            fail(key, f"expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(key, f"expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(key, f"expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            fail(key, f"expected a string, got {value!r}{_quote_hint(value)}")
        return value
    raise AssertionError(f"unsupported config type {hint!r} for {key}")


# ----------------------------------------------------------------------------------------------
# Saving and describing


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain JSON-able data."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def flatten_dotted(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"loss": {"gamma": 7}} -> {"loss.gamma": 7} (the keys of `key=value` overrides); lists and
    empty tables stay values; anything but a dict gives {} (or {prefix: data} under a prefix)."""
    if not isinstance(data, dict):
        return {prefix.rstrip("."): data} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flatten_dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    """Write the resolved config as JSON (loadable again with `load_config`), atomically."""
    atomic_write_text(str(path), json.dumps(config_to_dict(cfg), indent=2, sort_keys=True) + "\n")


def config_digest(cfg_or_dict: Any) -> str:
    """A short stable hash of a config (or of a plain dict), for provenance and resume checks."""
    data = cfg_or_dict if isinstance(cfg_or_dict, dict) else config_to_dict(cfg_or_dict)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def describe(cls: type, prefix: str = "") -> str:
    """One line per key: name, type, default, allowed values and help."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            lines.append(describe(typing.cast(type, hint), prefix + f.name + "."))
            continue
        default = (
            f.default
            if f.default is not MISSING
            else (f.default_factory() if f.default_factory is not MISSING else "<required>")
        )
        allowed = ""
        if f.metadata.get("choices"):
            allowed = f"  one of {list(f.metadata['choices'])}"
        elif f.metadata.get("min") is not None or f.metadata.get("max") is not None:
            lo, hi = f.metadata.get("min"), f.metadata.get("max")
            allowed = (
                f"  range [{lo}, {hi}]"
                if lo is not None and hi is not None
                else f"  >= {lo}"
                if hi is None
                else f"  <= {hi}"
            )
        synonyms = [DTYPE_SYNONYMS[a] for a in typing.get_args(hint) if isinstance(a, str) and a in DTYPE_SYNONYMS]
        if synonyms:
            allowed += f"  (also {', '.join(map(repr, synonyms))}: the same types)"
        lines.append(f"{prefix}{f.name} = {default!r}  ({_type_name(hint)}){allowed}\n    {f.metadata.get('help', '')}")
    return "\n".join(lines)
