"""The config loader: TOML + key=value overrides, validated with errors that name the key."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import pytest

from common.config import ConfigError, config_from_dict, config_to_dict, knob, load_config, parse_cli, save_config


@dataclass
class Inner:
    gamma: float = knob(7.0, help="decay", min=0.1)
    names: list[str] = knob(factory=list, help="names")


@dataclass
class Stage:
    lr: float = knob(6e-4, help="learning rate", min=0.0, max=1.0)
    layers: list[int] = knob(factory=lambda: [1, 16, 31, 46], help="tap ids", min=0)
    policy: Literal["truncate", "drop"] = knob("truncate", help="length policy")
    on_error: str = knob("skip", help="what to do", choices=["skip", "fail"])
    mask_id: int | None = knob(None, help="mask token id")
    flag: bool = knob(False, help="a flag")
    inner: Inner = knob(factory=Inner, help="nested")
    kwargs: dict = knob(factory=dict, help="free table")

    def check(self):
        if self.flag and self.mask_id is None:
            raise ConfigError("config key 'mask_id': required when flag is true")


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_defaults_file_section_and_overrides(tmp_path):
    p = write(tmp_path, "[stage]\nlr = 1e-3\n[stage.inner]\ngamma = 5\n[other]\nx = 1\n")
    cfg = load_config(Stage, p, ['inner.names=["a","b"]', "mask_id=3", "kwargs.enable_thinking=false"], section="stage")
    assert cfg.lr == 1e-3 and cfg.inner.gamma == 5.0 and isinstance(cfg.inner.gamma, float)
    assert cfg.inner.names == ["a", "b"] and cfg.mask_id == 3
    assert cfg.kwargs == {"enable_thinking": False}
    assert cfg.layers == [1, 16, 31, 46]


@pytest.mark.parametrize(
    "override, needle",
    [
        ("lrr=1", "unknown config key 'lrr'"),
        ("inner.gama=1", "unknown config key 'inner.gama'"),
        ("lr=abc", "'lr': expected a number"),
        ("lr=2", "'lr': 2.0 is above the maximum 1.0"),
        ("layers=[1,-2]", "'layers': -2 is below the minimum 0"),
        ("policy=cut", "'policy': 'cut' is not allowed; choose one of 'truncate', 'drop'"),
        ("on_error=ignore", "'on_error': 'ignore' is not allowed; choose one of 'skip', 'fail'"),
        ("flag=yes", "'flag': expected true or false"),
        ("flag=true", "'mask_id': required when flag is true"),
        ("layers=3", "'layers': expected a list"),
        ("inner.gamma=0", "'inner.gamma': 0.0 is below the minimum 0.1"),
    ],
)
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(Stage, None, [override])
    assert needle in str(err.value)


def test_optional_none_and_strings():
    cfg = load_config(Stage, None, ["mask_id=none", "on_error=fail"])
    assert cfg.mask_id is None and cfg.on_error == "fail"


def test_round_trip_through_saved_json(tmp_path):
    cfg = load_config(Stage, None, ["lr=0.5", 'inner.names=["x"]'])
    save_config(cfg, tmp_path / "config.json")
    again = load_config(Stage, tmp_path / "config.json")
    assert again == cfg
    assert config_from_dict(Stage, config_to_dict(cfg)) == cfg


def test_cli_parsing(tmp_path):
    p = write(tmp_path, "lr = 0.25\n")
    assert parse_cli(Stage, [str(p), "flag=false"]).lr == 0.25
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_cli(Stage, [str(p), "stray"])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_cli(Stage, [str(tmp_path / "missing.toml")])


def test_invalid_toml_is_reported(tmp_path):
    p = write(tmp_path, "lr = = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(Stage, p)


@dataclass
class Named:
    run_name: str | None = knob(None, help="a name")
    out_dir: str = knob("runs", help="a path")
    seed: int = knob(0, help="a number")
    paths: dict[str, str] = knob(factory=dict, help="named paths")
    tags: list[str] = knob(factory=list, help="tags")


@pytest.mark.parametrize(
    "text", ["2024-06-01", "1e3", "true", "07:30:00", "[1, 2]", "{a = 1}", "inf", "x=y", "été 😀", "a b"]
)
def test_a_string_key_takes_the_command_line_text_as_given(text):
    """`run_name=2024-06-01` used to fail with "expected str, got datetime.date"."""
    cfg = load_config(Named, None, [f"run_name={text}", f"out_dir={text}", f"paths.train={text}"])
    assert cfg.run_name == cfg.out_dir == cfg.paths["train"] == text


def test_quoted_strings_none_and_other_types_on_the_command_line():
    cfg = load_config(Named, None, ['run_name="2024 06"', "out_dir='x'", "seed=5", 'tags=["a", "b"]'])
    assert (cfg.run_name, cfg.out_dir, cfg.seed, cfg.tags) == ("2024 06", "x", 5, ["a", "b"])
    assert load_config(Named, None, ["run_name=none"]).run_name is None  # an optional string: none is none
    assert load_config(Named, None, ["out_dir=none"]).out_dir == "none"  # a plain string: the text
    with pytest.raises(ConfigError, match="'seed': expected an integer, got 1000.0"):
        load_config(Named, None, ["seed=1e3"])


def test_values_from_a_cli_option_are_taken_exactly(tmp_path):
    cfg = load_config(Named, None, ["out_dir=a"], values={"out_dir": '"quoted" \U0001f600', "paths.x": "none"})
    assert cfg.out_dir == '"quoted" \U0001f600' and cfg.paths == {"x": "none"}


def test_a_date_in_a_config_file_says_to_quote_it(tmp_path):
    p = write(tmp_path, "run_name = 2024-06-01\n")
    with pytest.raises(
        ConfigError,
        match=r"'run_name': expected str or none, got datetime.date\(2024, 6, 1\) \(TOML read a date or time: quote it",
    ):
        load_config(Named, p)


def test_a_config_file_whose_name_holds_an_equals_sign(tmp_path):
    p = tmp_path / "lr=high.toml"
    p.write_text("lr = 0.5\n")
    assert parse_cli(Stage, [str(p), "flag=false"]).lr == 0.5


def test_run_name_message_says_what_is_accepted():
    from train.config import TrainConfig

    with pytest.raises(ConfigError, match="ASCII letters") as err:
        load_config(TrainConfig, None, ["run_name=été"])
    assert "'run_name'" in str(err.value)
    assert load_config(TrainConfig, None, ["run_name=2024-06-01"]).run_name == "2024-06-01"


def test_describe_lists_every_keys_allowed_values():
    from common.config import describe

    text = describe(Stage)
    assert "policy = 'truncate'  ('truncate' | 'drop')" in text
    assert "on_error = 'skip'  (str)  one of ['skip', 'fail']" in text
    assert "mask_id = None  (int | none)" in text
    assert "lr = 0.0006  (float)  range [0.0, 1.0]" in text and "inner.gamma = 7.0  (float)  >= 0.1" in text
    assert "Literal" not in text


def test_every_stage_config_is_frozen_after_validation():
    """Nothing changes a config once it is validated (a changed copy is `dataclasses.replace`)."""
    import dataclasses

    from extract.config import ExtractConfig
    from extract.regenerate.config import RegenerateConfig
    from recipes.compare_tiers import CompareTiersConfig
    from recipes.demo import DemoConfig
    from recipes.tiny.config import TinyConfig
    from shards.transcode import TranscodeConfig
    from train.config import TrainConfig
    from train.eval.config import EvalConfig
    from train.report.config import ReportConfig

    classes = [ExtractConfig, RegenerateConfig, TinyConfig, TranscodeConfig, CompareTiersConfig, TrainConfig]
    classes += [DemoConfig, EvalConfig, ReportConfig]
    import typing

    while classes:
        cls = classes.pop()
        assert cls.__dataclass_params__.frozen, cls.__name__
        classes += [hint for hint in typing.get_type_hints(cls).values() if dataclasses.is_dataclass(hint)]
    cfg = load_config(TrainConfig, None, ["model.block_size=16"])
    assert cfg.loss.gamma == 7.0  # resolved while validating
    for obj, name in ((cfg, "run_name"), (cfg.loss, "gamma"), (cfg.data, "seed")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, None)


def test_one_dtype_vocabulary_each_key_stores_its_own_spelling():
    """`bf16` and `bfloat16` (fp16/float16, fp32/float32) name the same type for every key that takes
    one; the value is stored in the key's own spelling, so saved configs and manifests keep their bytes."""
    from train.config import TrainConfig
    from train.serve.cli import parse_export_args

    @dataclass
    class Loading:
        dtype: Literal["bfloat16", "float16", "float32"] = knob("bfloat16", help="weights")

    assert load_config(TrainConfig, None, ["precision=bfloat16"]).precision == "bf16"
    assert load_config(TrainConfig, None, ["precision=float32"]).precision == "fp32"
    assert load_config(Loading, None, ["dtype=bf16"]).dtype == "bfloat16"
    assert load_config(Loading, None, ["dtype=fp16"]).dtype == "float16"
    with pytest.raises(ConfigError, match=r"config key 'precision'.*'fp16' is not allowed"):
        load_config(TrainConfig, None, ["precision=fp16"])  # a type the key does not take, in either spelling
    assert parse_export_args(["ckpt", "out", "--dtype", "bf16"]).dtype == "bfloat16"


