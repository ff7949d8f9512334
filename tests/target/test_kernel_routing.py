"""A hybrid (Gated DeltaNet) target on the CPU of a host where `fla` is installed.

transformers binds `chunk_gated_delta_rule` to fla's Triton kernel at import whenever `fla` is
importable, and fla's kernels fail on CPU tensors ("Pointer argument (at 0) cannot be accessed from
Triton (cpu tensor?)"): every CPU extraction or speculative decoding of a Qwen3.5/3.6 target broke on
such hosts. Here a stand-in `fla` package that fails exactly so on CPU tensors is put first on the
path of a child process (the real one may or may not be installed on this machine).

Proves (transformers < 5.25; later releases choose the kernel per call from the inputs' device, so
the stand-in is never reached and only the capture's equality is checked): without the routing the
stand-in kernel is reached and fails; after `reach_text_parts`
(which every target load goes through) the module functions bound to it pass CPU tensors to
transformers' torch implementation, so capture works and equals the capture of the same weights in
this process (torch implementation, fla or not); CUDA tensors still go to the kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from extract.capture import capture
from target import kernel_routing
from target.load import reach_text_parts
from tests.extract.conftest import build_model, qwen35_text_config
from tests.paths import REPO, child_pythonpath

FAKE_FLA = '''
"""Stand-in for fla: its kernels fail on CPU tensors the way Triton does."""
CALLS = []


def _kernel(name):
    def kernel(q, *args, **kwargs):
        CALLS.append((name, q.device.type))
        raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")

    kernel.__name__ = name
    return kernel


chunk_gated_delta_rule = _kernel("chunk_gated_delta_rule")
fused_recurrent_gated_delta_rule = _kernel("fused_recurrent_gated_delta_rule")
'''

CHILD = """
import sys
import torch

torch.set_num_threads(1)
import fla
from target.kernel_routing import external_kernels, route_kernels_by_device
from target.load import reach_text_parts
from extract.capture import capture
from tests.extract.conftest import build_model, qwen35_text_config

weights, out = sys.argv[1], sys.argv[2]
model = build_model(qwen35_text_config(300))
model.load_state_dict(torch.load(weights))
ids = torch.load(weights.replace("weights", "ids"))
try:
    model(ids, use_cache=False)
    before = "no error"
except ValueError as exc:
    before = str(exc)
fla_calls = len(fla.CALLS)
routed = route_kernels_by_device(model)
kernels = external_kernels(model)
got = capture(reach_text_parts(model), ids, [37, 20], [0, 1, 2], topk=4)
torch.save({"before": before, "fla_calls_before": fla_calls, "fla_calls_after": len(fla.CALLS) - fla_calls,
            "routed": routed, "kernels": kernels, "taps": got.taps, "topk_ids": got.topk_ids,
            "topk_logprobs": got.topk_logprobs}, out)
"""


def test_a_cpu_hybrid_target_runs_where_fla_is_installed(tmp_path):
    fake = tmp_path / "fake"
    (fake / "fla").mkdir(parents=True)
    (fake / "fla" / "__init__.py").write_text(FAKE_FLA)
    model = build_model(qwen35_text_config(300))
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    ids = torch.randint(0, 300, (2, 37))
    ids[1, 20:] = 0  # right padding of the second sample
    torch.save(ids, tmp_path / "ids.pt")
    env = dict(
        os.environ,
        PYTHONPATH=child_pythonpath(str(fake)),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
    )
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path / "weights.pt"), str(tmp_path / "out.pt")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    child = torch.load(tmp_path / "out.pt")
    if child["fla_calls_before"] == 0:
        # transformers >= 5.25 chooses its kernel per call from the inputs' device: the bug does not occur,
        # there is nothing to route, and the capture below must still work.
        assert child["before"] == "no error" and child["routed"] == [] and child["fla_calls_after"] == 0, child
    else:
        assert "cannot be accessed from Triton" in child["before"]  # the bug, reproduced (transformers < 5.25)
        assert any(name.endswith(".torch_chunk_gated_delta_rule") for name in child["routed"]), child["routed"]
        assert child["fla_calls_after"] == 0  # routed: the kernel never saw a CPU tensor again
        assert set(child["kernels"]) >= set(child["routed"]) and all(
            k.startswith("fla.") for k in child["kernels"].values()
        )

    reference = capture(reach_text_parts(model), ids, [37, 20], [0, 1, 2], topk=4)  # this process: torch implementation
    for got, ref in zip(child["taps"], reference.taps, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(child["topk_ids"], reference.topk_ids)
    torch.testing.assert_close(child["topk_logprobs"], reference.topk_logprobs, atol=1e-6, rtol=1e-5)


def test_routing_sends_cuda_tensors_to_the_kernel_and_the_rest_to_torch(monkeypatch):
    calls = []

    def kernel(q, k, *, cu_seqlens=None):
        calls.append("kernel")
        return q

    def reference(q, k):  # no **kwargs: arguments it does not take are dropped, as transformers does
        calls.append("torch")
        return q + k

    routed = kernel_routing._routed(kernel, reference)
    x = torch.ones(2)
    assert torch.equal(routed(x, x, cu_seqlens=None), 2 * x) and calls == ["torch"]
    monkeypatch.setattr(kernel_routing, "_kernel_takes", lambda tensor: True)  # as a CUDA tensor
    assert torch.equal(routed(x, x), x) and calls == ["torch", "kernel"]
    monkeypatch.undo()
    assert not kernel_routing._kernel_takes(torch.ones(1, dtype=torch.float64))
    assert kernel_routing._external_kernel(routed) is None and routed._dflash_routed  # never wrapped twice
