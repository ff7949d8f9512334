"""Where the tiny build runs: the device (`device` knob), torch's CPU threads, and on a GPU the
settings that make a build repeat itself on the same machine; plus the build's log line.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from recipes.tiny.config import TinyConfig

if TYPE_CHECKING:
    import torch


def log(message: str) -> None:
    print(f"[tiny] {message}", flush=True)


def resolve_build_device(choice: str) -> str:
    """'cuda' or 'cpu' for the `device` knob (auto = cuda when torch sees a GPU)."""
    from common.device import resolve_device

    return resolve_device(choice).type


@dataclass
class Compute:
    """Where a build step runs, and what it noticed: ops that warned of nondeterminism on the GPU."""

    device: torch.device
    nondeterministic_ops: list[str]


@contextlib.contextmanager
def build_compute(cfg: TinyConfig) -> Iterator[Compute]:
    """The device of the build, set up for it: torch CPU threads (`threads`, else
    `common.device.small_model_threads()`), and on a GPU what makes a build repeat itself on the
    same machine: torch's deterministic kernels, cuBLAS with a fixed workspace, and attention by
    SDPA's math kernel (the fused kernels' backward accumulates atomically). An op without a
    deterministic kernel warns instead of stopping the build; the warnings are collected and reported."""
    import torch

    from common.device import small_model_threads

    compute = Compute(torch.device(resolve_build_device(cfg.device)), [])
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or small_model_threads())
    try:
        if compute.device.type != "cuda":
            yield compute
            return
        with deterministic_cuda(compute.nondeterministic_ops):
            yield compute
    finally:
        torch.set_num_threads(threads_before)


@contextlib.contextmanager
def deterministic_cuda(noticed: list[str]) -> Iterator[None]:
    import warnings

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Read when cuBLAS first runs in this process; ":4096:8" is the setting torch's docs give.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel(SDPBackend.MATH):
            warnings.simplefilter("always")
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        for warning in caught:
            message = str(warning.message)
            if "deterministic" in message and message not in noticed:
                noticed.append(message)
                log(f"warning: a GPU op of the build has no deterministic kernel, so two builds may differ: {message}")
            elif "deterministic" not in message:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
