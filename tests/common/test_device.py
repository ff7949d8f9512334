"""common.device: the device and autocast choices that train and eval share."""

from __future__ import annotations

import pytest
import torch

from common.device import autocast_dtype, resolve_device


def test_auto_follows_what_torch_sees_and_cuda_without_a_gpu_names_the_key(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="config key 'device'"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("precision, device, expected", [
    ("auto", "cpu", None), ("auto", "cuda", torch.bfloat16), ("bf16", "cpu", torch.bfloat16),
    ("fp32", "cuda", None), ("fp32", "cpu", None),
])
def test_autocast_dtype(precision, device, expected):
    assert autocast_dtype(precision, torch.device(device)) is expected
