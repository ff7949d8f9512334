"""Short version of scenario 3: damaged shard, index, manifest and checkpoint files are all detected
naming the file (with the default data checks too: nothing is read silently); `data.on_corrupt=skip`
trains past a damaged shard and counts its samples, or the one damaged sample."""

from __future__ import annotations

from tests.reliability import corruption


def test_every_damaged_file_is_detected_and_a_skipped_shard_is_counted(world, tmp_path):
    outcome = corruption.run(world, trials=5, seed=11, work=tmp_path)
    assert outcome.passed, outcome.explain()
    assert outcome.figure == "10/10 corruptions detected"
    assert sum("on_corrupt=skip" in d for d in outcome.details) == 3
