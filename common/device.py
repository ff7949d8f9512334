"""Device and precision choices shared by the stages that run the drafter (train, eval).

`device = "auto" | "cpu" | "cuda"`: auto takes the GPU when torch sees one. `precision = "auto" |
"fp32" | "bf16"`: the autocast dtype, auto meaning bf16 on a GPU and plain fp32 on a CPU (where bf16
autocast is slower on most machines and changes the numbers the tests compare).
"""

from __future__ import annotations

import torch


def resolve_device(choice: str) -> torch.device:
    """The torch device for a `device` config value; ValueError naming the key if cuda is asked
    for and torch sees no GPU."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("config key 'device': cuda was asked for but no CUDA device is available")
        return torch.device("cuda")
    return torch.device("cpu")


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for a `precision` config value on `device` (None = plain fp32)."""
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return torch.bfloat16 if use_bf16 else None
