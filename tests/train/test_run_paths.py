"""A run writes only under out_dir/run_name (found by the reliability suite): an over-long run name is
a config error rather than an I/O error at mkdir, a run directory that is a symlink out of out_dir
is refused with a message instead of an internal assertion, and a second training into a run
directory stops at once."""

from __future__ import annotations

import os
import signal

import pytest

from common.config import ConfigError, load_config
from common.locks import LockedError
from tests.extract.test_start_and_finish import hold_lock_in_a_child
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


def test_a_second_training_into_one_run_directory_stops_at_once(tmp_path):
    runs = tmp_path / "runs"
    (runs / "r").mkdir(parents=True)
    child = hold_lock_in_a_child(runs / "r" / ".train.lock")
    try:
        with pytest.raises(LockedError, match="run directory .* is being written by another process"):
            train(
                load_config(
                    TrainConfig, None, [f"out_dir={runs}", "run_name=r", f"data.shards={tmp_path / 'no-shards'}"]
                )
            )
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert sorted(os.listdir(runs / "r")) == [".train.lock"]
    with pytest.raises(ValueError, match="no-shards"):  # free again: the run gets as far as its data
        train(
            load_config(
                TrainConfig, None, [f"out_dir={runs}", "run_name=other", f"data.shards={tmp_path / 'no-shards'}"]
            )
        )
    assert not (runs / "other").exists()  # a refused start leaves no run directory
