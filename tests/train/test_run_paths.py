"""A run writes only under out_dir/run_name (found by the reliability suite): an over-long run name is
a config error rather than an I/O error at mkdir, and a run directory that is a symlink out of
out_dir is refused with a message instead of an internal assertion."""

from __future__ import annotations

import pytest

from common.config import ConfigError, load_config
from tests.train.test_loop import config, tiny  # noqa: F401 - `tiny` is a fixture
from train.config import TrainConfig
from train.loop import train


def test_an_over_long_run_name_is_a_config_error():
    with pytest.raises(ConfigError, match="run_name"):
        load_config(TrainConfig, None, ["run_name=" + "a" * 300])
    assert load_config(TrainConfig, None, ["run_name=" + "a" * 128]).run_name == "a" * 128


def test_a_run_directory_linked_out_of_out_dir_is_refused(tiny, tmp_path):  # noqa: F811
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ValueError, match="run_name.*outside out_dir"):
        train(config(tiny, tmp_path))
    assert not any(elsewhere.iterdir())
