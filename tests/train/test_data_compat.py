"""`check_compatible`: a dataset whose manifest disagrees with the drafter config is refused, with
the manifest field and both values named; a missing field is reported too."""

from __future__ import annotations

import copy

import pytest

from train.samples import EXPECTED_FIELDS, check_compatible


def manifest() -> dict:
    return {
        "complete": True,
        "hidden_width": 3 * 5120,
        "topk": 8,
        "provenance": {
            "target": {
                "name_or_path": "Qwen/Qwen3.6-27B",
                "config_hash": "c0ffee",
                "hidden_size": 5120,
                "vocab_size": 248320,
            },
            "tokenizer": {"hash": "70c3e4"},
            "taps": {"layer_ids": [1, 31, 61]},
        },
    }


def expected() -> dict:
    return {
        "layer_ids": [1, 31, 61],
        "hidden_width": 3 * 5120,
        "hidden_size": 5120,
        "vocab_size": 248320,
        "tokenizer_hash": "70c3e4",
        "topk": 4,
        "target_name": "Qwen/Qwen3.6-27B",
        "target_config_hash": "c0ffee",
    }


def test_a_matching_manifest_passes():
    check_compatible(manifest(), expected())
    check_compatible(manifest(), {"layer_ids": (1, 31, 61)})  # tuples and lists compare equal


def test_every_field_is_covered():
    assert set(expected()) == set(EXPECTED_FIELDS)


@pytest.mark.parametrize(
    "key, wrong, field",
    [
        ("layer_ids", [0, 30, 60], "provenance.taps.layer_ids"),
        ("hidden_width", 4 * 5120, "hidden_width"),
        ("hidden_size", 4096, "provenance.target.hidden_size"),
        ("vocab_size", 151936, "provenance.target.vocab_size"),
        ("tokenizer_hash", "deadbeef", "provenance.tokenizer.hash"),
        ("topk", 16, "topk"),
        ("target_name", "Qwen/Qwen3-8B", "provenance.target.name_or_path"),
        ("target_config_hash", "bad", "provenance.target.config_hash"),
    ],
)
def test_each_mismatch_names_field_and_both_values(key, wrong, field):
    want = {**expected(), key: wrong}
    with pytest.raises(ValueError) as err:
        check_compatible(manifest(), want)
    message = str(err.value)
    have = manifest()
    for part in field.split("."):
        have = have[part]
    assert f"manifest field '{field}' = {have!r}" in message and repr(wrong) in message
    assert message.count("manifest field") == 1  # only the wrong field is reported


def _delete(tree: dict, dotted: str) -> dict:
    tree = copy.deepcopy(tree)
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node[part]
    del node[leaf]
    return tree


@pytest.mark.parametrize("key", sorted(EXPECTED_FIELDS))
def test_a_missing_field_is_reported(key):
    field = EXPECTED_FIELDS[key][0]
    with pytest.raises(ValueError, match=f"manifest field '{field}' is missing"):
        check_compatible(_delete(manifest(), field), {key: expected()[key]})


def test_topk_is_a_minimum():
    check_compatible(manifest(), {"topk": 8})
    check_compatible(manifest(), {"topk": 1})
    with pytest.raises(ValueError, match=r"needs topk >= 9"):
        check_compatible(manifest(), {"topk": 9})


def test_all_problems_are_reported_together():
    with pytest.raises(ValueError) as err:
        check_compatible(manifest(), {**expected(), "vocab_size": 1, "tokenizer_hash": "x"})
    assert "provenance.target.vocab_size" in str(err.value) and "provenance.tokenizer.hash" in str(err.value)


def test_unknown_expected_keys_incomplete_and_inconsistent_manifests():
    with pytest.raises(ValueError, match="unknown expected field"):
        check_compatible(manifest(), {"layer_id": [1]})
    with pytest.raises(ValueError, match="'complete' is false"):
        check_compatible({**manifest(), "complete": False}, {})
    with pytest.raises(ValueError, match="contradicts itself"):
        check_compatible({**manifest(), "hidden_width": 4 * 5120}, {})
