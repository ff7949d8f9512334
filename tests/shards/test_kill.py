"""A writer killed with SIGKILL at a random moment leaves a dataset whose manifest lists only
complete shards, which verify accepts and a resumed writer completes without duplicates."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from shards import ShardDataset, verify_dataset
from tests.paths import child_pythonpath
from tests.shards.synth import assert_same, make_sample

REPO = Path(__file__).resolve().parents[2]
N_SAMPLES = 3000  # far more than a child writes before it is killed


def start_child(root: Path, n: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.shards.writer_child", str(root), str(n)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline()
    assert line.strip() == "ready", child.stderr.read()
    return child


def check_committed_prefix(root: Path) -> int:
    """The dataset holds samples 0..n-1 in order, bit-exact, and passes verify; return n."""
    assert verify_dataset(str(root)) == []
    ds = ShardDataset(str(root))
    for i in range(len(ds)):
        assert_same(ds[i], make_sample(i))
    # State and counters saved with a commit describe exactly the committed samples.
    assert ds.manifest["counts"].get("written", 0) == len(ds)
    assert ds.manifest["stage_state"].get("written_up_to", 0) == len(ds)
    return len(ds)


def test_sigkill_at_random_moments_leaves_only_complete_shards(tmp_path):
    root = tmp_path / "ds"
    rng = random.Random(1234)
    committed = 0
    for attempt in range(3):
        child = start_child(root, N_SAMPLES)
        # The moment is counted in the child's progress (robust to a loaded machine), plus a random
        # delay, so kills land in writes, commits and manifest updates alike.
        for _ in range(rng.randint(1, 40)):
            assert child.stdout.readline().strip() == "wrote", child.stderr.read()
        time.sleep(rng.uniform(0.0, 0.02))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        assert child.returncode == -signal.SIGKILL, f"attempt {attempt}: the child finished before it was killed"
        now = check_committed_prefix(root)
        assert now >= committed, "a kill lost committed samples"
        committed = now
    assert committed > 0, "no shard was committed in any attempt; the test did not exercise a resume"
    finisher = start_child(root, committed + 20)
    finisher.stdout.read()  # drain the progress lines so the child never blocks on the pipe
    assert finisher.wait(timeout=60) == 0, finisher.stderr.read()
    assert check_committed_prefix(root) == committed + 20
    assert not list(root.glob("*.tmp"))
