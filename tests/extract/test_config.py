"""ExtractConfig: defaults, validation that names the key, splits, layer ids against the model."""

from __future__ import annotations

import warnings

import pytest

from common.config import ConfigError, load_config
from extract.config import DATASET_KEYS, ExtractConfig, dataset_keys
from target.load import check_layer_ids, read_text_config

BASE = ["target=t", "corpus=c.jsonl", "out_dir=o"]


def make(*overrides):
    return load_config(ExtractConfig, None, [*BASE, *overrides])


def test_defaults():
    cfg = make()
    # auto, resolved from the target's config.json in the check; a target that is not there leaves it to the
    # pipeline, which refuses that target by name
    assert cfg.layer_ids == "auto" and cfg.topk == 32 and cfg.max_len == 3072
    assert cfg.length_policy == "truncate" and cfg.min_loss_tokens == 32 and cfg.on_error == "skip"
    assert cfg.dtype == "bfloat16" and cfg.attn_implementation == "sdpa" and cfg.trust_remote_code is False
    assert cfg.split_configs() == {None: cfg}


def test_storage_settings_left_at_none_are_settled_to_the_writers_defaults():
    """The config names what the shards use (saved with the dataset, compared on resume); given values stay."""
    from shards import DEFAULT_ENCODING, DEFAULT_SHARD_BYTES, DEFAULT_ZSTD_LEVEL

    cfg = make()
    assert (cfg.hidden_encoding, cfg.zstd_level, cfg.shard_bytes) == (
        DEFAULT_ENCODING,
        DEFAULT_ZSTD_LEVEL,
        DEFAULT_SHARD_BYTES,
    )
    given = make("hidden_encoding=plain", "zstd_level=7", "shard_bytes=4096")
    assert (given.hidden_encoding, given.zstd_level, given.shard_bytes) == ("plain", 7, 4096)
    split = load_config(ExtractConfig, None, ["target=t", "out_dir=o", 'splits={a="x.jsonl"}']).split_configs()["a"]
    assert split.zstd_level == DEFAULT_ZSTD_LEVEL


@pytest.mark.parametrize(
    "override, needle",
    [
        ("layer_ids=[1,1,2]", "'layer_ids': ids must be unique; repeated: [1]"),
        ("layer_ids=[-1]", "'layer_ids': -1 is below the minimum 0"),
        ("layer_ids=[]", "'layer_ids': needs at least one"),
        ("topk=0", "'topk': 0 is below the minimum 1"),
        ("length_policy=cut", "'length_policy': 'cut' is not allowed"),
        ("on_error=ignore", "'on_error': 'ignore' is not allowed"),
        ("tokens_per_batch=1000", "'tokens_per_batch': 1000 is below max_len 3072"),
        ("min_loss_tokens=5000", "'min_loss_tokens': 5000 exceeds max_len"),
        ("device=gpu", "'device': 'gpu' is not allowed"),
        ("attn_implementation=fast", "'attn_implementation': 'fast' is not allowed"),
        (
            'splits={a="x.jsonl"}',
            "also sets splits (a), each written to out_dir/NAME. To extract only this corpus into out_dir, also "
            "pass splits={}",
        ),
        ("chat_template_kwargs={x=[1]}", "'chat_template_kwargs.x'"),
        ("hidden_encoding=raw", "'hidden_encoding': 'raw' is not allowed"),
        ("gil_switch_interval=0", "'gil_switch_interval'"),
        ("launch_ahead_layers=-1", "'launch_ahead_layers'"),
    ],
)
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        make(override)
    assert needle in str(err.value)


def test_splits_become_one_config_per_output():
    cfg = load_config(ExtractConfig, None, ["target=t", "out_dir=out", 'splits={train="a.jsonl", heldout="b.jsonl"}'])
    split = cfg.split_configs()
    assert set(split) == {"train", "heldout"}
    assert split["train"].corpus == "a.jsonl" and split["train"].out_dir == "out/train" and split["train"].splits == {}
    with pytest.raises(ConfigError, match="splits.a/b"):
        load_config(ExtractConfig, None, ["target=t", "out_dir=out", 'splits={"a/b"="x"}'])


def test_layer_ids_checked_against_the_model(saved_target):
    config = read_text_config(saved_target)
    assert config.num_hidden_layers == 4
    check_layer_ids([0, 1, 2], 4)
    with pytest.raises(ConfigError, match=r"'layer_ids': \[4, 9\] out of range: the target has 4 decoder layers"):
        check_layer_ids([1, 4, 9], 4)
    with pytest.warns(UserWarning, match="last decoder layer"):
        check_layer_ids([3], 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_layer_ids([2], 4)


def test_auto_layer_ids_resolve_from_the_target_s_depth_and_a_bad_tap_suggests_them(saved_target, tmp_path):
    cfg = load_config(ExtractConfig, None, [f"target={saved_target}", "corpus=c.jsonl", "out_dir=o"])
    assert read_text_config(saved_target).num_hidden_layers == 4 and cfg.layer_ids == [1, 2]  # 2 taps for 4 layers
    assert dataset_keys(cfg)["layer_ids"] == [1, 2]  # what the manifest records and a resume compares
    explicit = load_config(
        ExtractConfig, None, [f"target={saved_target}", "corpus=c.jsonl", "out_dir=o", "layer_ids=[3]"]
    )
    assert explicit.layer_ids == [3]
    with pytest.raises(ConfigError, match=r'\[9\] out of range.* layer_ids = "auto" picks \[1, 2\] for it'):
        check_layer_ids([1, 9], 4)
    (tmp_path / "config.json").write_text('{"model_type": "odd"}')
    with pytest.raises(ConfigError, match="'layer_ids': auto: .*config.json names no layer count"):
        load_config(ExtractConfig, None, [f"target={tmp_path}", "corpus=c.jsonl", "out_dir=o"])


def test_shipped_configs_parse():
    tiny = load_config(ExtractConfig, "configs/tiny.toml", section="extract")
    assert set(tiny.split_configs()) == {"train", "heldout"} and tiny.out_dir == "artifacts/tiny/shards"
    real = load_config(ExtractConfig, "configs/qwen3.6-27b.toml", section="extract")
    assert real.layer_ids == [1, 16, 31, 46] and real.topk == 32 and real.max_len == 3072 and real.dtype == "bfloat16"


def test_dataset_keys_are_real_fields():
    names = set(ExtractConfig.__dataclass_fields__)
    assert set(DATASET_KEYS) <= names
    assert "tokens_per_batch" not in DATASET_KEYS and "layer_ids" in DATASET_KEYS


def test_hidden_encoding_choices_are_the_shard_formats():
    # extract.config keeps its own literal so that loading a config does not import pyarrow.
    from extract.config import HIDDEN_ENCODINGS
    from shards.schema import ENCODINGS

    assert sorted(HIDDEN_ENCODINGS) == sorted(ENCODINGS)
