"""`python -m benchmarks.regenerate ops --shape smollm2` on CUDA: the kernel table it prints (where a
decoding step of the local regeneration backend spends the GPU's time) finds kernels and accounts for
no more GPU time than the step's wall time allows."""

from __future__ import annotations

import json

from benchmarks import regenerate as bench
from tests.gpu import GPU

pytestmark = GPU


def test_ops_lists_the_kernels_of_a_decoding_step(tmp_path):
    out = tmp_path / "ops.json"
    argv = ["ops", "--shape", "smollm2", "--device", "cuda", "--batch", "8", "--prompt-len", "16", "--steps", "4"]
    assert bench.main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    kernels = report["cuda_kernels"]
    assert kernels["top"] and all(row["calls_per_step"] > 0 for row in kernels["top"])
    assert 0 < kernels["kernel_ms_per_step"] <= report["seconds_per_step"] * 1e3 * 1.05
    assert report["dtype"] == "torch.float32"  # the real-target pipeline's dtype
