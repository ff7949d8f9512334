"""`make tiers` killed at any point and rerun never takes an unfinished training for finished: a
comparison killed (SIGKILL, its training child with it) after a checkpoint was committed and before
the training's final one resumes that training on the rerun (recipes.runner's notion of done: a run's
final checkpoint). The kill is sequenced by the file system: the training child holds after it
committed the checkpoint (a `sitecustomize` hook on `os.replace`, which commits a checkpoint
directory) and writes a marker; the test kills once the marker is there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from recipes.runner import Ledger, final_checkpoint
from tests.paths import REPO, child_pythonpath
from tests.train.test_loop import make_tiny, tiny_run_args

HOLD = """
import os, threading
_replace = os.replace


def _holding_replace(src, dst, *args, **kwargs):
    _replace(src, dst, *args, **kwargs)
    if os.path.basename(os.fspath(dst)) == os.environ["HOLD_AFTER"]:
        open(os.environ["HOLD_MARKER"], "w").close()
        threading.Event().wait()  # until killed


if os.environ.get("HOLD_AFTER"):
    os.replace = _holding_replace
"""


def test_a_comparison_killed_mid_training_resumes_that_training(tmp_path, monkeypatch, capfd):
    from recipes import compare_tiers

    tiny = make_tiny(tmp_path / "tiny")
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(HOLD)
    (tmp_path / "exp.toml").write_text("[train]\n")
    words = [w for w in tiny_run_args(tiny, "") if not w.startswith(("out_dir=", "data.shards=", "optim.max_steps"))]
    argv = [str(tmp_path / "exp.toml"), f"out_dir={tmp_path / 'out'}", f"lossless={tiny / 'shards'}", "tiers=[]"]
    argv += [
        "heldout=none",
        "seeds=[0]",
        "online=false",
        f"train_overrides={json.dumps([*words, 'optim.max_steps=4'])}",
    ]
    run = tmp_path / "out" / "runs" / "lossless-s0"
    marker = tmp_path / "checkpoint-2-committed"

    env = {**os.environ, "PYTHONPATH": child_pythonpath(str(tmp_path / "hook"))}
    env.update(HOLD_AFTER="step-00000002", HOLD_MARKER=str(marker))
    first = subprocess.Popen(
        [sys.executable, "-m", "recipes.compare_tiers", *argv], cwd=REPO, env=env, start_new_session=True
    )
    deadline = time.monotonic() + 300  # a guard against a hang, not a sequencing delay
    while not marker.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)  # the comparison and its training child, mid-training
    first.wait()
    assert marker.exists(), "the training never committed its step-2 checkpoint"
    assert (run / "checkpoints" / "step-00000002" / "state.json").is_file() and final_checkpoint(str(run)) is None
    ledger = Ledger(str(tmp_path / "out" / "stages.json"))
    assert ledger.entries["train lossless-s0"]["state"] == "started"

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", child_pythonpath())
    assert compare_tiers.main(argv) == 0
    assert "train lossless-s0: resuming where it stopped" in capfd.readouterr().out
    starts = json.loads((run / "run.json").read_text())["starts"]
    assert [s["step"] for s in starts] == [0, 2] and starts[1]["resumed_from"].endswith("step-00000002")
    assert final_checkpoint(str(run)) == str(run / "checkpoints" / "step-00000004" / "state.json")
    steps = json.loads((tmp_path / "out" / "tiers.json").read_text())["steps"]
    assert steps["train lossless-s0"]["status"] == "resumed"
    assert compare_tiers.main(argv) == 0  # and once finished, it is done
    assert (
        json.loads((tmp_path / "out" / "tiers.json").read_text())["steps"]["train lossless-s0"]["status"] == "skipped"
    )
