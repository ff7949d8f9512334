"""`target.rules`: the defaults derived from the target's depth (golden values from the
published drafters, docs/dflash.md "Defaults derived from the target") and the depth read from any
config.json layout."""

from __future__ import annotations

import json

import pytest

from target.rules import auto_layer_ids, auto_tap_count, config_depth, drafter_layers, tap_layer_ids


def test_tap_ids_follow_the_published_rule():
    assert tap_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab Qwen3-4B/8B-DFlash
    assert tap_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # z-lab Qwen3.6-27B-DFlash
    assert tap_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert tap_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # 7.5 -> 8 and 20.5 -> 20: Python's round, as z-lab's
    assert tap_layer_ids(64, 1) == [32]  # one tap: the middle layer


@pytest.mark.parametrize("layers", range(1, 70))
def test_auto_taps_are_distinct_spread_and_never_the_last_layer_when_there_is_another(layers):
    ids, reason = auto_layer_ids(layers)
    assert ids == sorted(set(ids)) and len(ids) == min(5, max(1, layers // 2)) and reason
    assert ids[-1] < layers - 1 or layers == 1
    if layers >= 8:
        assert ids[0] == 1 and ids[-1] == layers - 3  # the published span, 1 .. L-3


def test_shallow_targets_get_fewer_taps_and_a_shallower_drafter():
    assert [auto_tap_count(n) for n in (1, 2, 4, 8, 9, 10, 30, 64)] == [1, 1, 2, 4, 4, 5, 5, 5]
    assert auto_layer_ids(8)[0] == [1, 2, 4, 5]  # the tiny default's taps (configs/tiny.toml)
    assert [drafter_layers(n)[0] for n in (1, 4, 8, 12, 19, 20, 30, 36, 64)] == [1, 1, 2, 3, 4, 5, 5, 5, 5]


def test_depth_is_read_from_every_config_layout(tmp_path):
    def depth(config):
        (tmp_path / "config.json").write_text(json.dumps(config))
        return config_depth(str(tmp_path))

    assert depth({"num_hidden_layers": 30}) == 30
    assert depth({"n_layer": 12, "model_type": "gpt2"}) == 12
    assert depth({"num_hidden_layers": 2, "text_config": {"num_hidden_layers": 64}}) == 64  # multimodal: the text one
    with pytest.raises(ValueError, match="config.json names no layer count"):
        depth({"model_type": "x"})
    with pytest.raises(ValueError, match="cannot read the target's depth from .*nowhere/config.json"):
        config_depth(str(tmp_path / "nowhere"))
