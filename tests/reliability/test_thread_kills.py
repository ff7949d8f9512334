"""Short version of scenario 7: one extraction killed at a random moment and resumed, both with
torch's default thread count; what resume promises holds (same samples once each, tokens, masks,
counts, rejects)."""

from __future__ import annotations

import pytest

from tests.reliability import thread_kills

pytestmark = pytest.mark.slow


def test_a_kill_with_default_threads_keeps_what_resume_promises(world, tmp_path):
    outcome = thread_kills.run(world, kills=1, seed=5, work=tmp_path)
    assert outcome.passed, outcome.explain()
    assert outcome.figure.startswith("1/1 kills kept the promise; 0 samples lost, 0 duplicated")
