"""On CUDA: storage tiers in the trainer, on the one kernel choice.

- A quantized dataset's batches travel compact and dequantize on the GPU to exactly what the CPU
  gives: fp8 and nf4 decode with one float32 multiply per value, rounded once to bf16, so the two
  devices agree bit for bit.
- `python -m train` on an fp8 + PCA dataset on CUDA: the step dequantizes on the kernel choice's
  device and fc reads the projected width; the run trains (finite, changing loss) and its drafter
  records the dataset's projection.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from common.config import load_config
from shards import ShardDataset
from shards.transcode import TranscodeConfig, transcode
from tests.gpu import GPU
from tests.gpu.test_train_cuda import train_cli
from tests.train.test_loop import config, make_tiny
from train.data import DataStream
from train.metrics import read_metrics
from train.stored_features import CompactHidden

pytestmark = GPU


def tier_on_cuda(tiny, out, *words) -> str:
    """A storage tier of the tiny shards, transcoded on the GPU (device=cuda)."""
    transcode(
        str(tiny / "shards"), str(out), load_config(TranscodeConfig, None, ["progress=false", "device=cuda", *words])
    )
    return str(out)


@pytest.mark.parametrize("encoding", ["fp8", "nf4-g16"])
def test_compact_batches_dequantize_on_cuda_exactly_as_on_cpu(tmp_path, encoding):
    tiny = make_tiny(tmp_path / "tiny", head_dim=16)
    root = tier_on_cuda(tiny, tmp_path / encoding, f"encoding={encoding}")
    stream = DataStream(config(tiny, tmp_path, f"data.shards={root}").data)
    try:
        for _ in range(3):
            batch = next(stream)
            assert isinstance(batch.hidden, CompactHidden)
            on_gpu = batch.hidden.to(torch.device("cuda"), non_blocking=True)
            on_cpu = batch.hidden.to("cpu")
            assert (
                on_gpu.device.type == "cuda" and on_gpu.dtype == torch.bfloat16 and on_gpu.shape == batch.hidden.shape
            )
            assert torch.equal(on_gpu.cpu(), on_cpu)
    finally:
        stream.close()


def test_the_train_cli_trains_on_a_quantized_projected_dataset_on_cuda(tmp_path):
    tiny = make_tiny(tmp_path / "tiny", head_dim=16)
    root = tier_on_cuda(tiny, tmp_path / "fp8-pca", "encoding=fp8", "projection=pca:rank=8", "calibration_samples=8")
    dataset = ShardDataset(root)
    runs = tmp_path / "runs"
    train_cli(tiny, runs, "run_name=tier", f"data.shards={root}")  # checks the kernel line: cuda, bf16, flex
    metrics = read_metrics(runs / "tier" / "metrics.jsonl")
    assert len(metrics) == 6 and all(not r["skipped"] and math.isfinite(r["loss"]) for r in metrics)
    assert metrics[0]["loss"] != metrics[-1]["loss"]
    info = json.loads((runs / "tier" / "run.json").read_text())
    assert info["device"] == "cuda" and info["kernels"]["attention"] == "flex"
    drafter = json.loads((runs / "tier" / "checkpoints" / "step-00000006" / "drafter_config.json").read_text())
    assert drafter["projection"]["checksum"] == dataset.projection["checksum"]
    assert drafter["projection"]["out_width"] == dataset.hidden_width < dataset.projection["in_width"]
