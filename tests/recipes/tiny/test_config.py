"""`recipes.tiny.config` (tap ids, checks naming the key) and a package that is cheap to import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from recipes.tiny import (
    TinyConfig,
    tap_layer_ids,
)
from recipes.tiny import __main__ as tiny_cli
from tests.paths import REPO


def test_importing_the_module_is_cheap():
    code = (
        "import sys, recipes.tiny; print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in "
        "sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------------------------------------
# Target


@pytest.mark.parametrize("layers, taps", [(64, 4), (36, 5), (8, 4), (6, 3), (4, 3), (3, 2), (2, 1)])
def test_tap_layer_ids_are_spread_and_never_the_last_layer(layers, taps):
    ids = tap_layer_ids(layers, taps)
    assert len(ids) == taps and ids == sorted(set(ids))
    assert ids[0] >= 0 and ids[-1] <= layers - 2
    if layers >= taps + 3:
        assert ids[0] == 1
    assert tap_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # the published Qwen3-8B drafter's taps


def test_config_checks_name_the_key():
    from common.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="num_kv_heads"):
        load_config(TinyConfig, None, ["target=train", "num_heads=4", "num_kv_heads=3"])
    with pytest.raises(ConfigError, match="n_taps"):
        load_config(TinyConfig, None, ["target=train", "num_layers=4", "n_taps=4"])
    assert tiny_cli.main(["no_such_key=1"]) == 2
