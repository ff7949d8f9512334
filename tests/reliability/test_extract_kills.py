"""Short version of scenario 1: one SIGKILL in each of the commit windows (shard written, shard renamed
but not listed, manifest update, the final merge), each resumed to the uninterrupted run's bytes."""

from __future__ import annotations

import pytest

from tests.reliability import extract_kills

pytestmark = pytest.mark.slow


def test_kills_in_the_commit_windows_resume_to_the_uninterrupted_dataset(world, tmp_path):
    windows = ("shard_written", "shard_renamed", "manifest_written", "merged_rejects_written")
    outcome = extract_kills.run(world, kills=len(windows), seed=3, mode="fork", work=tmp_path, windows=windows)
    assert outcome.passed, outcome.explain()
    assert outcome.figure.startswith(f"{len(windows)}/{len(windows)} kills survived; 0 samples lost, 0 duplicated")