@dataclass
class Command:
    source: str = knob("", help="a path")
    out: str | None = knob(None, help="where")
    count: int = knob(1, help="how many", min=0)
    fast: bool = knob(False, help="a flag")
    dtype: Literal["bfloat16", "float32"] = knob("float32", help="a type")
    inner: Inner = knob(factory=Inner, help="nested")


def test_one_command_grammar_positional_key_value_and_flags(tmp_path, capsys):
    from common.config import parse_command

    odd = tmp_path / "a=b c"  # a path with '=' and a space, given as a positional value
    odd.mkdir()
    cfg = parse_command(
        Command, [str(odd), "count=3", "--fast", "--dtype", "bf16", "--inner.gamma=2.5"], positional=["source"]
    )
    assert (cfg.source, cfg.count, cfg.fast, cfg.dtype, cfg.inner.gamma) == (str(odd), 3, True, "bfloat16", 2.5)
    cfg, left = parse_command(Command, ["x", "y", "z", "--out", " spaced "], positional=["source"], rest=True)
    assert (cfg.source, left, cfg.out) == ("x", ["y", "z"], " spaced ")  # a text value exactly as typed
    toml = write(tmp_path, "[cmd]\ncount = 7\n")
    assert parse_command(Command, [str(toml), "--fast=false"], section="cmd").count == 7
    assert parse_command(Command, ["--config", str(toml)], section="cmd").count == 7
    with pytest.raises(ConfigError, match="unknown option '--speed'"):
        parse_command(Command, ["--speed", "2"])
    with pytest.raises(ConfigError, match="config key 'count'"):
        parse_command(Command, ["--count", "-1"])
    with pytest.raises(ConfigError, match="expected key=value or --key value, got 'extra'"):
        parse_command(Command, ["a", "extra"], positional=["source"])
    with pytest.raises(SystemExit):
        parse_command(Command, ["--help"], usage="usage: cmd SOURCE")
    assert "usage: cmd SOURCE" in capsys.readouterr().out


