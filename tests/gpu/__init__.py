"""The GPU tier: tests of the CUDA paths, marked `gpu` and run by `make test-gpu` (`pytest -m gpu`).

`make test` collects them too: without CUDA each one skips, printing why; on a GPU host they run.
Every module here sets `pytestmark = GPU`.
"""

from __future__ import annotations

import pytest
import torch


def no_cuda_reason() -> str:
    return (
        f"needs a CUDA GPU: torch {torch.__version__} (CUDA build {torch.version.cuda}) sees none; "
        "the GPU tier runs on a GPU host with `make test-gpu`"
    )


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=no_cuda_reason())]
