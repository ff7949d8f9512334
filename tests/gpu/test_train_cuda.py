"""On CUDA: `python -m train` runs and resumes, each a fresh process as a user starts it.

A 6-step run, and the same run stopped after step 3 and resumed in a new process. Checked exactly:
the kernel choice (one log line per process: device cuda, bf16 autocast, flex for head_dim 16),
every step logged once, the resume start recorded, the data order (per step: bucket, samples,
tokens, epoch) and the final data position. Checked within 1e-2 relative: the per-step loss and
grad norm, because resume restores the weights, optimizer and RNG exactly but CUDA kernels do not
promise bit-identical reductions between processes (the CPU suite checks bit-identity:
tests/train/test_loop.py::test_resume_is_bit_identical). Whether they came out exact is printed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from tests.gpu import GPU
from tests.paths import REPO, child_pythonpath
from tests.train.test_loop import make_tiny, tiny_run_args
from train.checkpoint import load_checkpoint
from train.metrics import read_metrics

pytestmark = GPU

STEPS = 6


def train_cli(tiny, runs, *args) -> subprocess.CompletedProcess:
    argv = [
        sys.executable,
        "-m",
        "train",
        *tiny_run_args(tiny, runs),
        f"optim.max_steps={STEPS}",
        "device=cuda",
        *args,
    ]
    env = dict(os.environ, PYTHONPATH=child_pythonpath(), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-4000:]
    kernel_lines = [line for line in done.stderr.splitlines() if "train.kernels: kernels:" in line]
    assert len(kernel_lines) == 1, done.stderr[-4000:]
    assert "kernels: device cuda, bf16 autocast, attention flex (auto: flex on CUDA for head_dim 16)" in kernel_lines[0]
    return done


def test_the_train_cli_runs_and_resumes_on_cuda(tmp_path):
    tiny = make_tiny(tmp_path / "tiny", head_dim=16)
    runs = tmp_path / "runs"
    train_cli(tiny, runs, "run_name=full")
    train_cli(tiny, runs, "run_name=split", "stop_after=3")
    assert [r["step"] for r in read_metrics(runs / "split" / "metrics.jsonl")] == [1, 2, 3]
    train_cli(tiny, runs, "run_name=split")  # a new process resumes from the checkpoint a stop always writes (step 3)

    full, split = read_metrics(runs / "full" / "metrics.jsonl"), read_metrics(runs / "split" / "metrics.jsonl")
    assert [r["step"] for r in full] == [r["step"] for r in split] == list(range(1, STEPS + 1))
    for a, b in zip(full, split, strict=True):
        assert (a["bucket"], a["batch_samples"], a["batch_tokens"], a["epoch"]) == (
            b["bucket"],
            b["batch_samples"],
            b["batch_tokens"],
            b["epoch"],
        )
        assert not a["skipped"] and not b["skipped"]
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-2) and math.isclose(
            a["grad_norm"], b["grad_norm"], rel_tol=1e-2
        ), (a, b)
    assert full[0]["loss"] != full[-1]["loss"]
    info = json.loads((runs / "split" / "run.json").read_text())
    assert info["device"] == "cuda" and info["kernels"]["attention"] == "flex" and info["precision"] == "bfloat16"
    starts = info["starts"]
    assert (
        len(starts) == 2 and starts[0]["resumed_from"] is None and starts[1]["resumed_from"].endswith("step-00000003")
    )
    last = f"step-{STEPS:08d}"
    state_full = load_checkpoint(runs / "full" / "checkpoints" / last)["state"]
    state_split = load_checkpoint(runs / "split" / "checkpoints" / last)["state"]
    assert state_full["data_state"] == state_split["data_state"] and state_full["tokens"] == state_split["tokens"]
    exact = all(a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] for a, b in zip(full, split, strict=True))
    print(
        f"resume on CUDA: losses {'bit-identical' if exact else 'equal within 1e-2, not bit-identical'}: "
        f"{[(a['loss'], b['loss']) for a, b in zip(full, split, strict=True)]}"
    )
