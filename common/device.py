"""Device, precision and CPU-thread choices shared by the stages (train, eval, the tiny build, the demo).

`device = "auto" | "cpu" | "cuda"`: auto takes the GPU when torch sees one. `precision = "auto" |
"fp32" | "bf16"`: the autocast dtype, auto meaning bf16 on a GPU and plain fp32 on a CPU (where bf16
autocast is slower on most machines and changes the numbers the tests compare).
`small_model_threads()`: torch CPU threads for the tiny default's small models.
"""

from __future__ import annotations

import os

import torch

# Torch CPU threads for small models (the tiny default: a 2.6 M-parameter target, a 0.5 M-parameter
# drafter). Their ops last tens to hundreds of microseconds, so extra threads add fork-join and
# wake-up time (OMP_WAIT_POLICY=PASSIVE: sleeping threads are woken per parallel region) and remove
# little work: torch splits an elementwise op into grains of 32K elements, and a 1,024-token batch
# of width 128 has 128K, so threads past 4 get nothing to do there. A second thread barely helps
# these models and torch's default thread count on a many-core host makes them slower
# (`python -m benchmarks.tiny_threads`; docs/benchmarks-log-2026-11-30-to-2026-12-04.md, "Demo: the tiny default end
# to end").
# Hence: the usable cores, at most 4 (a user's OMP_NUM_THREADS wins).
SMALL_MODEL_MAX_THREADS = 4


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


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask (a container's or taskset's share), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def small_model_threads() -> int:
    """Torch CPU threads for the tiny default's models: OMP_NUM_THREADS when it is set (the user's
    choice), else the usable cores, at most `SMALL_MODEL_MAX_THREADS`."""
    configured = os.environ.get("OMP_NUM_THREADS", "").strip()
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, min(usable_cores(), SMALL_MODEL_MAX_THREADS))


def describe_machine() -> dict:
    """What a run ran on, for its records: CPU model, usable cores, torch version, and the GPU
    torch sees (None without one)."""
    import platform

    cpu = platform.machine()  # (platform.processor() runs a subprocess)
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": usable_cores(), "torch": torch.__version__, "gpu": gpu}
