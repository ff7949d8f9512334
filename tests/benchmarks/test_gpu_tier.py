"""The GPU tier's runner (tests.gpu_tier) and its report plugin (tests.gpu_tier_report), where CI runs: every
module of tests/gpu is in exactly one part; the modules the tier needs are derived from its imports; the summary
counts what ran, passed, failed, errored and was skipped, with pytest-xdist too, is written as the tests go (so a
run a deadline stops still says what ran and what was running), and is said in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import gpu_tier
from tests.paths import REPO

TESTS = """
import json, os, pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2

def test_skips():
    pytest.skip("no GPU here")

@pytest.fixture
def broken():
    raise RuntimeError("setup fails")

def test_errors(broken):
    pass
"""
# In one process only (under xdist another test may be running beside it): the summary is written as tests go.
INSPECT = """

def test_sees_itself_running_in_the_summary():
    found = json.loads(open(os.environ["DFLASH_GPU_TIER_SUMMARY"]).read())
    assert found["running"] == [os.environ["PYTEST_CURRENT_TEST"].split(" ")[0]]
    assert found["finished"] is False and found["ran"] == 4 and found["failures"]
"""


def test_every_gpu_module_is_in_exactly_one_part():
    modules = sorted(p.name for p in (REPO / "tests" / "gpu").glob("test_*.py"))
    in_parts = sorted(f for files in gpu_tier.PARTS.values() for f in files)
    assert in_parts == modules
    assert [p.name for p in gpu_tier.files_of(["decoding", "kernels"])] == [
        "test_specdecode_cuda.py",
        "test_rollback_cuda.py",
        "test_attention_cuda.py",
        "test_compile_cuda.py",
    ]
    assert len(gpu_tier.files_of(["all"])) == len(modules)
    with pytest.raises(SystemExit, match="no part 'gpus'"):
        gpu_tier.files_of(["gpus"])


def test_the_tier_needs_what_its_tests_and_their_helpers_import():
    needed = gpu_tier.test_modules(gpu_tier.files_of(["all"]))
    assert {"pytest", "torch", "numpy", "transformers"} <= set(needed)
    assert not {"tests", "json", "common"} & set(needed)


def run_report(tmp_path: Path, *args: str) -> dict:
    (tmp_path / "test_fake.py").write_text(TESTS + ("" if "-n" in args else INSPECT))
    summary = tmp_path / "summary.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), gpu_tier.REPORT_ENV: str(summary)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "tests.gpu_tier_report", "-p", "no:cacheprovider"]
    command += ["--rootdir", str(tmp_path), "-o", "addopts=", *args, str(tmp_path / "test_fake.py")]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(summary.read_text())


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_the_summary_counts_every_outcome(tmp_path, workers):
    if workers:
        pytest.importorskip("xdist")
    found = run_report(tmp_path, *workers)
    counts = {k: found[k] for k in ("collected", "ran", "passed", "failed", "errors", "skipped", "finished")}
    inspected = 0 if workers else 1  # one process: a fifth test, which sees itself running in the summary
    assert counts == {
        "collected": 4 + inspected,
        "ran": 4 + inspected,
        "passed": 1 + inspected,
        "failed": 1,
        "errors": 1,
        "skipped": 1,
        "finished": True,
    }
    assert found["running"] == [] and "test_fake.py::test_fails" in found["failures"]
    assert found["tests"]["test_fake.py::test_errors"]["outcome"] == "error"


def test_the_line_says_what_ran_and_what_a_deadline_stopped(tmp_path):
    summary = tmp_path / "gpu-tier-kernels.json"
    summary.write_text(
        json.dumps(
            {"collected": 7, "ran": 5, "passed": 4, "failed": 1, "errors": 0, "skipped": 0, "running": ["t.py::x"]}
        )
    )
    line = gpu_tier.summary_line("kernels", summary, 451.2, 124, 450)
    assert line.startswith("GPU tier, kernels: 5 of 7 ran: 4 passed, 1 failed, 0 errors, 0 skipped in 451 s")
    assert "stopped at the time limit (450 s), running then: t.py::x" in line and "\n" not in line
    assert json.loads(summary.read_text())["stopped_at_time_limit"] is True
    missing = gpu_tier.summary_line("kernels", tmp_path / "none.json", 3.0, 4, 450)
    assert missing.startswith("GPU tier, kernels: no summary was written")
