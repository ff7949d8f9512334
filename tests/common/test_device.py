"""common.device: the device and autocast choices that train and eval share, CPU threads for small models, the machine
record."""

from __future__ import annotations

import pytest
import torch

from common import device
from common.device import autocast_dtype, resolve_device


def test_auto_follows_what_torch_sees_and_cuda_without_a_gpu_names_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="config key 'device'"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize(
    "precision, device, expected",
    [
        ("auto", "cpu", None),
        ("auto", "cuda", torch.bfloat16),
        ("bf16", "cpu", torch.bfloat16),
        ("fp32", "cuda", None),
        ("fp32", "cpu", None),
    ],
)
def test_autocast_dtype(precision, device, expected):
    assert autocast_dtype(precision, torch.device(device)) is expected


@pytest.mark.parametrize(
    "cores, env, expected", [(2, None, 2), (16, None, 4), (1, None, 1), (16, "8", 8), (16, "junk", 4), (2, "0", 2)]
)
def test_small_model_threads(monkeypatch, cores, env, expected):
    monkeypatch.setattr(device, "usable_cores", lambda: cores)
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert device.small_model_threads() == expected


def test_describe_machine_names_cpu_cores_and_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    machine = device.describe_machine()
    assert machine["cores"] == device.usable_cores() >= 1 and machine["gpu"] is None and machine["cpu"]
    assert machine["torch"] == torch.__version__
