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


def test_the_graphed_static_cache_answers_as_the_dynamic_cache_on_cuda():
    """The `local` backend's default on CUDA (a static cache, each step a CUDA graph, the batch cut
    twice as rows finish, so the graph is captured three times): the same greedy answers as
    transformers' dynamic cache, row for row, at the real target's shape in float32."""
    import torch

    from benchmarks.small_decode import random_target
    from extract.regenerate.local import generate_batch
    from extract.regenerate.static_batch import StaticBatch

    model = random_target(torch.float32, "cuda").model
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=rng).tolist() for n in (5, 40, 17, 64, 9, 33, 28, 50)]
    caps = [6, 40, 12, 40, 6, 40, 40, 12]  # four rows end early: the batch shrinks at steps 6 and 12
    captures = []
    capture = StaticBatch._capture
    StaticBatch._capture = lambda self, slot: (captures.append(len(self.ids_B1)), capture(self, slot))[1]
    try:
        static = generate_batch(model, prompts, caps, set(), 0, cache="static")
    finally:
        StaticBatch._capture = capture
    dynamic = generate_batch(model, prompts, caps, set(), 0, cache="dynamic")
    assert captures == [8, 6, 4], captures  # graphs were captured, once per batch size
    assert [len(t) for t, _ in static] == caps
    same = sum(a == b for a, b in zip(static, dynamic, strict=True))
    assert same == len(prompts), (same, static, dynamic)
