"""The learning-rate schedule shared by the drafter trainer (`train/step.py`, `lr_at`) and the tiny target's
training (`recipes/tiny/target.py`): linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math


def warmup_cosine(done: int, total_steps: int, warmup_steps: int, peak: float, floor: float = 0.0) -> float:
    """Learning rate after `done` completed steps: linear warmup to `peak` over `warmup_steps`, then
    cosine decay to `floor * peak` at `total_steps` (held there after it)."""
    if done < warmup_steps:
        return peak * (done + 1) / warmup_steps
    progress = (done - warmup_steps) / max(1, total_steps - warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    if floor == 0.0:
        return peak * cosine
    return peak * (floor + (1.0 - floor) * cosine)
