"""On CUDA with the `fla` kernels: the whole extraction (`extract.pipeline`, target loaded by the
pipeline itself on cuda) of a tiny hybrid Qwen3.5-style target (Gated DeltaNet + attention layers)
stores what the reference path stores for the same weights and corpus: the CPU in float32, where the
Gated DeltaNet runs transformers' torch implementation (target.kernel_routing routes CPU tensors there even
with fla installed).

Tolerances, stated per extraction dtype on CUDA (float32 | bfloat16):
- taps (stored as bf16 in both): per sample and tap, max |cuda - ref| <= 2e-2 | 0.1 of max |ref|
  (bf16 storage alone rounds by 4e-3; fla's Triton dots use TF32 for float32 inputs);
- top-k log-probs, sorted per position: |cuda - ref| <= delta = 3e-2 | 0.25 (sorted values move by
  at most the logit error, so this holds even where two ids swap places);
- top-1 label (topk_ids[:, 0]): equal wherever the reference's top-1/top-2 log-prob margin exceeds
  delta (at least half the positions qualify: the lm_head is scaled so the logits spread, std 2).
For scale: the same comparison on the CPU alone (bf16 compute against float32) gives a worst tap
error of 1.2e-2 and a worst log-prob error of 0.07; a wrong kernel (decay, grouping, padding) errs by
the size of the values themselves.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import numpy as np
import pytest
import torch

from target.kernel_routing import external_kernels, route_kernels_by_device
from tests.extract.conftest import build_model, mixed_corpus, qwen35_text_config
from tests.extract.test_pipeline import make_config, run, samples_by_id
from tests.gpu import GPU

pytestmark = GPU

TOLERANCE = {"float32": (2e-2, 3e-2), "bfloat16": (0.1, 0.25)}  # (taps relative to max, log-prob delta)
LAYER_IDS = [0, 1, 2]
TOPK = 8


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, chat_tokenizer):
    """A saved tiny hybrid target (linear, full, linear, full attention) whose logits spread (std ~2)."""
    config = qwen35_text_config(
        len(chat_tokenizer),
        hidden_size=128,
        head_dim=32,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    model = build_model(config)
    bound = external_kernels(model)
    if not any(name.endswith("chunk_gated_delta_rule") for name in bound):
        pytest.skip(
            f"transformers binds no fla kernel for the Gated DeltaNet here (fla not importable); bound: {bound}"
        )
    print(f"transformers functions bound to external kernels: {bound}")
    route_kernels_by_device(model)  # this CPU forward must not reach fla (the pipeline's loads route by themselves)
    with torch.no_grad():
        probe = model(torch.arange(64)[None] % config.vocab_size, use_cache=False).logits
        model.lm_head.weight.mul_(2.0 / float(probe.std()))
    path = tmp_path_factory.mktemp("hybrid")
    model.save_pretrained(path)
    chat_tokenizer.save_pretrained(path)
    corpus, _ = mixed_corpus(path / "corpus.jsonl")
    out = path / "reference"
    run(make_config(out, corpus, target=str(path), layer_ids=LAYER_IDS, topk=TOPK, dtype="float32", device="cpu"), None)
    return path, corpus, samples_by_id(str(out))


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize(
    "dtype,packing", [("float32", False), ("bfloat16", False), ("float32", True), ("bfloat16", True)]
)
def test_cuda_extraction_with_fla_matches_the_reference(hybrid, tmp_path, dtype, packing):
    """Padded and packed (one row of several samples: fla's kernels take the boundaries) alike."""
    path, corpus, reference = hybrid
    tap_tol, delta = TOLERANCE[dtype]
    cfg = make_config(
        tmp_path / "out", corpus, target=str(path), layer_ids=LAYER_IDS, topk=TOPK, dtype=dtype, device="cuda"
    )
    summary = run(dataclasses.replace(cfg, packing=packing), None)
    assert summary["this_run"]["pad_efficiency"] == 1.0 or not packing
    got = samples_by_id(str(tmp_path / "out"))
    assert summary["samples"] == len(reference) == len(got) > 10 and got.keys() == reference.keys()
    checked = positions = 0
    worst_tap = worst_lp = 0.0
    for sid, ref in reference.items():
        cuda = got[sid]
        assert np.array_equal(cuda.input_ids, ref.input_ids) and np.array_equal(cuda.loss_mask, ref.loss_mask)
        width = ref.hidden.shape[1] // len(LAYER_IDS)
        a, b = bf16_values(cuda.hidden), bf16_values(ref.hidden)
        for slot in range(len(LAYER_IDS)):
            cols = slice(slot * width, (slot + 1) * width)
            error = float(np.abs(a[:, cols] - b[:, cols]).max() / np.abs(b[:, cols]).max())
            worst_tap = max(worst_tap, error)
            assert error <= tap_tol, (sid, f"tap {LAYER_IDS[slot]}", error)
        lp_error = np.abs(cuda.topk_logprobs - ref.topk_logprobs)
        worst_lp = max(worst_lp, float(lp_error.max()))
        assert lp_error.max() <= delta, (sid, float(lp_error.max()))
        clear = ref.topk_logprobs[:, 0] - ref.topk_logprobs[:, 1] > delta
        assert np.array_equal(cuda.topk_ids[clear, 0], ref.topk_ids[clear, 0]), sid
        checked, positions = checked + int(clear.sum()), positions + len(clear)
    assert checked >= positions // 2, f"only {checked} of {positions} positions have a top-1 margin above {delta}"
    print(
        f"{dtype}{' packed' if packing else ''}: worst tap error {worst_tap:.2e} (of max |ref|), "
        f"worst log-prob error {worst_lp:.2e}, "
        f"top-1 equal at all {checked} of {positions} positions with margin > {delta}"
    )


def test_one_model_class_serves_both_devices(hybrid, chat_tokenizer):
    """In one process the same transformers module functions reach fla for CUDA tensors and the torch
    implementation for CPU tensors; the two captures of one model agree (float32, tolerance above)."""
    from extract.capture import capture
    from target.load import reach_text_parts

    config = qwen35_text_config(
        len(chat_tokenizer),
        hidden_size=128,
        head_dim=32,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    cpu_model = build_model(config)
    cuda_model = copy.deepcopy(cpu_model).cuda()
    ids = torch.randint(0, config.vocab_size, (2, 40))
    ref = capture(reach_text_parts(cpu_model), ids, [40, 25], LAYER_IDS, TOPK)
    got = capture(reach_text_parts(cuda_model), ids, [40, 25], LAYER_IDS, TOPK)
    for slot, (a, b) in enumerate(zip(got.taps, ref.taps, strict=True)):
        for row, length in enumerate((40, 25)):  # real tokens only: padding positions hold anything
            x, y = a[row, :length].cpu(), b[row, :length]
            error = float((x - y).abs().max() / y.abs().max())
            assert error <= TOLERANCE["float32"][0], (slot, row, error)


def test_fla_convolution_equals_the_reference_with_and_without_packing():
    """fla's Triton causal_conv1d, as `target.kernel_routing` rebinds it, against transformers' reference
    convolution on random CUDA inputs (float32, SiLU): whole rows, and a packed row whose samples
    must each equal their own convolution (nothing carried across a boundary)."""
    import torch.nn.functional as F

    from target.kernel_routing import conv_via_fla, fla_causal_conv1d

    kernel = fla_causal_conv1d()
    if kernel is None:
        pytest.skip("fla's causal_conv1d is not importable here")

    def reference(x_BDT, weight, bias=None, activation=None):
        out = F.conv1d(x_BDT, weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x_BDT.shape[1])
        return F.silu(out[..., : x_BDT.shape[-1]])

    conv = conv_via_fla(reference, kernel)
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight, bias = torch.randn(256, 4, device="cuda", generator=gen), torch.randn(256, device="cuda", generator=gen)
    x = torch.randn(2, 256, 300, device="cuda", generator=gen)
    assert torch.allclose(conv(x, weight, bias, activation="silu"), reference(x, weight, bias), atol=2e-3, rtol=2e-3)
    cu = torch.tensor([0, 37, 38, 200, 300], dtype=torch.int32, device="cuda")
    packed = conv(x[:1], weight, bias, activation="silu", cu_seq_lens_q=cu)
    for a, b in itertools.pairwise(cu.tolist()):
        alone = reference(x[:1, :, a:b], weight, bias)
        assert torch.allclose(packed[..., a:b], alone, atol=2e-3, rtol=2e-3), (a, b)
