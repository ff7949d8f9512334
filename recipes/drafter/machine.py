"""What the drafter command and the demos run on: the device their steps use, the torch CPU threads
the built-in targets' steps get, and the machine (CPU, cores, GPU, torch version) for the records."""

from __future__ import annotations

import torch

from common.device import describe_machine, small_model_threads


def this_machine() -> dict:
    """{"device": cuda when torch sees a GPU else cpu, "threads": small_model_threads(), CPU, cores, GPU, torch}."""
    return {
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "threads": small_model_threads(),
        **describe_machine(),
    }