def _stage_configs() -> list[type]:
    from extract.config import ExtractConfig
    from extract.regenerate.config import RegenerateConfig
    from recipes.compare_tiers import CompareTiersConfig
    from recipes.demo import DemoConfig
    from recipes.tiny.config import TinyConfig
    from shards.transcode import TranscodeConfig
    from train.config import TrainConfig
    from train.eval.config import EvalConfig
    from train.report.config import ReportConfig

    classes = [ExtractConfig, RegenerateConfig, TinyConfig, TranscodeConfig, CompareTiersConfig, TrainConfig]
    return classes + [DemoConfig, EvalConfig, ReportConfig]


def _container_keys(cls, prefix: str = "") -> list[tuple[str, object, object]]:
    """(dotted key, hint, default) of every key of `cls` (nested tables included) that takes a list or a table."""
    import dataclasses
    import types
    import typing

    found = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            found += _container_keys(hint, prefix + f.name + ".")
            continue
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if any((typing.get_origin(a) or a) in (list, tuple, dict) for a in args):
            found.append((prefix + f.name, hint, f.default))
    return found


def _toml(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)


def _outcome(load):
    try:
        return ("ok", config_to_dict(load()))
    except ConfigError as exc:
        return ("error", str(exc))


def test_lists_and_tables_on_the_command_line_parse_as_in_toml_for_every_key(tmp_path):
    """`model.layer_types=[...]` was read as a preset name on the command line but as a list in TOML."""
    import dataclasses

    tried = 0
    for cls in (c for c in _stage_configs() if dataclasses.is_dataclass(c)):
        for key, _hint, default in _container_keys(cls):
            values = [["full_attention", "sliding_attention"], [1, 2], {"a": 1, "b": "x"}]
            if isinstance(default, (list, dict)) and default:
                values.insert(0, default)
            for value in values:
                toml_path = tmp_path / "c.toml"
                *tables, leaf = key.split(".")
                toml_path.write_text((f"[{'.'.join(tables)}]\n" if tables else "") + f"{leaf} = {_toml(value)}\n")
                from_file = _outcome(lambda cls=cls, toml_path=toml_path: load_config(cls, toml_path))
                from_cli = _outcome(
                    lambda cls=cls, key=key, value=value: load_config(cls, None, [f"{key}={_toml(value)}"])
                )
                assert from_cli == from_file, (cls.__name__, key, value)
                tried += 1
    assert tried >= 20


def test_a_layer_types_list_on_the_command_line_is_a_list():
    from train.config import TrainConfig

    words = [
        "model.num_layers=2",
        "model.sliding_window=8",
        'model.layer_types=["sliding_attention", "full_attention"]',
    ]
    cfg = load_config(TrainConfig, None, words)
    assert cfg.model.layer_types == ["sliding_attention", "full_attention"]
    assert load_config(TrainConfig, None, ["model.layer_types=full"]).model.layer_types == "full"  # a preset name
