"""`recipes.tiny.compute`: where the tiny build runs (threads set and restored; the GPU's
deterministic mode, checked on the CPU)."""

from __future__ import annotations

import torch

from recipes.tiny import TinyConfig
from recipes.tiny.compute import build_compute, deterministic_cuda


def test_build_compute_sets_and_restores_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    before = torch.get_num_threads()
    with build_compute(TinyConfig(device="cpu")) as compute:
        assert compute.device.type == "cpu" and torch.get_num_threads() == 3
    with build_compute(TinyConfig(device="cpu", threads=1)):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_deterministic_mode_reports_ops_without_a_deterministic_kernel_and_is_undone():
    """What the GPU build runs under, checked on the CPU: `put_` has no deterministic kernel on any device."""
    noticed = []
    with deterministic_cuda(noticed):
        assert torch.are_deterministic_algorithms_enabled()
        torch.zeros(3).put_(torch.tensor([0]), torch.tensor([1.0]))
        torch.zeros(3).put_(torch.tensor([1]), torch.tensor([1.0]))  # the same op again: reported once
    assert len(noticed) == 1 and "put_" in noticed[0]
    assert not torch.are_deterministic_algorithms_enabled()
