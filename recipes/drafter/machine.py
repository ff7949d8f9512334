"""What the drafter command and the demos run on: the device their steps use, the torch CPU threads
the built-in targets' steps get, and the machine (CPU, cores, GPU, torch version) for the records."""

from __future__ import annotations

import torch

from common.device import describe_machine, small_model_threads


def device_with_reason(asked: str) -> tuple[str, str]:
    """(the device name `device` resolves to, why); `common.device.resolve_device` makes the torch device."""
    if asked != "auto":
        return asked, "your setting"
    if torch.cuda.is_available():
        return "cuda", f"torch sees a GPU ({torch.cuda.get_device_name(0)})"
    return "cpu", "torch sees no GPU"


def this_machine() -> dict:
    """{"device": cuda when torch sees a GPU else cpu, "threads": small_model_threads(), CPU, cores, GPU, torch}."""
    return {
        "device": device_with_reason("auto")[0],
        "threads": small_model_threads(),
        **describe_machine(),
    }
