"""Short version of scenario 4: ENOSPC / EIO in a shard write, a manifest update, a checkpoint file and
a checkpoint fsync: a one-line message naming the file, the last good state intact, a clean rerun."""

from __future__ import annotations

from tests.reliability import io_errors


def test_full_disk_and_io_errors_stop_cleanly_and_resume(world, tmp_path):
    outcome = io_errors.run(
        world,
        work=tmp_path,
        extract_cases=(("enospc", "shard_data", 40), ("enospc", "manifest_written", 6)),
        train_cases=(("enospc", "ckpt_model", 2), ("eio", "ckpt_fsync", 7)),
    )
    assert outcome.passed, outcome.explain()
    assert outcome.figure == "4/4 scenarios passed"
