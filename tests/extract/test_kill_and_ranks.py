"""Real processes: an extraction killed with SIGKILL at random points and rerun stores exactly the
samples of an uninterrupted run, bit for bit; `torchrun` with 2 processes (gloo, CPU) writes per-rank
shards, merges them, and holds the same samples as one process."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shards import ShardDataset, verify_dataset
from tests.extract.conftest import chat_record, write_lines
from tests.paths import child_pythonpath

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow


def env() -> dict:
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=child_pythonpath(),
    )


def write_config(path, target, corpus, out_dir) -> str:
    path.write_text(
        f'[extract]\ntarget = "{target}"\ncorpus = "{corpus}"\nout_dir = "{out_dir}"\nlayer_ids = [0, 2]\ntopk = '
        "4\nmax_len = 256\n"
        'tokens_per_batch = 256\nmin_loss_tokens = 4\ndtype = "float32"\ndevice = "cpu"\nshard_bytes = '
        "30000\nsort_window = 24\n"
        "progress = false\nwriter_threads = 1\n"
    )
    return str(path)


def extract_cmd(config) -> list[str]:
    return [sys.executable, "-m", "extract", config]


def by_id(root) -> dict:
    return {s.sample_id: s for s in ShardDataset(str(root))}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, saved_target):
    root = tmp_path_factory.mktemp("procs")
    rng = random.Random(11)
    records = [chat_record(rng, rng.randint(3, 10), rng.randint(10, 70)) for _ in range(120)]
    records.insert(7, '{"broken": ')
    records.insert(50, records[20])
    corpus = write_lines(root / "corpus.jsonl", records)
    config = write_config(root / "base.toml", saved_target, corpus, root / "base")
    done = subprocess.run(extract_cmd(config), cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"root": root, "corpus": corpus, "target": saved_target, "base": root / "base"}


def committed_samples(manifest_path) -> tuple[int, bool]:
    try:
        manifest = json.loads(Path(manifest_path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return 0, False
    return manifest["counts"]["samples"], manifest["complete"]


def test_sigkill_at_random_points_then_rerun_is_bit_identical(setup, tmp_path):
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.toml", setup["target"], setup["corpus"], out)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    manifest = out / "manifest.rank000.json"
    total = json.loads((setup["base"] / "manifest.json").read_text())["counts"]["samples"]
    # Kill once the dataset holds a random number of samples, plus a random few milliseconds, so the
    # kill lands anywhere in a commit cycle (mid-forward, mid-write, mid-commit) but never after the end.
    thresholds = sorted(rng.sample(range(1, total - 20), 2))
    landed = []
    for threshold in thresholds:
        proc = subprocess.Popen(
            extract_cmd(config), cwd=REPO, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.time() + 180
        while committed_samples(manifest)[0] < threshold and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        landed.append(committed_samples(manifest))
    assert all(0 < n < total and not complete for n, complete in landed), f"seed {seed}: {landed}"
    done = subprocess.run(extract_cmd(config), cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert verify_dataset(str(out)) == []
    killed, base = by_id(out), by_id(setup["base"])
    assert killed.keys() == base.keys(), f"seed {seed}"
    for sid, sample in base.items():
        for field in ("input_ids", "loss_mask", "hidden", "topk_ids", "topk_logprobs"):
            assert np.array_equal(getattr(killed[sid], field).view(np.uint8), getattr(sample, field).view(np.uint8)), (
                seed,
                sid,
                field,
            )
    base_manifest, killed_manifest = (
        json.loads((setup["base"] / "manifest.json").read_text()),
        json.loads((out / "manifest.json").read_text()),
    )
    assert killed_manifest["counts"] == base_manifest["counts"]
    assert (out / "rejects.jsonl").read_text() == (setup["base"] / "rejects.jsonl").read_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_processes_merge_into_the_same_dataset(setup, tmp_path):
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.toml", setup["target"], setup["corpus"], out)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "extract",
        config,
    ]
    done = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "accounted for" in done.stdout  # rank 0 printed the merged summary
    assert verify_dataset(str(out)) == []
    per_rank = [json.loads((out / f"manifest.rank00{r}.json").read_text()) for r in (0, 1)]
    assert all(m["complete"] and m["counts"]["samples"] > 0 for m in per_rank)
    assert {e["file"].split("-")[0] for e in per_rank[1]["shards"]} == {"r001"}
    merged, base = by_id(out), by_id(setup["base"])
    assert merged.keys() == base.keys()
    for sid in base:
        assert np.array_equal(merged[sid].input_ids, base[sid].input_ids)
    assert (
        json.loads((out / "manifest.json").read_text())["counts"]
        == json.loads((setup["base"] / "manifest.json").read_text())["counts"]
    )
