"""On CUDA: flex attention with the DFlash BlockMask equals SDPA with the dense mask, forward and
gradients, at the Qwen3.6-27B drafter's head shape and at the tiny shapes; where flex cannot run
(head_dim < 16) `attention=auto` picks SDPA and an explicit flex is refused naming the key.

Reference: SDPA (math kernel) in float64 on the same inputs. Tolerances, as errors relative to the
reference's largest magnitude: fp32 (TF32 off) 1e-3; bf16 (the training dtype) 5e-2, and flex's
bf16 error at most 4x SDPA's own bf16 error plus 2e-3 (both round q, k, v and the output to bf16,
so neither can be exact; flex must be as accurate as the kernel it replaces). Padding blocks
(keep = False) must give exactly zero output and zero query gradient in both kernels.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.train import SHAPES
from recipes.tiny import TinyConfig
from tests.gpu import GPU
from tests.train.test_model import QWEN36_TEXT
from train.attention import attend
from train.config import ModelConfig
from train.drafter_config import DrafterConfig
from train.kernels import TRAIN_KEYS, KernelPlan, choose_kernels, flex_problem

pytestmark = GPU

CUDA = torch.device("cuda")


def drafter_heads_27b() -> tuple[int, int, int]:
    """(query heads, kv heads, head_dim) of the drafter the trainer builds for Qwen3.6-27B."""
    cfg = DrafterConfig.from_target(QWEN36_TEXT, ModelConfig(), layer_ids=[1, 16, 31, 46], mask_token_id=248070)
    return cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim


def shapes() -> dict[str, tuple[int, int, int]]:
    tiny = TinyConfig()
    bench = SHAPES["tiny"]
    return {
        "27b": drafter_heads_27b(),
        "tiny-default": (tiny.num_heads, tiny.num_kv_heads, tiny.head_dim),
        "bench-tiny": (bench["num_attention_heads"], bench["num_key_value_heads"], bench["head_dim"]),
        "test-suite": (4, 2, 8),  # the tiny drafters of tests/train
    }


def test_the_27b_drafter_head_shape_is_the_published_one():
    assert drafter_heads_27b() == (24, 4, 256)  # qwen3.6-27b.md: 24 / 4 heads, head_dim 256


def inputs(H: int, G: int, E: int, dtype: torch.dtype, seed: int = 0):
    """q [B,H,Q,E], k/v [B,G,S+Q,E], the mask rule's anchors/keep (one padding block), a grad."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, N, K, S = 2, 6, 16, 200
    Q = N * K
    anchors_BN = torch.randint(1, S + 1, (B, N), generator=g)
    keep_BN = torch.ones(B, N, dtype=torch.bool)
    keep_BN[1, -1] = False
    q = torch.randn(B, H, Q, E, generator=g)
    k = torch.randn(B, G, S + Q, E, generator=g)
    v = torch.randn(B, G, S + Q, E, generator=g)
    grad = torch.randn(B, H, Q, E, generator=g)
    to = dict(device=CUDA, dtype=dtype)
    return q.to(**to), k.to(**to), v.to(**to), grad.to(**to), anchors_BN.to(CUDA), keep_BN.to(CUDA), S, K


def run(kernel: str, q, k, v, grad, anchors_BN, keep_BN, S, K):
    """Output and (dq, dk, dv) of `attend` with the mask form the kernel takes (as the trainer builds it)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    mask = KernelPlan(CUDA, None, kernel, False, "test").mask(anchors_BN, keep_BN, S, K)
    out = attend(q, k, v, mask)
    out.backward(grad)
    return [t.double() for t in (out.detach(), q.grad, k.grad, v.grad)]


def rel_errors(got, ref) -> list[float]:
    return [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref, strict=True)]


@pytest.fixture
def no_tf32():
    """Full fp32 matmuls (the fp32 tolerance assumes them); the setting is restored afterwards."""
    matmul = torch.backends.cuda.matmul
    previous = matmul.allow_tf32
    matmul.allow_tf32 = False
    yield
    matmul.allow_tf32 = previous


@pytest.mark.parametrize("name", list(shapes()))
def test_flex_equals_sdpa_forward_and_gradients(name, no_tf32):
    H, G, E = shapes()[name]
    plan = choose_kernels("cuda", "auto", "auto", False, [E], training=True, keys=TRAIN_KEYS)
    problem = flex_problem(CUDA, E, training=True)
    if problem is not None:  # e.g. head_dim 8: auto must not pick flex, and an explicit flex must be refused
        assert plan.attention == "sdpa" and problem in plan.reason
        with pytest.raises(ValueError, match="config key 'model.attention'"):
            choose_kernels("cuda", "auto", "flex", False, [E], training=True, keys=TRAIN_KEYS)
        return
    assert plan.attention == "flex", plan.reason
    data64 = inputs(H, G, E, torch.float64)
    reference = run("sdpa", *data64)

    fp32 = rel_errors(
        run("flex", *(t.float() if t.is_floating_point() else t for t in data64[:6]), *data64[6:]), reference
    )
    assert max(fp32) <= 1e-3, (name, "fp32 out/dq/dk/dv", fp32)

    bf16_data = [t.to(torch.bfloat16) if t.is_floating_point() else t for t in data64[:6]] + list(data64[6:])
    flex_bf16 = run("flex", *bf16_data)
    sdpa_bf16 = run("sdpa", *bf16_data)
    flex_err, sdpa_err = rel_errors(flex_bf16, reference), rel_errors(sdpa_bf16, reference)
    for what, f, s in zip(("out", "dq", "dk", "dv"), flex_err, sdpa_err, strict=True):
        assert f <= 5e-2 and f <= 4 * s + 2e-3, (name, what, f"flex {f:.2e} vs sdpa {s:.2e}")

    # The padding block (row 1, last block): nothing to attend to, so output 0 and no gradient, in both kernels.
    K = data64[7]
    for result in (flex_bf16, sdpa_bf16):
        out, dq = result[0], result[1]
        assert torch.count_nonzero(out[1, :, -K:]) == 0 and torch.count_nonzero(dq[1, :, -K:]) == 0
        assert torch.count_nonzero(out[0]) > 0
