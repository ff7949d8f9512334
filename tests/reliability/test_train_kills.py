"""Short version of scenario 2: SIGKILL half-way through a checkpoint file, after the rename, and in
the middle of pruning an old checkpoint; every listed checkpoint loads and the resumed run's losses
equal the uninterrupted run's."""

from __future__ import annotations

import pytest

from tests.reliability import train_kills

pytestmark = pytest.mark.slow


def test_kills_during_checkpoint_saves_resume_to_identical_losses(world, tmp_path):
    windows = ("ckpt_model", "ckpt_renamed", "ckpt_prune")
    outcome = train_kills.run(
        world, kills=len(windows), seed=5, mode="fork", work=tmp_path, steps=8, every=2, windows=windows
    )
    assert outcome.passed, outcome.explain()
    assert outcome.figure == f"{len(windows)}/{len(windows)} kills survived; 0 steps with a different loss"
