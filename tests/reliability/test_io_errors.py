"""Short version of scenario 4: ENOSPC / EIO in a shard write, a manifest update, a checkpoint file and
a checkpoint fsync, in a transcode's shard and a regeneration's journal: a one-line message naming the
file, the last good state intact, a clean rerun. Then real full disks (a small tmpfs the test makes in a
user namespace, where the kernel allows one) for extraction, transcode (also with a shard larger than the
writer's buffer, so that the disk fills inside it) and training: exit 4, one line,
no temporary left, and a rerun with room that ends identical to a clean run."""

from __future__ import annotations

import pytest

from tests.reliability import io_errors, small_disk


def test_full_disk_and_io_errors_stop_cleanly_and_resume(world, tmp_path):
    outcome = io_errors.run(
        world,
        work=tmp_path,
        extract_cases=(("enospc", "shard_data", 40), ("enospc", "manifest_written", 6)),
        train_cases=(("enospc", "ckpt_model", 2), ("eio", "ckpt_fsync", 7)),
        transcode_cases=(("enospc", "shard_data", 3),),
        regenerate_cases=(("enospc", "journal_line", 5),),
        small_disk_stages=(),
    )
    assert outcome.passed, outcome.explain()
    assert outcome.figure == "6/6 scenarios passed"


def test_real_full_disks_stop_cleanly_and_resume(world, tmp_path):
    why_not = small_disk.unavailable()
    if why_not:
        pytest.skip(f"no small file system can be made here ({why_not}); the injected ENOSPC cases cover the rest")
    outcome = io_errors.run(
        world,
        work=tmp_path,
        extract_cases=(),
        train_cases=(),
        transcode_cases=(),
        regenerate_cases=(),
        small_disk_stages=("extract", "transcode", "transcode_wide", "train"),
    )
    assert outcome.passed, outcome.explain()
    assert outcome.figure == "4/4 scenarios passed"
